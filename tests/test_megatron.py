"""Megatron-Core checkpoints: saved by megatron-core 0.19.2 itself on CPU (tests/harness/megatron.py), read by
dcptool's ``megatron`` format, written back with ``--to megatron`` and loaded by Megatron's own
``dist_checkpointing.load`` at another layout."""

from pathlib import Path

import pytest
import torch
from conftest import megatron_load
from harness.runtime import reference_dir


def torch_dcp_load(folder: Path, like: dict) -> dict:
    """Every tensor of ``like``'s keys as torch itself reads the DCP folder (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    state = {key: torch.empty_like(value) for key, value in like.items()}
    load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


@pytest.mark.parametrize("name", ["tp2", "pp2", "moe_ep2"])
def test_harness_saves_what_torch_and_megatron_load(megatron_runs, name, tmp_path):
    run = megatron_runs(name)
    full = torch.load(reference_dir(run) / "full.pt", weights_only=True)
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "100"
    for key, value in torch_dcp_load(run / "iter_0000100", full).items():
        assert torch.equal(value, full[key]), key
    loaded = megatron_load(run / "iter_0000100", run / "model.json", tmp_path / "loaded.pt", "--tp", 1)
    assert loaded.keys() == full.keys()
    for key, value in loaded.items():
        assert torch.equal(value, full[key]), key
