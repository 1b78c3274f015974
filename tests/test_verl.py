"""verl resume at another world size: model, optimizer and extra state, checked by real gloo jobs.

scripts/verl_jobs.py saves verl's per-rank files from a real FSDP1 job (and a real FSDP2 job) at
W=2 with verl's calls (the plain ``optimizer.state_dict()``: under FSDP1 with use_orig_params, 1-D
pieces of each flattened parameter); dcptool lays them out for W=4 and W=1; a real FSDP1 job at that size loads them as verl's
checkpoint manager does and takes one training step, whose losses (before and after the step, so
the optimizer moments and the resumed learning rate count) must equal a reference run in one
process that resumed from the same state gathered in full by torch.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import dcptool
from jobs import REPO, run_job

VERL_JOBS = REPO / "scripts" / "verl_jobs.py"
sys.path.insert(0, str(REPO / "scripts"))
import verl_jobs  # noqa: E402  (the reference run: plain torch in this process)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(kind)``: a W=2 verl folder saved by a real job (kind ``fsdp1`` or ``fsdp2``), made once."""
    root = tmp_path_factory.mktemp("verl")
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = root / kind / "actor"
            run_job(2, "save" if kind == "fsdp1" else "save-fsdp2", out, script=VERL_JOBS)
            made[kind] = out
        return made[kind]

    return get


def resumed_losses(folder: Path, world_size: int) -> dict:
    result = folder.parent / f"{folder.name}.result.json"
    run_job(world_size, "resume", folder, result, script=VERL_JOBS)
    return json.loads(result.read_text())


def assert_same_step(got: dict, expected: dict) -> None:
    """Equal up to the order of float32 sums across ranks (all-reduce of gradients and of the losses)."""
    for name, a, b in zip(("before", "after"), got["losses"], expected["losses"]):
        assert math.isclose(a, b, rel_tol=1e-6), f"loss {name} the step: {a} resumed, {b} reference"
    assert got["lr"] == pytest.approx(expected["lr"], rel=1e-12)


@pytest.mark.parametrize("world_size,command", [(4, "reshard"), (1, "convert")])
def test_fsdp1_resumes_at_another_world_size(saved, tmp_path, world_size, command):
    actor = saved("fsdp1")
    out = tmp_path / f"w{world_size}"
    size = ["--dp", str(world_size)] if command == "reshard" else ["--world-size", str(world_size)]
    result = dcptool(command, actor, out, "--to", "fsdp1", *size)
    assert "extra_state.rank_0.rng.cpu" in result.stdout and "--keep-rank-state keeps it" in result.stdout
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": world_size}
    assert (out / "huggingface" / "config.json").read_bytes() == (actor / "huggingface" / "config.json").read_bytes()
    for kind in ("model", "optim", "extra_state"):
        assert sorted(p.name for p in out.glob(f"{kind}_world_size_*")) == \
            sorted(f"{kind}_world_size_{world_size}_rank_{r}.pt" for r in range(world_size))
    # Read back, the output holds the source's model and optimizer bitwise; only the RNG state is gone.
    compared = dcptool("verify", actor, out, check=False)
    assert compared.returncode == 1 and "2 differences (2 missing)" in compared.stdout, compared.stdout
    assert "extra_state.rank_1.rng.cpu: tensor only in A" in compared.stdout
    got = resumed_losses(out, world_size)
    assert got["extra_keys"] == ["lr_scheduler"]  # the RNG state of the W=2 ranks was dropped
    assert_same_step(got, verl_jobs.reference(actor.parent / "actor.full.pt"))


def test_fsdp2_dtensor_folder_resumes_under_fsdp1(saved, tmp_path):
    """verl's FSDP2 files (DTensor values, optimizer keyed by parameter position), resumed on one rank."""
    actor = saved("fsdp2")
    info = json.loads(dcptool("inspect", actor, "--json").stdout)
    assert "DTensor" in info["info"]["values"] and "optimizer.state.head.weight.exp_avg" in info["tensors"]
    out = tmp_path / "w1"
    dcptool("convert", actor, out, "--to", "fsdp1", "--world-size", "1")
    assert_same_step(resumed_losses(out, 1), verl_jobs.reference(actor.parent / "actor.full.pt"))


def test_keep_rank_state_gives_each_rank_its_own(saved, tmp_path):
    actor = saved("fsdp1")
    out = tmp_path / "w1"
    result = dcptool("reshard", actor, out, "--to", "fsdp1", "--dp", "1", "--keep-rank-state")
    assert "extra_state.rank_1.rng.cpu" in result.stdout and "world size of 1 does not have" in result.stdout
    kept = torch.load(out / "extra_state_world_size_1_rank_0.pt", weights_only=True)
    saved_rank0 = torch.load(actor / "extra_state_world_size_2_rank_0.pt", weights_only=True)
    assert torch.equal(kept["rng"]["cpu"], saved_rank0["rng"]["cpu"])
    assert kept["lr_scheduler"] == saved_rank0["lr_scheduler"]


def test_flat_parameter_optimizer_files_are_left_out_with_a_line(saved, tmp_path):
    """FSDP1's plain optimizer.state_dict() (flat parameters by number) records no names: said, not guessed."""
    actor = saved("fsdp1")
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    for rank in range(2):
        flat = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(40)}},
                "param_groups": [{"lr": 0.1, "params": [0]}]}
        torch.save(flat, copy / f"optim_world_size_2_rank_{rank}.pt")
    info = json.loads(dcptool("inspect", copy, "--json").stdout)
    assert not any(key.startswith("optimizer.") for key in info["tensors"])
    line = info["info"]["not_read"][0]
    assert "optim_world_size_2_rank_0.pt" in line and "flat parameters" in line


class _RunsCode:
    """Pickles as a call of os.system: what a hostile checkpoint file holds."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_hostile_optimizer_file_is_refused_without_running_it(saved, tmp_path):
    actor = saved("fsdp1")
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    marker = tmp_path / "ran"
    torch.save({"state": {"w": {"exp_avg": _RunsCode(marker)}}, "param_groups": []},
               copy / "optim_world_size_2_rank_1.pt")
    result = dcptool("reshard", copy, tmp_path / "out", "--to", "fsdp1", "--dp", "4", check=False)
    assert result.returncode == 2 and not (tmp_path / "out").exists() and not marker.exists()
    line, = result.stderr.strip().splitlines()
    assert "optim_world_size_2_rank_1.pt" in line and "refuses to unpickle" in line, line


def test_numpy_rng_state_is_read_and_kept_as_data(saved, tmp_path):
    """verl's real extra state holds numpy's and Python's RNG state too: the scheduler is carried and,
    with --keep-rank-state, torch.load gives the numpy state back equal (dtype and values)."""
    import random

    import numpy as np

    actor = tmp_path / "actor"
    shutil.copytree(saved("fsdp1"), actor)
    for rank in range(2):
        path = actor / f"extra_state_world_size_2_rank_{rank}.pt"
        extra = torch.load(path, weights_only=True)
        np.random.seed(rank)
        extra["rng"].update(numpy=np.random.get_state(), random=random.getstate())  # as verl's get_rng_state
        torch.save(extra, path)
    out = tmp_path / "w1"
    result = dcptool("reshard", actor, out, "--to", "fsdp1", "--dp", "1", "--keep-rank-state")
    assert "extra state is not read" not in result.stdout + result.stderr
    kept = torch.load(out / "extra_state_world_size_1_rank_0.pt", weights_only=False)
    source = torch.load(actor / "extra_state_world_size_2_rank_0.pt", weights_only=False)
    assert kept["lr_scheduler"] == source["lr_scheduler"]
    name, keys, *rest = kept["rng"]["numpy"]
    assert name == "MT19937" and keys.dtype == np.uint32 and np.array_equal(keys, source["rng"]["numpy"][1])
    assert tuple(rest) == tuple(source["rng"]["numpy"][2:]) and kept["rng"]["random"] == source["rng"]["random"]
