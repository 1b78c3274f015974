"""DCP records compressed with torch's zstd extension (``transform_descriptors``): a real gloo job's
``dcp.save(FileSystemWriter(_extensions=[ZStandard()]))`` is read bitwise, and dcptool's
``--compress zstd`` output is loaded by ``dcp.load`` in a real gloo job."""

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import dcptool, oracle, read_tensor
from jobs import STORAGE_JOBS, run_job
from test_records import KINDS, TORCH_DOES_NOT_SEE, checked, damage_at, refused
from dcptool import formats
from dcptool.engine import compression
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles

zstandard = oracle("zstandard")  # zstd DCP needs it (pip install 'dcptool[zstd]')


@pytest.fixture(scope="module")
def saved(storage_saves):
    """A real job's zstd DCP (conftest.STORAGE_SAVES)."""
    return storage_saves("zstd")


def test_zstd_save_is_read_bitwise(saved, tmp_path):
    checkpoint = formats.open_checkpoint(saved)
    assert {c.encoding for t in checkpoint.tensors.values() for c in t.chunks} == {"zstd-archive"}
    assert checkpoint.object_value(checkpoint.objects["train_state.step"]) == 7
    # A decompressed object is read from its data file, which inspect counts once.
    assert checkpoint.data_files() == sorted(p.name for p in saved.glob("*.distcp"))
    expected = torch.load(f"{saved}.reference.pt", weights_only=True)
    for key, tensor in expected.items():
        assert torch.equal(read_tensor(checkpoint, key), tensor), key
    dcptool("convert", saved, tmp_path / "out.pt", "--to", "torch", "--max-memory", "64KiB")
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in expected.items())


def test_compressed_output_loads_in_a_real_job(saved, tmp_path):
    dcptool("reshard", saved, tmp_path / "out", "--dp", "2", "--compress", "zstd")
    out = formats.open_checkpoint(tmp_path / "out")
    assert {c.encoding for t in out.tensors.values() for c in t.chunks} == {"zstd-archive"}
    job = run_job(2, "load-zstd", tmp_path / "out", f"{saved}.reference.pt", module=STORAGE_JOBS)
    assert job.stdout.count("5 tensors equal") == 2


def test_other_transforms_are_named():
    assert compression.encoding_of(None, "x") == "torch-archive"
    with pytest.raises(CheckpointError, match=r"transforms \[stream.lz4/1\]; dcptool reads stream.zstd/1 only"):
        compression.encoding_of(["stream.lz4/1"], "ckpt/.metadata: w chunk at [0]")


def test_zstd_bomb_is_refused(saved, tmp_path):
    """A record whose archive holds a 9 MiB storage for a chunk of 96 bytes (zeros: it compresses to about
    1 KB) is refused before its storage is decompressed."""
    bomb = tmp_path / "bomb"
    shutil.copytree(saved, bomb)
    metadata = pickle.loads((bomb / ".metadata").read_bytes())  # written by torch in the job above
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if index.fqn == "embed.weight" and info.relative_path == "__0_0.distcp")
    archive = io.BytesIO()
    torch.save(torch.zeros(9 * 2**20 // 4)[:24].view(4, 6), archive)  # a view saves all of its storage
    data = zstandard.ZstdCompressor().compress(archive.getvalue())
    with open(bomb / info.relative_path, "ab") as file:
        end = file.tell()
        file.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=end, length=len(data))
    (bomb / ".metadata").write_bytes(pickle.dumps(metadata))
    result = dcptool("convert", bomb, tmp_path / "out.pt", "--to", "torch", check=False)
    assert result.returncode == 2 and "decompresses to more than the 1,048,672 bytes it can hold" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.pt").exists()


def test_corrupt_stream_is_one_line(saved, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    chunk = formats.open_checkpoint(broken).tensors["proj.weight"].chunks[1]
    with open(broken / chunk.file, "r+b") as file:
        file.seek(chunk.offset)
        file.write(b"\0\0\0\0")  # no zstd frame starts so
    result = dcptool("convert", broken, tmp_path / "out.pt", "--to", "torch", check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    named = f"{chunk.file}: the zstd record of proj.weight chunk at {list(chunk.offsets)} at byte {chunk.offset:,}"
    assert f"{named} is corrupt (" in result.stderr
    assert not (tmp_path / "out.pt").exists()


# Runs dcptool's command line once per argument list, recording every temporary file or folder Python's
# tempfile makes (the audit events it raises): wherever TMPDIR points, tempfile falls back to /tmp.
TEMPFILE_WATCH = """
import json, sys
made = []
sys.addaudithook(lambda event, args: made.append(str(args[0])) if event.startswith("tempfile.mk") else None)
from dcptool.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as exit:
        codes.append(exit.code)
print(json.dumps({"codes": codes, "temporaries": made}))
"""


def test_read_with_no_temporary_files(saved, tmp_path):
    """convert, reshard and verify of zstd DCP write nothing under TMPDIR, even where it cannot be written."""
    if os.geteuid() == 0:  # root writes through any mode: a folder that does not exist instead
        tmpdir = tmp_path / "absent"
    else:
        tmpdir = tmp_path / "read-only"
        tmpdir.mkdir(mode=0o500)
    runs = [["convert", str(saved), str(tmp_path / "out.pt"), "--to", "torch", "--max-memory", "64KiB"],
            ["reshard", str(saved), str(tmp_path / "dp1"), "--dp", "1"],
            ["verify", str(saved), f"{saved}.reference.pt", "--exclude", "^train_state"]]
    env = dict(os.environ, TMPDIR=str(tmpdir), TEMP=str(tmpdir), TMP=str(tmpdir))
    done = subprocess.run([sys.executable, "-c", TEMPFILE_WATCH, json.dumps(runs)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"codes": [0, 0, 0], "temporaries": []}, done.stderr
    assert not tmpdir.exists() or not any(tmpdir.iterdir())
    for out in (tmp_path / "out.pt", tmp_path / "dp1"):  # checked against torch's own save of the state
        dcptool("verify", out, f"{saved}.reference.pt", "--exclude", "^train_state")


def test_a_record_is_decompressed_once_when_read_in_order(tmp_path):
    """Slabs of one record read one after another, each by a thread of its own as copy tasks are, continue
    one cursor; a read behind every cursor starts another; reads from many threads at once get the right bytes."""
    data = np.random.default_rng(0).integers(0, 16, 2**21, dtype=np.uint8).tobytes()  # 2 MiB that compress to half
    compressed = zstandard.ZstdCompressor().compress(data)
    (tmp_path / "records").write_bytes(b"x" * 100 + compressed)
    files = compression.DecompressingFiles(CheckpointFiles(tmp_path))
    name = files.record("records", 100, len(compressed), len(data))
    out, slab = bytearray(len(data)), len(data) // 8
    for start in range(0, len(data), slab):
        reader = threading.Thread(target=files.read_into, args=(name, start, memoryview(out)[start:start + slab]))
        reader.start()
        reader.join()
        assert [c.pos for c in files._cursors] == [start + slab]  # the one cursor, where this read stopped
    assert out == data
    files.read_into(name, slab, memoryview(out)[slab:slab + 10])
    assert sorted(c.pos for c in files._cursors) == [slab + 10, len(data)]

    rows = [(start, memoryview(bytearray(4096))) for start in range(0, len(data) - 4096, 65533)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda row: files.read_into(name, *row), rows[::-1] + rows))
    assert all(bytes(buffer) == data[start:start + 4096] for start, buffer in rows)
    assert len(files._cursors) <= compression.CURSORS


# Records checked as plain records are: each storage's CRC-32 over its decompressed bytes as they pass, against
# the data descriptor and central directory that follow it in the stream; the archive's structure as opened.


@pytest.fixture(scope="module")
def large(storage_saves):
    """A real job's zstd DCP with a tensor whose records decompress to 128 KiB (more than a record's head)."""
    return storage_saves("zstd-large")


def damaged_copy(source, copy, key: str, kind: str) -> str:
    """``source`` copied to ``copy`` with the first record of ``key`` (by file) decompressed, damaged (``kind``,
    found with zipfile: test_records' ``damage_at``), compressed again and written back at the end of its file,
    the metadata (torch's own, unpickled and pickled again) pointing there. Returns the record's file name."""
    shutil.copytree(source, copy)
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    index, info = min(((index, info) for index, info in metadata.storage_data.items() if index.fqn == key),
                      key=lambda item: item[1].relative_path)
    with open(copy / info.relative_path, "rb") as file:
        file.seek(info.offset)
        record = bytearray(zstandard.ZstdDecompressor().stream_reader(file.read(info.length),
                                                                      read_across_frames=True).read())
    record[damage_at(bytes(record), kind)] ^= 0x01
    data = zstandard.ZstdCompressor().compress(bytes(record))
    with open(copy / info.relative_path, "ab") as file:
        end = file.tell()
        file.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=end, length=len(data))
    (copy / ".metadata").write_bytes(pickle.dumps(metadata))
    return info.relative_path


@pytest.mark.parametrize("kind", KINDS)
def test_a_damaged_zstd_record_is_refused_where_it_is_read(large, tmp_path, kind):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    copy, key = tmp_path / "damaged", "large.weight"
    name = damaged_copy(large, copy, key, kind)
    if kind in TORCH_DOES_NOT_SEE:  # torch loads it: damaged bytes as wrong values
        dcp_to_torch_save(copy, tmp_path / "torch.pt")
        loaded = torch.load(tmp_path / "torch.pt", weights_only=True)[key]
        expected = torch.load(f"{large}.reference.pt", weights_only=True)[key]
        assert torch.equal(loaded, expected) == (kind == "CRC field")
    else:
        with pytest.raises(BaseException):  # noqa: B017 - torch's CheckpointException wraps its reader's error
            dcp_to_torch_save(copy, tmp_path / "torch.pt")
    report = checked(copy, name, key)
    assert [p["kind"] for p in report["problems"]] == ["record"]
    out = tmp_path / "out"
    line = refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, name, key)
    assert kind != "data bytes" or "CRC-32" in line
    refused(["reshard", copy, out, "--dp", "1", "--no-fsync"], out, name, key)
    refused(["verify", copy, f"{large}.reference.pt", "--exclude", "^train_state"], out, name, key)
    if kind in TORCH_DOES_NOT_SEE:
        assert dcptool("convert", copy, out, "--to", "torch", "--no-fsync", "--no-verify-records").returncode == 0


def test_zstd_records_are_decompressed_once_as_they_are_checked(large, tmp_path):
    """An intact zstd checkpoint checks fine; a copy decompresses each record once, checking its CRC-32 as the
    bytes pass: what it decompresses beyond what it reads unchecked is the records' trailers (their data
    descriptors and central directories, under 1 KiB a record); a reshard that splits each record among ranks
    and small tasks decompresses it once too (the tasks reading one record run in order)."""
    assert json.loads(dcptool("check", large, "--json").stdout)["ok"]
    done = subprocess.run([sys.executable, "-c", COUNT_DECOMPRESSED, str(large), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    checked_bytes, unchecked, resharded = json.loads(done.stdout.splitlines()[-1])
    records = sum(1 for t in formats.open_checkpoint(large).tensors.values() for _ in t.chunks)
    assert unchecked < checked_bytes < unchecked + 1024 * records
    # reshard --dp 4 in 64 KiB tasks: every rank's piece, on threads of their own, reads each record in order. A
    # record decompressed again from its start up to a task's offset would cost at least a task (64 KiB); which
    # thread keeps a record's few hundred bytes of trailer depends on scheduling, so those are not counted exactly.
    assert resharded < checked_bytes + 32 * 1024
    for out in ("checked.pt", "unchecked.pt", "dp4"):
        dcptool("verify", tmp_path / out, f"{large}.reference.pt")


# Counts the bytes decompressed by convert with record checks and without (--no-verify-records), and by a
# reshard to 4 ranks in 64 KiB tasks.
COUNT_DECOMPRESSED = """
import json, sys
from dcptool.engine import compression
from dcptool.cli import main
counted = [0]
read = compression._Cursor.read
def counting(self, offset, buffers, whole=True):
    before = self.pos
    try:
        return read(self, offset, buffers, whole)
    finally:
        counted[0] += self.pos - before
compression._Cursor.read = counting
totals = []
for out, flags in (("checked.pt", ["--to", "torch"]), ("unchecked.pt", ["--to", "torch", "--no-verify-records"]),
                   ("dp4", ["--dp", "4", "--max-memory", "64KiB"])):
    counted[0] = 0
    try:
        main(["reshard" if out == "dp4" else "convert", sys.argv[1], f"{sys.argv[2]}/{out}", "--no-fsync", *flags])
    except SystemExit as exit:
        assert not exit.code, exit.code
    totals.append(counted[0])
print(json.dumps(totals))
"""


@pytest.mark.parametrize("key", ["proj.weight", "train_state.step"])
def test_a_damaged_small_zstd_record_is_refused(saved, tmp_path, key):
    """Records that end within their head (the job's small chunks) are checked whole when opened; an object's
    record is decompressed whole and checked as a plain one."""
    copy = tmp_path / "damaged"
    name = damaged_copy(saved, copy, key, "data bytes" if key != "train_state.step" else "CRC field")
    checked(copy, name, key)
    out = tmp_path / "out"
    refused(["convert", copy, out, "--to", "torch", "--no-fsync"], out, name, key)


def test_a_corrupt_object_stream_names_its_key(saved, tmp_path):
    copy = tmp_path / "broken"
    shutil.copytree(saved, copy)
    metadata = pickle.loads((copy / ".metadata").read_bytes())
    info = next(info for index, info in metadata.storage_data.items() if index.fqn == "train_state.step")
    with open(copy / info.relative_path, "r+b") as file:
        file.seek(info.offset)
        file.write(b"\0\0\0\0")  # no zstd frame starts so
    named = f"{info.relative_path}: the zstd record of train_state.step at byte {info.offset:,} is corrupt ("
    out = tmp_path / "out.pt"
    refused(["convert", copy, out, "--to", "torch"], out, named)
    checked(copy, named)
