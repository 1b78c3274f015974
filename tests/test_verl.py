"""verl resume at another world size: model, optimizer and extra state, checked by real gloo jobs.

harness.verl_jobs saves verl's per-rank files from real FSDP1 jobs (and a real FSDP2 job) at W=2
with verl's calls: the plain ``optimizer.state_dict()``, under FSDP1 of flat parameters
(use_orig_params=False, verl's default, with verl's device mesh: DTensor values) or of 1-D pieces
of each parameter (use_orig_params=True, ShardedTensor values). dcptool lays them out for W=4 and
W=1; a real FSDP1 job (FSDP2 for the FSDP2 folder) at that size loads them exactly as verl's
checkpoint manager does (``torch.load``, then ``model.load_state_dict`` and ``optimizer.load_state_dict``
of the files as they are) and takes one training step, whose losses (before and after the step, so the optimizer moments
and the resumed learning rate count) must equal a reference run in one process that resumed from the
same state gathered in full by torch.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import dcptool
from harness import verl_jobs  # the reference run: plain torch in this process
from jobs import VERL_JOBS, run_job, run_steps


@pytest.fixture(scope="module")
def saved(verl_saves):
    """``saved(kind)``: the session's W=2 verl folder of that kind (conftest.VERL_SAVES), saved by a real job."""
    return lambda kind: verl_saves / kind / "actor"


@dataclass
class Resumed:
    """A folder dcptool wrote for verl, and what a real job that resumed from it reported."""

    written: subprocess.CompletedProcess | None  # the dcptool command that wrote ``out``
    out: Path
    world_size: int
    flags: tuple[str, ...] | None  # how the job builds FSDP1 (None: as the folder's own forms say)
    resume: subprocess.CompletedProcess | None = None  # the job's step that resumed it; None when dcptool failed

    def result(self) -> Path:
        return self.out.parent / f"{self.out.name}.result.json"

    def losses(self) -> dict:
        """The losses (before and after) and the learning rate of the step the job took after resuming."""
        assert self.resume.returncode == 0, self.resume.stdout
        return json.loads(self.result().read_text())


def resume_job(case: Resumed) -> list[str]:
    """The command line that resumes ``case`` with verl's own calls (``resume-verl``), FSDP1 built as its flags
    say. Without flags, as the folder's own forms say (dcptool inspect): the ``named`` form through
    FSDP.optim_state_dict_to_load (``resume``), an FSDP2 folder under FSDP2 (``resume-fsdp2``)."""
    job, flags = "resume-verl", case.flags
    if flags is None:
        info = json.loads(dcptool("inspect", case.out, "--json").stdout)["info"]
        job = {"named": "resume", "fsdp2": "resume-fsdp2"}.get(info["optimizer_form"], job)
        flags = tuple(flag for flag, wanted in (("--dtensor", info["model_values"] == "dtensor"),
                                                ("--orig-params", info["optimizer_form"] == "orig")) if wanted)
    return [job, str(case.out), str(case.result()), *flags]


def resumed_losses(folder: Path, world_size: int, *flags: str) -> dict:
    """The losses of a step after resuming from ``folder`` in a job of its own, FSDP1 built as ``flags`` say (none:
    as resume_job finds from the folder's forms). Used by tests/test_pickles.py."""
    case = Resumed(None, folder, world_size, flags or None)
    run_job(world_size, *resume_job(case), module=VERL_JOBS)
    return json.loads(case.result().read_text())


# What a DCP source holds beside verl's state (test_dcp_source_written_for_stock_verl_resumes).
UNHELD = {"train_state": {"step": 7, "tokens_seen": torch.tensor(4096), "note": "hello"},
          "dataloader": {"dp_rank_0": b"position 100", "dp_rank_1": b"position 101"}}


def titan_like_dcp(actor: Path, work: Path) -> Path:
    """``actor``'s state with UNHELD beside it, saved by torch's own DCP writer."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    work.mkdir()
    dcptool("convert", actor, work / "full.pt", "--to", "torch")
    state = torch.load(work / "full.pt", weights_only=True)
    torch.save({**state, **UNHELD}, work / "titan-like.pt")
    torch_save_to_dcp(work / "titan-like.pt", work / "dcp")
    return work / "dcp"


RESUMED_AT = [(4, "reshard"), (1, "convert")]  # each source laid out for W=4 by reshard, for W=1 by convert


@pytest.fixture(scope="module")
def resumes(saved, tmp_path_factory) -> dict[str, Resumed]:
    """Every folder of this file that a job resumes, by case: written by dcptool, then resumed as the steps of
    one job per world size (harness.verl_jobs ``--then``), so that torch starts three times, not once per case."""
    root = tmp_path_factory.mktemp("resumes")
    cases: dict[str, Resumed] = {}

    def case(name: str, source: Path, world_size: int, command: str, *options: str, flags=None) -> None:
        size = ["--dp", str(world_size)] if command == "reshard" else ["--world-size", str(world_size)]
        written = dcptool(command, source, root / name, "--to", "fsdp1", *size, *options, check=False)
        cases[name] = Resumed(written, root / name, world_size, flags)

    for world_size, command in RESUMED_AT:
        case(f"verl-w{world_size}", saved("verl"), world_size, command, flags=("--dtensor",))
        case(f"fsdp1-w{world_size}", saved("fsdp1"), world_size, command, flags=("--orig-params",))
        case(f"fsdp2-w{world_size}", saved("fsdp2"), world_size, command)
    case("fsdp2-named-w1", saved("fsdp2"), 1, "convert", "--optim-form", "named")
    case("dcp-w2", titan_like_dcp(saved("fsdp1"), root / "dcp-source"), 2, "convert", "--optim-form", "flat",
         "--model-values", "dtensor:cpu", flags=("--dtensor",))

    ready = {name: c for name, c in cases.items() if c.written.returncode == 0}
    for world_size in sorted({c.world_size for c in ready.values()}):
        at = {name: resume_job(c) for name, c in ready.items() if c.world_size == world_size}
        for name, step in run_steps(world_size, at, module=VERL_JOBS).items():
            ready[name].resume = step
    return cases


def assert_same_step(got: dict, expected: dict) -> None:
    """Equal up to the order of float32 sums across ranks (all-reduce of gradients and of the losses)."""
    for name, a, b in zip(("before", "after"), got["losses"], expected["losses"]):
        assert math.isclose(a, b, rel_tol=1e-6), f"loss {name} the step: {a} resumed, {b} reference"
    assert got["lr"] == pytest.approx(expected["lr"], rel=1e-12)


def write_for(actor: Path, out: Path, world_size: int, command: str, *options: str, fsdp_version: int = 1):
    size = ["--dp", str(world_size)] if command == "reshard" else ["--world-size", str(world_size)]
    result = dcptool(command, actor, out, "--to", "fsdp1", *size, *options)
    assert_written(out, world_size, fsdp_version)
    return result


def assert_written(out: Path, world_size: int, fsdp_version: int = 1) -> None:
    """verl's files of every rank, and its fsdp_config.json."""
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": fsdp_version,
                                                                   "world_size": world_size}
    for kind in ("model", "optim", "extra_state"):
        assert sorted(p.name for p in out.glob(f"{kind}_world_size_*")) == \
            sorted(f"{kind}_world_size_{world_size}_rank_{r}.pt" for r in range(world_size))


def written(resumes: dict[str, Resumed], name: str, fsdp_version: int = 1) -> Resumed:
    """Case ``name`` of ``resumes``, once dcptool wrote it (write_for's checks)."""
    case = resumes[name]
    assert case.written.returncode == 0, case.written.stderr
    assert_written(case.out, case.world_size, fsdp_version)
    return case


def assert_only_rng_dropped(actor: Path, out: Path) -> None:
    """Read back, the output holds the source's model and optimizer bitwise; only the RNG state is gone."""
    compared = dcptool("verify", actor, out, check=False)
    assert compared.returncode == 1 and "2 differences (2 missing)" in compared.stdout, compared.stdout
    assert "extra_state.rank_1.rng.cpu: tensor only in A" in compared.stdout


@pytest.mark.parametrize("world_size,command", RESUMED_AT)
def test_stock_verl_folder_resumes_with_verls_own_calls(saved, resumes, world_size, command):
    """use_orig_params=False and a device mesh: the flat-parameter optimizer state and DTensor values, kept."""
    actor = saved("verl")
    info = json.loads(dcptool("inspect", actor, "--json").stdout)["info"]
    assert (info["optimizer_form"], info["model_values"]) == ("flat", "dtensor")
    assert info["mesh"] == {"device_type": "cpu", "dim_names": ["fsdp"]} and not info["not_read"]
    case = written(resumes, f"verl-w{world_size}")
    said = case.written.stdout + case.written.stderr
    assert "use_orig_params=False" in said and "DTensor on a 1-D cpu mesh" in said
    assert_only_rng_dropped(actor, case.out)
    got = case.losses()
    assert got["extra_keys"] == ["lr_scheduler"]
    assert_same_step(got, verl_jobs.reference(actor.parent / "actor.full.pt"))


def test_flat_state_read_equals_torchs_full_state(saved, tmp_path):
    """The flat shards, unflattened by dcptool, are each parameter's moments as FSDP1 gathers them in full."""
    actor = saved("verl")
    dcptool("convert", actor, tmp_path / "full.pt", "--to", "torch")
    ours = torch.load(tmp_path / "full.pt", weights_only=True)
    full = torch.load(actor.parent / "actor.full.pt", weights_only=True)
    assert sorted(ours["optimizer"]["state"]) == sorted(full["optimizer"]["state"])
    for name, state in full["optimizer"]["state"].items():
        assert state.keys() == ours["optimizer"]["state"][name].keys()
        for moment, value in state.items():
            assert torch.equal(ours["optimizer"]["state"][name][moment], value), f"{name}.{moment}"


def assert_same_dtensor(mine, theirs, what: str) -> None:
    """Equal local values, placements, global shape and mesh (its cached hash aside)."""
    assert type(mine) is type(theirs) and torch.equal(mine.to_local(), theirs.to_local()), what
    assert (mine.placements, mine._spec.tensor_meta, mine._spec.shard_order) == \
        (theirs.placements, theirs._spec.tensor_meta, theirs._spec.shard_order), what
    mesh, their_mesh = (vars(v.device_mesh) for v in (mine, theirs))
    assert mesh.keys() == their_mesh.keys() and torch.equal(mesh["_rank_map"], their_mesh["_rank_map"]), what
    assert {k: v for k, v in mesh.items() if k not in ("_rank_map", "_hash")} == \
        {k: v for k, v in their_mesh.items() if k not in ("_rank_map", "_hash")}, what


@pytest.mark.parametrize("kind,fsdp_version", [("verl", 1), ("fsdp2", 2)])
def test_written_verl_files_are_what_torch_saves(saved, tmp_path, kind, fsdp_version):
    """Written for the world size of the save, every rank's files hold what the job's own torch.save put
    there: DTensors on an equal mesh, and the flat-parameter state (its zero padding included) of FSDP1,
    or FSDP2's DTensor moments."""
    from torch.distributed.tensor import DTensor

    actor, out = saved(kind), tmp_path / "w2"
    write_for(actor, out, 2, "convert", fsdp_version=fsdp_version)
    for rank in range(2):
        theirs, ours = ({part: torch.load(folder / f"{part}_world_size_2_rank_{rank}.pt", weights_only=False)
                         for part in ("model", "optim")} for folder in (actor, out))
        assert list(ours["model"]) == list(theirs["model"])
        for key, value in theirs["model"].items():
            assert_same_dtensor(ours["model"][key], value, key)
        assert ours["optim"]["param_groups"] == theirs["optim"]["param_groups"]
        assert ours["optim"]["state"].keys() == theirs["optim"]["state"].keys()
        for position, state in theirs["optim"]["state"].items():
            assert state.keys() == ours["optim"]["state"][position].keys()
            for name, value in state.items():
                mine, what = ours["optim"]["state"][position][name], f"rank {rank}: {position}.{name}"
                if isinstance(value, DTensor):
                    assert_same_dtensor(mine, value, what)
                else:
                    assert type(mine) is type(value) and torch.equal(mine, value), what


@pytest.mark.parametrize("world_size,command", RESUMED_AT)
def test_orig_params_folder_resumes_at_another_world_size(saved, resumes, world_size, command):
    """use_orig_params=True without a device mesh: each rank's 1-D pieces of each parameter, ShardedTensor values."""
    actor = saved("fsdp1")
    case = written(resumes, f"fsdp1-w{world_size}")
    result, out = case.written, case.out
    assert "extra_state.rank_0.rng.cpu" in result.stdout and "--keep-rank-state keeps it" in result.stdout
    # The W=2 ranks' pieces fit only float32's 16-byte alignment (4 elements): the output keeps it.
    assert "aligned to 4 elements as in the source" in result.stderr, result.stderr
    assert (out / "huggingface" / "config.json").read_bytes() == (actor / "huggingface" / "config.json").read_bytes()
    assert_only_rng_dropped(actor, out)
    got = case.losses()
    assert got["extra_keys"] == ["lr_scheduler"]  # the RNG state of the W=2 ranks was dropped
    assert_same_step(got, verl_jobs.reference(actor.parent / "actor.full.pt"))


def test_dcp_source_written_for_stock_verl_resumes(saved, resumes, tmp_path):
    """A DCP checkpoint (named optimizer state, written by torch's own DCP writer: titan_like_dcp) written with
    --optim-form flat --model-values dtensor:cpu; its torchtitan-style train_state and per-rank dataloader state,
    which verl has no place for, ride in the extra-state files (dcptool_carried) without disturbing verl's
    resume, and come back."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    actor = saved("fsdp1")
    unheld = UNHELD
    case = written(resumes, "dcp-w2")
    out = case.out
    for rank, own in enumerate(({"train_state": unheld["train_state"], "dataloader": {"dp_rank_0": b"position 100"}},
                                {"dataloader": {"dp_rank_1": b"position 101"}})):
        carried = torch.load(out / f"extra_state_world_size_2_rank_{rank}.pt", weights_only=True)["dcptool_carried"]
        assert carried.keys() == own.keys() and carried["dataloader"] == own["dataloader"]
    got = case.losses()
    assert got["extra_keys"] == ["dcptool_carried", "lr_scheduler"]
    assert_same_step(got, verl_jobs.reference(actor.parent / "actor.full.pt"))
    dcptool("convert", out, tmp_path / "back", "--to", "dcp")
    dcp_to_torch_save(tmp_path / "back", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back["dataloader"] == unheld["dataloader"]
    assert back["train_state"].keys() == unheld["train_state"].keys() and back["train_state"]["note"] == "hello"
    assert back["train_state"]["step"] == 7 and torch.equal(back["train_state"]["tokens_seen"], torch.tensor(4096))


def test_fsdp2_dtensor_folder_resumes_under_fsdp1(saved, resumes):
    """verl's FSDP2 files (DTensor values, optimizer keyed by parameter position), resumed on one rank."""
    actor = saved("fsdp2")
    info = json.loads(dcptool("inspect", actor, "--json").stdout)
    assert "DTensor" in info["info"]["values"] and "optimizer.state.head.weight.exp_avg" in info["tensors"]
    case = resumes["fsdp2-named-w1"]  # convert --to fsdp1 --world-size 1 --optim-form named
    assert case.written.returncode == 0, case.written.stderr
    assert_same_step(case.losses(), verl_jobs.reference(actor.parent / "actor.full.pt"))


@pytest.mark.parametrize("world_size,command", RESUMED_AT)
def test_fsdp2_folder_resumes_under_fsdp2_at_another_world_size(saved, resumes, world_size, command):
    """An FSDP2 folder stays one by default: DTensor values and moments on verl's mesh (on one rank too),
    loaded by an FSDP2 job with verl's plain model.load_state_dict and optimizer.load_state_dict."""
    actor = saved("fsdp2")
    info = json.loads(dcptool("inspect", actor, "--json").stdout)["info"]
    assert (info["optimizer_form"], info["model_values"]) == ("fsdp2", "dtensor") and not info["not_read"]
    assert info["mesh"] == {"device_type": "cpu", "dim_names": ["fsdp"]}
    case = written(resumes, f"fsdp2-w{world_size}", fsdp_version=2)
    said = case.written.stdout + case.written.stderr
    assert "optimizer.state_dict() of FSDP2" in said and "DTensor on a 1-D cpu mesh" in said
    assert_only_rng_dropped(actor, case.out)
    got = case.losses()
    assert got["extra_keys"] == ["lr_scheduler"]
    assert_same_step(got, verl_jobs.reference(actor.parent / "actor.full.pt"))


@pytest.mark.parametrize("options,said", [
    (["--model-values", "dtensor:CUDA!"], "--model-values 'dtensor:CUDA!': choose sharded-tensor, dtensor"),
    (["--optim-form", "flat", "--to", "dcp"], "--optim-form flat goes with --to fsdp1"),
    (["--optim-form", "fsdp2", "--model-values", "sharded-tensor"], "FSDP2's model files hold DTensors"),
])
def test_bad_form_options_are_one_line(saved, tmp_path, options, said):
    to = [] if "--to" in options else ["--to", "fsdp1"]
    result = dcptool("convert", saved("fsdp1"), tmp_path / "out", *to, *options, check=False)
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    line, = result.stderr.strip().splitlines()
    assert said in line, line


def test_keep_rank_state_gives_each_rank_its_own(saved, tmp_path):
    actor = saved("fsdp1")
    out = tmp_path / "w1"
    result = dcptool("reshard", actor, out, "--to", "fsdp1", "--dp", "1", "--keep-rank-state")
    assert "extra_state.rank_1.rng.cpu" in result.stdout and "world size of 1 does not have" in result.stdout
    kept = torch.load(out / "extra_state_world_size_1_rank_0.pt", weights_only=True)
    saved_rank0 = torch.load(actor / "extra_state_world_size_2_rank_0.pt", weights_only=True)
    assert torch.equal(kept["rng"]["cpu"], saved_rank0["rng"]["cpu"])
    assert kept["lr_scheduler"] == saved_rank0["lr_scheduler"]


def test_flat_state_of_another_layout_is_left_out_with_a_line(saved, tmp_path):
    """Flat-parameter state whose shard sizes are not the layout dcptool computes: said, never mapped."""
    actor = saved("fsdp1")
    copy = tmp_path / "actor"
    shutil.copytree(actor, copy)
    for rank in range(2):
        flat = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.zeros(40)}},
                "param_groups": [{"lr": 0.1, "params": [0]}]}
        torch.save(flat, copy / f"optim_world_size_2_rank_{rank}.pt")
    info = json.loads(dcptool("inspect", copy, "--json").stdout)
    assert not any(key.startswith("optimizer.") for key in info["tensors"]) and info["info"]["optimizer_form"] is None
    line, = info["info"]["not_read"]
    # rank 0's shard of the first flat parameter, as verl's stock job (use_orig_params=False) saved its state
    flat_state = torch.load(saved("verl") / "optim_world_size_2_rank_0.pt", weights_only=True)["state"][0]
    assert "optim_world_size_2_rank_0.pt" in line and "float32[40]" in line, line
    assert f"holds {flat_state['exp_avg'].numel()} elements" in line, line


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


def test_tied_embeddings_refused_for_plain_optimizer_forms(tmp_path):
    """FSDP1 keeps a tied parameter once in its flat parameter: flat/orig layouts of a tied model would be
    wrong, so they are refused whether a config says so or the two embeddings hold the same values."""
    embedding = torch.randn(16, 4)
    state = {"model.embed_tokens.weight": embedding, "lm_head.weight": embedding.clone(),
             "model.norm.weight": torch.ones(4)}
    torch.save(state, tmp_path / "tied.pt")
    for form in ("flat", "orig"):
        result = dcptool("convert", tmp_path / "tied.pt", tmp_path / form, "--to", "fsdp1", "--world-size", "2",
                         "--optim-form", form, check=False)
        line, = result.stderr.strip().splitlines()
        assert result.returncode == 2 and "lm_head.weight" in line and "tied" in line, line
        assert not (tmp_path / form).exists()
    state["lm_head.weight"] = torch.randn(16, 4)  # untied: written
    torch.save(state, tmp_path / "untied.pt")
    dcptool("convert", tmp_path / "untied.pt", tmp_path / "untied", "--to", "fsdp1", "--world-size", "2",
            "--optim-form", "flat")
    assert (tmp_path / "untied" / "model_world_size_2_rank_1.pt").is_file()
