"""Smoke tests for scripts/gloo_jobs.py: real gloo jobs, no mocks.

Each job is a torchrun launch on CPU (a few seconds each on 2 cores).
"""

from __future__ import annotations

import json

import pytest
import torch

from jobs import run_job


@pytest.fixture(scope="module")
def dcp_dp2(tmp_path_factory):
    """FSDP2 dp=2 checkpoint (torchtitan layout) and its reference folder."""
    out = tmp_path_factory.mktemp("dcp") / "dp2"
    run_job(2, "save-dcp", out, "--dp", "2")
    return out


@pytest.fixture(scope="module")
def dcp_dp2_tp2(tmp_path_factory):
    """FSDP2 dp=2 x TP tp=2 checkpoint (torchtitan layout)."""
    out = tmp_path_factory.mktemp("dcp") / "dp2tp2"
    proc = run_job(4, "save-dcp", out, "--dp", "2", "--tp", "2")
    assert "_StridedShard" in proc.stdout
    return out


@pytest.fixture(scope="module")
def moe_dp2_ep2(tmp_path_factory):
    """The tiny MoE on FSDP2 dp=2 with the experts split by ep=2 (torchtitan layout)."""
    out = tmp_path_factory.mktemp("dcp") / "moe_dp2ep2"
    proc = run_job(2, "save-dcp", out, "--model", "moe", "--dp", "2", "--ep", "2")
    # EP puts 2 experts on each rank; FSDP2 then shards dim 0 again over the
    # 1-rank efsdp mesh, which torch records as a _StridedShard.
    assert ("placements layers.1.moe.experts.w1: (_StridedShard(dim=0, sf=2), Shard(dim=0)) "
            "on mesh ('efsdp', 'ep') (1, 2)") in proc.stdout
    return out


def reference(out):
    return out.with_name(out.name + ".reference")


def chunk_layout(checkpoint):
    """{key: set of (offsets, sizes)} of every tensor in a DCP checkpoint's .metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: {(tuple(c.offsets), tuple(c.sizes)) for c in value.chunks}
            for key, value in metadata.items() if isinstance(value, TensorStorageMetadata)}


def test_save_dcp_writes_reference(dcp_dp2):
    ref = reference(dcp_dp2)
    assert (dcp_dp2 / ".metadata").is_file()
    assert {"config.json", "full.pt", "objects.pt", "reference.json"} <= {p.name for p in ref.iterdir()}
    info = json.loads((ref / "reference.json").read_text())
    assert (info["world_size"], info["dp"], info["tp"]) == (2, 2, 1)
    full = torch.load(ref / "full.pt", weights_only=True)
    assert full["model.embed_tokens.weight"].shape == (250, 64)
    assert "optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in full


def test_dcp_dp2_to_dp4(dcp_dp2):
    proc = run_job(4, "load-dcp", dcp_dp2, "--dp", "4",
                   "--expect", reference(dcp_dp2) / "full.pt")
    assert "OK:" in proc.stdout
    assert "train_state.step=7" in proc.stdout


def test_dcp_load_detects_mismatch(dcp_dp2, tmp_path):
    """The checker must fail on a one-element difference (not a no-op)."""
    full = torch.load(reference(dcp_dp2) / "full.pt", weights_only=True)
    full["model.layers.1.mlp.down_proj.weight"][-1, -1] += 1.0
    bad = tmp_path / "full.pt"
    torch.save(full, bad)
    proc = run_job(2, "load-dcp", dcp_dp2, "--dp", "2", "--expect", bad,
                   "--model-config", reference(dcp_dp2) / "config.json", check=False)
    assert proc.returncode != 0
    assert "MISMATCH" in proc.stdout and "model.layers.1.mlp.down_proj.weight" in proc.stdout


def test_dcp_dp2_tp2_same_mesh(dcp_dp2_tp2):
    run_job(4, "load-dcp", dcp_dp2_tp2, "--dp", "2", "--tp", "2",
            "--expect", reference(dcp_dp2_tp2) / "full.pt")


def test_dcp_dp2_tp2_to_dp4(dcp_dp2_tp2):
    run_job(4, "load-dcp", dcp_dp2_tp2, "--dp", "4",
            "--expect", reference(dcp_dp2_tp2) / "full.pt")


@pytest.mark.parametrize("values", ["sharded_tensor", "dtensor"])
def test_fsdp1_round_trip(tmp_path, values):
    out = tmp_path / f"fsdp1_{values}"
    proc = run_job(2, "save-fsdp1", out, "--world-size", "2", "--values", values)
    expected_type = "ShardedTensor" if values == "sharded_tensor" else "DTensor"
    assert expected_type in proc.stdout
    for r in range(2):
        for kind in ("model", "optim", "extra_state"):
            assert (out / f"{kind}_world_size_2_rank_{r}.pt").is_file()
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 2}
    assert (out / "huggingface" / "config.json").is_file()
    proc = run_job(2, "load-fsdp1", out, "--world-size", "2",
                   "--expect", reference(out) / "full.pt")
    assert f"values: {values}" in proc.stdout


def test_moe_save_dcp_reference(moe_dp2_ep2):
    ref = reference(moe_dp2_ep2)
    info = json.loads((ref / "reference.json").read_text())
    assert {k: info[k] for k in ("model", "dp_replicate", "dp", "tp", "ep", "etp", "world_size")} == {
        "model": "moe", "dp_replicate": 1, "dp": 2, "tp": 1, "ep": 2, "etp": 1, "world_size": 2}
    assert info["placements"]["layers.1.moe.expert_bias"] == "plain tensor"
    assert json.loads((ref / "config.json").read_text())["model"] == "moe"
    full = torch.load(ref / "full.pt", weights_only=True)
    assert full["layers.1.moe.experts.w2"].shape == (4, 64, 32)
    assert full["layers.1.moe.expert_bias"].dtype == torch.float32
    assert "optimizer.state.layers.1.moe.experts.w1.exp_avg" in full
    # The experts are split on dim 0 by ep: two experts per chunk.
    layout = chunk_layout(moe_dp2_ep2)
    assert layout["layers.1.moe.experts.w1"] == {((0, 0, 0), (2, 32, 64)), ((2, 0, 0), (2, 32, 64))}


def test_moe_ep2_to_tp2_ep2_etp2_with_own_layout(moe_dp2_ep2, tmp_path):
    """Load on (dp=2, tp=2, ep=2, etp=tp) and save that mesh's own layout first."""
    own = tmp_path / "own"
    proc = run_job(4, "load-dcp", moe_dp2_ep2, "--dp", "2", "--tp", "2", "--ep", "2",
                   "--expect", reference(moe_dp2_ep2) / "full.pt", "--save-layout", own)
    assert "OK: 101 tensors" in proc.stdout
    assert ("placements layers.1.moe.experts.w2: (_StridedShard(dim=0, sf=2), Shard(dim=0), "
            "Shard(dim=2)) on mesh ('efsdp', 'ep', 'etp') (1, 2, 2)") in proc.stdout
    assert ("placements layers.0.attention.wq.weight: (_StridedShard(dim=0, sf=2), Shard(dim=0)) "
            "on mesh ('dp_shard', 'tp') (2, 2)") in proc.stdout
    layout = chunk_layout(own)
    # ep splits the experts (dim 0), etp their hidden dim: dim 1 of w1/w3, dim 2 of w2.
    w1 = {((2 * e, 16 * t, 0), (2, 16, 64)) for e in range(2) for t in range(2)}
    w2 = {((2 * e, 0, 16 * t), (2, 64, 16)) for e in range(2) for t in range(2)}
    assert layout["layers.1.moe.experts.w1"] == layout["layers.1.moe.experts.w3"] == w1
    assert layout["layers.1.moe.experts.w2"] == w2
    assert layout["optimizer.state.layers.1.moe.experts.w2.exp_avg"] == w2
    assert layout["layers.1.moe.expert_bias"] == {((0,), (4,))}
    assert set(layout) == set(chunk_layout(moe_dp2_ep2))


def test_moe_load_detects_mismatch(moe_dp2_ep2, tmp_path):
    """A one-element change in an expert's optimizer state must fail the moe check too."""
    full = torch.load(reference(moe_dp2_ep2) / "full.pt", weights_only=True)
    key = "optimizer.state.layers.1.moe.experts.w2.exp_avg"
    full[key][-1, -1, -1] += 1.0
    bad = tmp_path / "full.pt"
    torch.save(full, bad)
    proc = run_job(2, "load-dcp", moe_dp2_ep2, "--model", "moe", "--dp", "2", "--expect", bad,
                   "--model-config", reference(moe_dp2_ep2) / "config.json", check=False)
    assert proc.returncode != 0
    assert "MISMATCH" in proc.stdout and key in proc.stdout


def test_dcp_dp2_to_hsdp(dcp_dp2, tmp_path):
    """HSDP (2 replicas x dp_shard 2) saves exactly the chunks of a dp=2 job."""
    own = tmp_path / "own"
    proc = run_job(4, "load-dcp", dcp_dp2, "--dp-replicate", "2", "--dp", "2",
                   "--expect", reference(dcp_dp2) / "full.pt", "--save-layout", own)
    assert "OK:" in proc.stdout
    assert ("placements model.embed_tokens.weight: (Replicate(), Shard(dim=0)) "
            "on mesh ('dp_replicate', 'dp_shard') (2, 2)") in proc.stdout
    assert chunk_layout(own) == chunk_layout(dcp_dp2)
