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


def reference(out):
    return out.with_name(out.name + ".reference")


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
