"""The byte mover (dcptool.engine.transfer) and the archive layout it writes into (torch_archive.ArchiveLayout)."""

import errno
import os
import threading
import zipfile
import zlib

import pytest
import torch

from conftest import dcptool, load_reference
from dcptool import formats
from dcptool.planning import conversion
from dcptool.engine import transfer
from harness.conversions import convert_checkpoint
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import ArchiveLayout, StorageOut, TensorOut, dumps
from dcptool.torch_archive.records import RecordChecks


def test_zip64_archive_loads_in_torch(tmp_path):
    """A storage past 4 GiB and a record that starts past 4 GiB need zip64 fields; torch and zipfile read them.

    The file is sparse: only headers and the small storage are written, the big storage reads as zeros.
    """
    big = StorageOut("0", "bfloat16", 2**31 + 3)  # 4 GiB + 6 bytes
    small = StorageOut("1", "float32", 3)
    layout = ArchiveLayout(dumps({"big": TensorOut(big, (big.numel,)), "small": TensorOut(small, (3,))}))
    layout.add_storage("0", 2 * big.numel)
    small_start = layout.add_storage("1", 12)
    length = layout.close()
    values = torch.tensor([1.5, -2.0, 3.25])
    small_bytes = values.numpy().tobytes()
    zeros_crc = _crc_of_zeros(2 * big.numel)
    path = tmp_path / "big.pt"
    with open(path, "wb") as file:
        file.truncate(length)
        for offset, data in layout.segments({"0": zeros_crc, "1": zlib.crc32(small_bytes)}) + [(small_start, small_bytes)]:
            os.pwrite(file.fileno(), data, offset)
    assert small_start > 2**32
    infos = {info.filename: info for info in zipfile.ZipFile(path).infolist()}
    assert infos["archive/data/0"].file_size == 2 * big.numel and infos["archive/data/1"].header_offset > 2**32
    loaded = torch.load(path, weights_only=True, mmap=True)
    assert torch.equal(loaded["small"], values) and loaded["big"].shape == (big.numel,)
    assert loaded["big"][-4:].eq(0).all()


def _crc_of_zeros(length: int) -> int:
    """CRC-32 of ``length`` zero bytes, by doubling (computing it directly would read 4 GiB)."""
    crc, block, size = 0, zlib.crc32(b"\0"), 1
    while length:
        if length & 1:
            crc = transfer.crc32_combine(crc, block, size)
        block, size = transfer.crc32_combine(block, block, size), 2 * size
        length >>= 1
    return crc


@pytest.mark.parametrize("kernel_copy", ["yes", "remote source", "across filesystems"])
def test_outputs_are_the_same_with_or_without_kernel_copies(checkpoints, tmp_path, monkeypatch, kernel_copy):
    """Dim-0 shards go through copy_file_range, TP column blocks are assembled: with a tiny budget
    (many tasks per tensor, CRC-32s combined across them) the torch file still has every CRC right
    and equals the job's own full state dict; likewise where the kernel cannot copy (a remote source
    has no descriptor; copy_file_range refuses with EXDEV across filesystems)."""
    source, reference = checkpoints("fsdp2_dp2_tp2")
    checkpoint = formats.open_checkpoint(source)
    pieces = formats.get("hf").writer(tmp_path / "plan").plan(conversion.hf_export_entries(checkpoint)[0], [])
    kinds = {transfer.source_runs(checkpoint, piece) is None for piece in pieces}
    assert kinds == {True, False}  # both paths are exercised
    parts = []  # runs whose CRC-32 went to check their source record's
    add_part = RecordChecks.add_part
    monkeypatch.setattr(RecordChecks, "add_part", lambda self, *args: parts.append(args) or add_part(self, *args))
    monkeypatch.setattr(transfer, "KERNEL_COPY_RUN", 1)  # these chunks are small: copy them as large ones are
    if kernel_copy == "remote source":
        monkeypatch.setattr(CheckpointFiles, "local_fd", lambda self, relative: None)
    elif kernel_copy == "across filesystems":
        monkeypatch.setattr(os, "copy_file_range", _refuse_across_filesystems)
    out = tmp_path / "full.pt"
    convert_checkpoint(source, out, to="torch", max_memory=2**16)
    assert zipfile.ZipFile(out).testzip() is None
    assert parts  # the runs copied, by the kernel or not, checked their source records as they passed
    expected = load_reference(reference)
    loaded = torch.load(out, weights_only=True)
    flat, expected = dict(_flatten(loaded)), dict(_flatten(expected))
    tensors = [key for key, value in expected.items() if isinstance(value, torch.Tensor)]
    assert len(tensors) == len(checkpoint.tensors)
    for key in tensors:
        assert torch.equal(flat[key], expected[key]), key


def _refuse_across_filesystems(*args):
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{index}.")
    else:
        yield prefix[:-1], tree


def test_dcp_output_records_pass_the_zip_check(checkpoints, tmp_path):
    """Every chunk record of a resharded DCP checkpoint is a zip whose CRC-32s check out."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    dcptool("reshard", source, tmp_path / "dp4", "--dp", "4", "--tp", "1", "--max-memory", "64KiB")
    checkpoint = formats.open_checkpoint(tmp_path / "dp4")
    records = {(c.file, c.offset, c.length) for t in checkpoint.tensors.values() for c in t.chunks}
    assert len(records) > 20
    files = CheckpointFiles(tmp_path / "dp4")
    for file, offset, length in records:
        archive = zipfile.ZipFile(files.window(file, offset, length))
        assert archive.testzip() is None, (file, offset)


def test_a_failing_progress_callback_stops_the_remaining_tasks(checkpoints, tmp_path, monkeypatch):
    """Under torchrun the callback raises when another rank failed: the tasks not yet started are dropped.

    Every task after the first waits until the callback has raised, so however the threads are
    scheduled, at most one task per thread can have started besides the first (no timing involved).
    """
    source, _ = checkpoints("fsdp2_dp2")
    checkpoint = formats.open_checkpoint(source)
    writer = formats.get("hf").writer(tmp_path)
    placed = [(piece, *writer.place(piece)) for piece in writer.plan(conversion.hf_export_entries(checkpoint)[0], [])]
    total = len([t for p, f, o in placed for t in transfer.plan_tasks(checkpoint, p, f, o, 2**15)])
    started, failed = [], threading.Event()
    run = transfer._Mover.run

    def run_after_the_failure(self, task):
        started.append(task)
        if len(started) > 1:
            failed.wait()
        return run(self, task)

    monkeypatch.setattr(transfer._Mover, "run", run_after_the_failure)

    def another_rank_failed(nbytes):
        failed.set()
        raise RuntimeError("rank 1 failed")

    threads = 2
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        transfer.copy_pieces(checkpoint, placed, writer.out, crc=False, max_memory=2**16, threads=threads,
                             on_bytes=another_rank_failed)
    assert total > 20 and len(started) <= 1 + threads, (len(started), total)
