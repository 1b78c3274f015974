"""Checkpoints of many ranks: the synthetic generator against a real gloo save, and reading metadata
as columns (``converters.dcp.metadata`` rows, ``chunks.ChunkTable``) checked against torch's own readers."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import dcptool, read_dcp, read_tensor
from harness import synth_dcp

from dcptool import formats
from dcptool.planning import plans
from dcptool.converters.dcp import metadata as dcp_metadata
from dcptool.engine.chunks import ChunkTable
from dcptool.mesh import Mesh


def entries_like(metadata, files: Path, hf: plans.Plan) -> list:
    """The generator's entries for the state dict of a real AReaL-layout save: tensors placed by the
    plan (optimizer state as its parameter, step counters whole), bytes entries copied, held by every rank."""
    params = {key[len("dcp.model."):]: md for key, md in metadata.state_dict_metadata.items()
              if key.startswith("dcp.model.")}
    entries = []
    for key, path in metadata.planner_data.items():
        md = metadata.state_dict_metadata[key]
        if hasattr(md, "chunks"):
            name = key[len("dcp.model."):] if key.startswith("dcp.model.") else \
                key[len("dcp.optim.state."):].rsplit(".", 1)[0] if key.startswith("dcp.optim.state.") else None
            placed = name in params and params[name].size == md.size
            entries.append(synth_dcp.TensorEntry(tuple(path), tuple(md.size), str(md.properties.dtype)[len("torch."):],
                                                 (hf.rule_for(name) or synth_dcp.DEFAULT_RULE) if placed else None,
                                                 md.properties.requires_grad))
        else:
            info = next(info for index, info in metadata.storage_data.items() if index.fqn == key)
            payload = (files / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
            entries.append(synth_dcp.BytesEntry(tuple(path), payload))
    return entries


def test_generator_matches_a_real_fsdp2_tp_save(checkpoints, tmp_path):
    """Same metadata (chunks, storage records: files, offsets, lengths) as dcp.save from 4 gloo ranks
    of FSDP2 x TP, and torch's dcp_to_torch_save reads the same values as dcptool."""
    real, _ = checkpoints("fsdp2_dp2_tp2")
    metadata = FileSystemReader(str(real)).read_metadata()
    out = tmp_path / "synthetic"
    entries = entries_like(metadata, real, plans.BUILTIN["hf"])
    synth_dcp.write(out, entries, Mesh(dp=2, tp=2))
    made = FileSystemReader(str(out)).read_metadata()
    assert made.state_dict_metadata == metadata.state_dict_metadata
    assert made.storage_data == metadata.storage_data
    assert made.planner_data == metadata.planner_data
    for rank in range(4):
        assert (out / f"__{rank}_0.distcp").stat().st_size == (real / f"__{rank}_0.distcp").stat().st_size

    flat = read_dcp(out, tmp_path)
    checkpoint = formats.open_checkpoint(out)
    for number, entry in enumerate(entries):
        if isinstance(entry, synth_dcp.TensorEntry):
            expected = torch.from_numpy(synth_dcp.value_of(number, entry.shape)).to(getattr(torch, entry.dtype))
            assert torch.equal(flat[entry.key], expected), entry.key
            assert torch.equal(read_tensor(checkpoint, entry.key), expected), entry.key


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """64 ranks of FSDP2 x TP 2, 3 layers of rows that not every rank gets (empty chunks, uneven split)."""
    out = tmp_path_factory.mktemp("scale") / "llama-64"
    synth_dcp.main([str(out), "--ranks", "64", "--tp", "2", "--layers", "3", "--rows", "40", "--width", "6"])
    return out


def test_metadata_rows_read_as_torch_reads_them(synthetic):
    """The unpickler keeps chunk and storage records as rows; expanded, they are what pickle gives."""
    data = (synthetic / ".metadata").read_bytes()
    ours, theirs = dcp_metadata.unpickle(data, "x"), pickle.loads(data)
    assert any(type(k) is dcp_metadata.StorageRows for k in ours.storage_data)
    for key, md in theirs.state_dict_metadata.items():
        chunks = list(dcp_metadata.each_record(ours.state_dict_metadata[key].chunks))
        assert [(c.offsets, c.sizes) for c in chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
    mine = {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in dcp_metadata.each_item(ours.storage_data)}
    assert mine == {(i.fqn, tuple(i.offset)): (s.relative_path, s.offset, s.length) for i, s in theirs.storage_data.items()}


def test_chunk_tables_and_values(synthetic, tmp_path):
    """Tensors come as chunk tables; region lookups and whole reads give torch's values; the mesh is found."""
    checkpoint = formats.open_checkpoint(synthetic)
    weight = checkpoint.tensors["model.layers.1.self_attn.o_proj.weight"]  # FSDP on dim 0, TP on dim 1
    assert isinstance(weight.chunks, ChunkTable) and len(weight.chunks) == 42  # 20 x 2, and two empty
    found = weight.chunks.overlapping((3, 2), (5, 1))
    assert [c.offsets for c in found] == sorted((c.offsets for c in weight.chunks
                                                 if c.offsets[0] < 8 and c.offsets[0] + c.sizes[0] > 3
                                                 and c.offsets[1] <= 2 < c.offsets[1] + c.sizes[1]))
    flat = read_dcp(synthetic, tmp_path)
    for key in ("model.embed_tokens.weight", "model.layers.2.mlp.down_proj.weight", "model.norm.weight"):
        assert torch.equal(read_tensor(checkpoint, key), flat[key]), key
    assert "saved on mesh 64 ranks: dp=32 x tp=2" in dcptool("inspect", synthetic).stdout


def test_bad_chunk_tables_are_refused(synthetic, tmp_path):
    """Checks on columns name the file and the tensor: a truncated data file, a missing one."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in synthetic.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    last = broken / "__63_0.distcp"
    last.write_bytes(last.read_bytes()[:-10])
    result = dcptool("inspect", broken, check=False)
    assert result.returncode == 2 and "__63_0.distcp: truncated" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    last.unlink()
    result = dcptool("inspect", broken, check=False)
    assert result.returncode == 2 and "__63_0.distcp is missing" in result.stderr


def test_overlapping_chunks_are_refused(tmp_path):
    """A chunk table whose chunks overlap is refused by the cover check (numpy path falls back to the sweep)."""
    from dcptool.engine.chunks import check_cover
    from dcptool.engine.core import TensorInfo
    from dcptool.errors import CheckpointError

    table = ChunkTable(np.array([[0, 0], [1, 0]]), np.array([[2, 4], [2, 4]]), ["f"], np.array([0, 0]),
                       np.array([0, 100]), np.array([100, 100]), "torch-archive", [0])
    with pytest.raises(CheckpointError, match="overlap"):
        check_cover(TensorInfo(("w",), "float32", (3, 4), table), "x")


@pytest.fixture(scope="module")
def many_chunks(tmp_path_factory):
    """64 ranks of FSDP2 x TP 2, 8 layers: thousands of chunk records, a few dozen of each layout."""
    out = tmp_path_factory.mktemp("scale") / "llama-64-8"
    synth_dcp.main([str(out), "--ranks", "64", "--tp", "2", "--layers", "8", "--rows", "40", "--width", "6"])
    return out


def test_records_of_many_ranks_are_checked_a_layout_at_a_time(many_chunks, tmp_path, monkeypatch):
    """Reading every tensor checks every chunk record (zip structure and CRC-32s) as its bytes are read, yet opens
    as an archive one record of each dtype, shape and length only (the template of its layout), and keeps
    nothing per record: the memory the checks keep does not grow with the chunks."""
    import gc
    import tracemalloc

    from dcptool.torch_archive import reading
    from dcptool.torch_archive.records import record_checks

    opened = []
    open_archive = reading.Archive.__init__

    def counted(self, *args, **kwargs):
        opened.append(args[1:3])
        open_archive(self, *args, **kwargs)

    monkeypatch.setattr(reading.Archive, "__init__", counted)
    flat = read_dcp(many_chunks, tmp_path)
    checkpoint = formats.open_checkpoint(many_chunks)
    records = [(tensor.dtype, chunk.sizes, chunk.length) for tensor in checkpoint.tensors.values()
               for chunk in tensor.chunks if chunk.numel]
    for key in checkpoint.tensors:  # the thread's buffers made, as a copy's threads make theirs
        assert torch.equal(read_tensor(checkpoint, key), flat[key]), key
    assert len(records) > 2000 and len(opened) == len(set(records)) < 20, (len(records), len(opened))
    assert not record_checks(checkpoint.files)._records  # nothing per record: all were read whole, a batch at a time

    checkpoint = formats.open_checkpoint(many_chunks)  # its records checked anew: what do the checks keep?
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in checkpoint.tensors:
            read_tensor(checkpoint, key)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    files = len({chunk.file for tensor in checkpoint.tensors.values() for chunk in tensor.chunks})
    assert kept < 1024 * (files + len(set(records))), kept  # per file (its descriptor) and layout, nothing per record


def _entry_at(record: bytes, suffix: str) -> int:
    """Where the bytes of the entry whose name ends with ``suffix`` start in a torch.save archive (python's zipfile)."""
    import io
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(io.BytesIO(record)).infolist() if i.filename.endswith(suffix))
    name_length, extra_length = struct.unpack_from("<HH", record, info.header_offset + 26)
    return info.header_offset + 30 + name_length + extra_length


@pytest.mark.parametrize("damage", ["storage", "serialization id", "central directory"])
def test_a_damaged_record_among_thousands_is_refused(many_chunks, tmp_path, damage):
    """A record checked in a batch of records of its layout: a flipped byte of its storage (its CRC-32), of its
    serialization id (written anew by every torch.save, checked against its own CRC-32) or of its zip structure
    (it no longer fits its layout: checked alone, which names what is wrong) is refused by name."""
    from test_records import refused

    key = "model.layers.1.mlp.up_proj.weight"
    info = [info for index, info in FileSystemReader(str(many_chunks)).read_metadata().storage_data.items()
            if index.fqn == key][7]  # a record of the middle of a batch, not its layout's template
    copy = tmp_path / "damaged"
    copy.mkdir()
    for path in many_chunks.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    data = bytearray((copy / info.relative_path).read_bytes())
    record = bytes(data[info.offset:info.offset + info.length])
    at = {"storage": _entry_at(record, "/data/0"), "serialization id": _entry_at(record, "/.data/serialization_id"),
          "central directory": record.rfind(b"PK\x01\x02")}[damage]
    data[info.offset + at] ^= 0x01
    (copy / info.relative_path).write_bytes(bytes(data))
    out = tmp_path / "out"
    line = refused(["export-hf", copy, out, "--no-fsync"], out, info.relative_path, key)
    assert ("CRC-32" in line) == (damage != "central directory"), line
    refused(["reshard", copy, out, "--dp", "4", "--no-fsync"], out, info.relative_path, key)
