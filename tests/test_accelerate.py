"""HF Trainer / accelerate FSDP checkpoint folders (``checkpoint-N/``), written by accelerate's own save functions.

scripts/accelerate_jobs.py trains a tiny transformers Llama under FSDP1 in a real 2-rank gloo job
and saves it with accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` (SHARDED_STATE_DICT),
plus the scheduler, RNG and trainer-state files ``Trainer`` adds. The oracles are transformers
(``from_pretrained`` of the export gives the FSDP model's logits) and torch's own
``dcp_to_torch_save`` of accelerate's DCP parts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import dcptool
from jobs import REPO, run_job

ACCELERATE_JOBS = REPO / "scripts" / "accelerate_jobs.py"
pytest.importorskip("accelerate")


@pytest.fixture(scope="module")
def trainer_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("accelerate") / "checkpoint-2"
    run_job(2, "save", out, script=ACCELERATE_JOBS)
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


def test_bad_parts_name_their_file(trainer_folder, tmp_path):
    folder = tmp_path / "checkpoint-2"
    shutil.copytree(trainer_folder, folder)
    (folder / "trainer_state.json").write_text("{not json")
    result = dcptool("inspect", folder, check=False)
    line, = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "trainer_state.json" in line, line
    # The RNG files' numpy arrays are read as data, but torch's CPU RNG state (a tensor inside the
    # object) cannot go into one torch.save file: refused (one line, nothing written), --exclude says how.
    (folder / "trainer_state.json").write_text("{}")
    result = dcptool("convert", folder, tmp_path / "full.pt", "--to", "torch", check=False)
    line, = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "--exclude" in line and not (tmp_path / "full.pt").exists(), line
    dcptool("convert", folder, tmp_path / "full.pt", "--to", "torch", "--exclude", "^rng_state")
