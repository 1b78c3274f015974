"""HF Trainer / accelerate FSDP checkpoint folders (``checkpoint-N/``), written by accelerate's own save functions.

harness.accelerate_jobs trains a tiny transformers Llama under FSDP1 in a real 2-rank gloo job
and saves it with accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` (SHARDED_STATE_DICT),
plus the scheduler, RNG and trainer-state files ``Trainer`` adds. The oracles are transformers
(``from_pretrained`` of the export gives the FSDP model's logits) and torch's own
``dcp_to_torch_save`` of accelerate's DCP parts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import dcptool, oracle
from jobs import ACCELERATE_JOBS, run_job

oracle("accelerate")


@pytest.fixture(scope="module")
def trainer_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("accelerate") / "checkpoint-2"
    run_job(2, "save", out, module=ACCELERATE_JOBS)
    return out


def full_of(folder: Path) -> dict:
    return torch.load(folder.parent / f"{folder.name}.full.pt", weights_only=True)


def torch_gathered(dcp_folder: Path, tmp_path: Path) -> dict:
    """A DCP folder gathered in full by torch itself."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = tmp_path / f"{dcp_folder.name}.gathered.pt"
    dcp_to_torch_save(dcp_folder, target)
    return torch.load(target, weights_only=False)  # the scheduler and RNG blobs are python objects


def test_inspect_lists_the_parts(trainer_folder):
    report = json.loads(dcptool("inspect", trainer_folder, "--json").stdout)
    assert report["format"] == "accelerate"
    parts = report["info"]["parts"]
    for part in ("model: pytorch_model_fsdp_0/ (DCP)", "optimizer: optimizer_0/ (DCP)", "scheduler: scheduler.pt",
                 "rng: 2 rng_state files", "trainer state: trainer_state.json"):
        assert part in parts
    assert "model.lm_head.weight" in report["tensors"]
    assert "optimizer.state.lm_head.weight.exp_avg" in report["tensors"]
    assert {"scheduler", "rng_state.rank_0", "rng_state.rank_1", "trainer_state"} <= set(report["objects"])
    # The model part alone is still a plain DCP checkpoint.
    alone = json.loads(dcptool("inspect", trainer_folder / "pytorch_model_fsdp_0", "--json").stdout)
    assert alone["format"] == "dcp" and set(alone["tensors"]) == {k for k in report["tensors"] if k.startswith("model.")}


def test_export_hf_loads_in_transformers_with_the_same_logits(trainer_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    dcptool("export-hf", trainer_folder, out)  # config.json found beside the weights
    model = AutoModelForCausalLM.from_pretrained(out)
    expected = full_of(trainer_folder)
    state = model.state_dict()
    assert sorted(state) == sorted(expected["model"])
    assert all(torch.equal(state[key], value) for key, value in expected["model"].items())
    with torch.no_grad():
        assert torch.equal(model(input_ids=expected["ids"]).logits, expected["logits"])


def test_reshard_carries_model_optimizer_and_state(trainer_folder, tmp_path):
    out = tmp_path / "dp4"
    result = dcptool("reshard", trainer_folder, out, "--dp", "4")
    assert "dropped 2 entries of single data-parallel ranks (rng_state.rank_0, rng_state.rank_1)" in result.stderr
    dropped = dcptool("verify", trainer_folder, out, check=False)
    # The RNG files are read as values (numpy's state too): each of their 5 leaves is missing per rank.
    assert dropped.returncode == 1 and "10 differences (10 missing)" in dropped.stdout, dropped.stdout
    assert "rng_state.rank_0.numpy: non-tensor entry only in A" in dropped.stdout
    kept = tmp_path / "dp4-kept"
    dcptool("reshard", trainer_folder, kept, "--dp", "4", "--keep-rank-state")
    assert "equal" in dcptool("verify", trainer_folder, kept).stdout
    # torch's own reading of the output holds exactly accelerate's model and optimizer parts.
    gathered = torch_gathered(kept, tmp_path)
    model = torch_gathered(trainer_folder / "pytorch_model_fsdp_0", tmp_path)["model"]
    optimizer = torch_gathered(trainer_folder / "optimizer_0", tmp_path)["optimizer"]
    assert sorted(gathered["model"]) == sorted(model)
    assert all(torch.equal(gathered["model"][k], v) for k, v in model.items())
    assert sorted(gathered["optimizer"]["state"]) == sorted(optimizer["state"])
    for name, moments in optimizer["state"].items():
        assert all(torch.equal(gathered["optimizer"]["state"][name][k], v) for k, v in moments.items())
    assert gathered["optimizer"]["param_groups"] == optimizer["param_groups"]
    assert gathered["scheduler"] == torch.load(trainer_folder / "scheduler.pt", weights_only=True)


def test_full_state_dict_folder_exports(trainer_folder, tmp_path):
    """FULL_STATE_DICT: ``torch.save(state_dict, "pytorch_model_fsdp.bin")`` (accelerate/utils/fsdp_utils.py,
    save_fsdp_model), with the model config in the Trainer's output folder, one level up."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    folder = run / "checkpoint-2"
    folder.mkdir(parents=True)
    expected = full_of(trainer_folder)
    torch.save(expected["model"], folder / "pytorch_model_fsdp.bin")
    shutil.copy(trainer_folder / "config.json", run / "config.json")
    report = json.loads(dcptool("inspect", folder, "--json").stdout)
    assert report["info"]["parts"] == "model: pytorch_model_fsdp.bin (full state dict)"
    dcptool("export-hf", folder, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.equal(model(input_ids=expected["ids"]).logits, expected["logits"])


def with_own_rng_state(trainer_folder: Path, tmp_path: Path) -> Path:
    """A copy of the folder in which rank 1's CPU RNG state is its own (the job's ranks share one seed),
    saved as ``Trainer._save_rng_state`` saves it, so that a test tells the ranks' states apart."""
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_folder, folder)
    state = torch.load(folder / "rng_state_1.pth", weights_only=False)
    state["cpu"] = torch.Generator().manual_seed(1).get_state()
    torch.save(state, folder / "rng_state_1.pth")
    return folder


def test_convert_to_torch_carries_rng_state(trainer_folder, tmp_path):
    """torch's RNG state is a tensor inside each rng_state file's dict: it becomes a storage of the output."""
    from transformers.trainer_pt_utils import safe_globals  # the numpy allowlist Trainer loads rng_state files with

    folder = with_own_rng_state(trainer_folder, tmp_path)
    result = dcptool("convert", folder, tmp_path / "full.pt", "--to", "torch")
    assert "left out" not in result.stdout, result.stdout
    with safe_globals():
        full = torch.load(tmp_path / "full.pt", weights_only=True)
        sources = [torch.load(folder / f"rng_state_{rank}.pth", weights_only=True) for rank in (0, 1)]
    model = torch_gathered(folder / "pytorch_model_fsdp_0", tmp_path)["model"]
    optimizer = torch_gathered(folder / "optimizer_0", tmp_path)["optimizer"]
    assert sorted(full["model"]) == sorted(model) and all(torch.equal(full["model"][k], v) for k, v in model.items())
    assert sorted(full["optimizer"]["state"]) == sorted(optimizer["state"])
    for name, moments in optimizer["state"].items():
        assert all(torch.equal(full["optimizer"]["state"][name][k], v) for k, v in moments.items())
    assert full["optimizer"]["param_groups"] == optimizer["param_groups"]
    assert not torch.equal(sources[0]["cpu"], sources[1]["cpu"])
    for rank, source in enumerate(sources):
        kept = full["rng_state"][f"rank_{rank}"]
        assert sorted(kept) == sorted(source) and isinstance(kept["cpu"], torch.Tensor)
        assert torch.equal(kept["cpu"], source["cpu"]) and kept["python"] == source["python"]
        name, keys, *rest = kept["numpy"]
        assert (name, *rest) == (source["numpy"][0], *source["numpy"][2:]) and np.array_equal(keys, source["numpy"][1])
    # verify sees the RNG tensors inside the source's objects as the tensors the output stores.
    compared = dcptool("verify", folder, tmp_path / "full.pt")
    assert "equal" in compared.stdout and "rng_state.rank_1.cpu" not in compared.stdout, compared.stdout
    # safetensors holds no objects: the summary names each RNG entry and why.
    result = dcptool("convert", folder, tmp_path / "hf", "--to", "hf")
    line, = (line for line in result.stdout.splitlines() if line.startswith("left out:"))
    assert "(hf cannot hold them)" in line and "rng_state.rank_0, rng_state.rank_1" in line, line


def test_bad_parts_name_their_file(trainer_folder, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_folder, folder)
    (folder / "trainer_state.json").write_text("{not json")
    result = dcptool("inspect", folder, check=False)
    line, = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "trainer_state.json" in line, line
    (folder / "trainer_state.json").write_text("{}")
    # A class read only as the restricted unpickler's stand-in cannot be pickled again: that rank's RNG
    # state is left out with a line naming it, the other rank's is written.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from transformers.trainer_pt_utils import safe_globals

    state = torch.load(folder / "rng_state_1.pth", weights_only=False)
    state["chunk"] = ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))
    torch.save(state, folder / "rng_state_1.pth")
    result = dcptool("convert", folder, tmp_path / "full.pt", "--to", "torch")
    assert "left out: 1 non-tensor entry (torch cannot hold them): rng_state.rank_1" in result.stdout, result.stdout
    with safe_globals():
        assert sorted(torch.load(tmp_path / "full.pt", weights_only=True)["rng_state"]) == ["rank_0"]
    # An RNG file that is no torch.save archive: refused, one line naming it, nothing written.
    (folder / "rng_state_1.pth").write_bytes(b"not a zip")
    result = dcptool("convert", folder, tmp_path / "refused.pt", "--to", "torch", check=False)
    line, = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "rng_state_1.pth" in line and not (tmp_path / "refused.pt").exists(), line
