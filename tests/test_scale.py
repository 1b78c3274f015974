"""Checkpoints of many ranks: the synthetic generator against a real gloo save, and reading metadata
as columns (``converters.dcp.metadata`` rows, ``core.ChunkTable``) checked against torch's own readers."""

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
from dcptool.engine.core import ChunkTable
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
    from dcptool.engine.core import TensorInfo, check_cover
    from dcptool.errors import CheckpointError

    table = ChunkTable(np.array([[0, 0], [1, 0]]), np.array([[2, 4], [2, 4]]), ["f"], np.array([0, 0]),
                       np.array([0, 100]), np.array([100, 100]), "torch-archive", [0])
    with pytest.raises(CheckpointError, match="overlap"):
        check_cover(TensorInfo(("w",), "float32", (3, 4), table), "x")
