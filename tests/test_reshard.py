"""reshard against real jobs: every target is loaded by a real gloo job built with that mesh (FSDP2 + TP + EP),
which checks each rank's local shard bitwise and saves its own state with dcp.save, whose chunk layout
must equal the one dcptool wrote."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conftest import dcptool, load_reference, read_tensor
from dcptool import formats
from jobs import run_steps

MOE_SOURCE = {"dp": 4, "ep": 2}  # the mesh of the session's moe_dp4_ep2 (conftest); differs from every target below

MOE_TARGETS = {
    "dp4": {"dp": 4},
    "dp2_tp2": {"dp": 2, "tp": 2},
    "dp1_tp4": {"dp": 1, "tp": 4},
    "dp2_ep2": {"dp": 2, "ep": 2},
    "dp2_tp2_ep2_etp2": {"dp": 2, "tp": 2, "ep": 2, "etp": 2},
    "dp2_tp2_ep2": {"dp": 2, "tp": 2, "ep": 2, "etp": 1},  # ep borrows tp's ranks: experts whole on tp
}


def flags(mesh: dict) -> list[str]:
    return [item for name, size in mesh.items() for item in (f"--{name.replace('_', '-')}", str(size))]


def world(mesh: dict) -> int:
    return mesh.get("dp", 1) * mesh.get("cp", 1) * mesh.get("tp", 1) * mesh.get("dp_replicate", 1)


def chunk_layout(path) -> dict:
    """Per tensor key, the chunks (offsets, sizes) in .metadata, read by torch's own reader."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {key: sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}


def data_files(path) -> list[str]:
    return sorted(p.name for p in path.glob("*.distcp"))


@pytest.fixture(scope="module")
def moe_source(checkpoints):
    """A small MoE model (torchtitan names) saved by a real FSDP2 + EP job (dp=4, ep=2) with its AdamW state."""
    return checkpoints("moe_dp4_ep2")


@dataclass
class Loaded:
    """A dcptool output and the job step that loaded it."""

    made: subprocess.CompletedProcess  # the dcptool command that wrote ``out`` (the first one that failed)
    out: Path
    job_layout: Path  # where the job saved its own state first (load-dcp --save-layout)
    load: subprocess.CompletedProcess | None = None  # None when dcptool failed

    def checked(self) -> Loaded:
        """Itself, once dcptool and the job both succeeded."""
        assert self.made.returncode == 0, self.made.stderr
        assert self.load.returncode == 0 and "OK:" in self.load.stdout, self.load.stdout
        return self


@pytest.fixture(scope="module")
def loads(moe_source, checkpoints, tmp_path_factory) -> dict[str, Loaded]:
    """Every output of this file that a job loads, by case: written by dcptool, then loaded as the steps of one
    4-rank and one 2-rank torchrun launch (tests/jobs.py run_steps), so that torch starts twice, not per case."""
    root = tmp_path_factory.mktemp("loads")
    moe, moe_reference = moe_source
    dense_tp, dense_tp_reference = checkpoints("fsdp2_dp2_tp2")
    dense, dense_reference = checkpoints("fsdp2_dp2")
    wide, wide_reference = checkpoints("wide_dp2_tp2")
    cases, jobs = {}, {}  # name -> Loaded; name -> (ranks, load arguments)

    def paths(name: str) -> tuple[Path, Path]:
        """Where case ``name``'s output goes, and the job's own save of the same state."""
        (root / name).mkdir(exist_ok=True)
        return root / name / "out", root / name / "job-layout"

    def case(name: str, commands: list[list], ranks: int, load: list) -> None:
        """Run the dcptool ``commands`` that make case ``name``'s output; if they succeed, ``load`` it on ``ranks``."""
        for command in commands:
            made = dcptool(*command, check=False)
            if made.returncode != 0:
                break
        cases[name] = Loaded(made, *paths(name))
        if made.returncode == 0:
            jobs[name] = ranks, load

    for target, mesh in MOE_TARGETS.items():
        out, job_layout = paths(target)
        case(target, [["reshard", moe, out, *flags(mesh), "--etp", str(mesh.get("etp", 1)), "--config-dir", moe_reference]],
             world(mesh),
             ["load-dcp", out, "--model", "moe", "--layout", "torchtitan", *flags(mesh),
              "--expect", moe_reference / "full.pt", "--save-layout", job_layout])
    out, job_layout = paths("dense-dp4")
    case("dense-dp4", [["reshard", dense_tp, out, "--tp", "1"]], 4,  # dp derived: the source was saved by 4 ranks
         ["load-dcp", out, "--dp", "4", "--layout", "areal", "--expect", dense_tp_reference / "full.pt",
          "--save-layout", job_layout])
    out, job_layout = paths("dense-hsdp")
    case("dense-hsdp", [["reshard", dense, out, "--dp-replicate", "2", "--dp", "2"]], 4,
         ["load-dcp", out, "--dp-replicate", "2", "--dp", "2", "--layout", "torchtitan",
          "--expect", dense_reference / "full.pt", "--save-layout", job_layout])
    out, job_layout = paths("dense-cp")
    case("dense-cp", [["reshard", dense, out, "--dp", "1", "--cp", "2", "--tp", "2", "--config-dir", dense_reference]], 4,
         ["load-dcp", out, "--dp", "1", "--cp", "2", "--tp", "2", "--layout", "torchtitan",
          "--expect", dense_reference / "full.pt", "--save-layout", job_layout])
    out, job_layout = paths("import-hf")
    hf = root / "import-hf" / "hf"
    case("import-hf", [["export-hf", dense, hf, "--config-dir", dense_reference],
                       ["import-hf", hf, out, "--dp", "2", "--tp", "2"]], 4,
         ["load-dcp", out, "--dp", "2", "--tp", "2", "--layout", "torchtitan", "--model-only",
          "--expect", dense_reference / "full.pt", "--save-layout", job_layout])
    # The config travels: tp 2 given --config-dir, then tp 4 of that output without it (4 key/value heads)
    out, job_layout = paths("config-travels")
    tp2 = root / "config-travels" / "tp2"
    case("config-travels", [["reshard", wide, tp2, "--dp", "1", "--tp", "2", "--config-dir", wide_reference],
                            ["reshard", tp2, out, "--dp", "1", "--tp", "4"]], 4,
         ["load-dcp", out, "--dp", "1", "--tp", "4", "--layout", "torchtitan", "--expect", wide_reference / "full.pt",
          "--save-layout", job_layout])
    # AReaL's (dp=2, tp=2) DCP to verl-style FSDP1 files: the model part, unwrapped, against the reference's.
    out, _ = paths("fsdp1")
    expect = root / "fsdp1" / "expect"
    expect.mkdir()
    full = load_reference(dense_tp_reference)
    torch.save({k[len("dcp.model."):]: v for k, v in full.items() if k.startswith("dcp.model.")}, expect / "full.pt")
    shutil.copy(dense_tp_reference / "config.json", expect / "config.json")
    case("fsdp1", [["reshard", dense_tp, out, "--to", "fsdp1", "--world-size", "2"]], 2,
         ["load-fsdp1", out, "--world-size", "2", "--expect", expect / "full.pt"])

    for ranks in sorted({ranks for ranks, _ in jobs.values()}, reverse=True):
        steps = run_steps(ranks, {name: load for name, (at, load) in jobs.items() if at == ranks})
        for name, step in steps.items():
            cases[name].load = step
    return cases


@pytest.mark.parametrize("target", MOE_TARGETS, ids=list(MOE_TARGETS))
def test_moe_reshard_loads_on_target_mesh_with_the_jobs_own_layout(loads, target):
    loaded = loads[target].checked()
    assert chunk_layout(loaded.out) == chunk_layout(loaded.job_layout)
    assert data_files(loaded.out) == [f"__{rank}_0.distcp" for rank in range(world(MOE_TARGETS[target]))]


def test_moe_inspect_reports_the_saving_mesh(moe_source):
    source, _ = moe_source
    report = json.loads(dcptool("inspect", source, "--json").stdout)
    # EP=2 over FSDP puts expert 2e+f on rank (f, e): told apart from dp=4 by which rank's file holds each expert
    assert report["mesh"] == {"dp_replicate": 1, "dp": 4, "cp": 1, "tp": 1, "ep": 2, "etp": 1, "plan": "torchtitan"}
    assert "saved on mesh 4 ranks: dp=4; experts ep=2 (plan torchtitan)" in dcptool("inspect", source).stdout


def test_reshard_there_and_back_returns_the_same_bytes(moe_source, tmp_path):
    source, reference = moe_source
    there, back = tmp_path / "there", tmp_path / "back"
    dcptool("reshard", source, there, "--dp", "2", "--tp", "2", "--ep", "2", "--etp", "tp", "--keep-rank-state",
            "--config-dir", reference)
    dcptool("reshard", there, back, *flags(MOE_SOURCE), "--keep-rank-state")
    original, returned = formats.open_checkpoint(source), formats.open_checkpoint(back)
    assert chunk_layout(back) == chunk_layout(source)
    assert set(returned.tensors) == set(original.tensors)
    for key in original.tensors:
        as_bytes = [read_tensor(c, key).reshape(-1).view(torch.uint8) for c in (returned, original)]
        assert torch.equal(*as_bytes), key
    assert {k: returned.object_blob(o) for k, o in returned.objects.items()} == \
        {k: original.object_blob(o) for k, o in original.objects.items()}


def test_dense_uneven_dp4_from_fsdp_tp(loads):
    """A vocabulary that 4 does not divide over dp=4: shards of rows as torch.chunk makes them (AReaL layout, HF
    names)."""
    loaded = loads["dense-dp4"].checked()
    assert "4 ranks: dp=4" in loaded.made.stderr
    layout = chunk_layout(loaded.out)
    assert layout == chunk_layout(loaded.job_layout)
    key = "dcp.model.model.embed_tokens.weight"
    vocab = FileSystemReader(str(loaded.out)).read_metadata().state_dict_metadata[key].size[0]
    assert vocab % 4 and [s[0] for _, s in layout[key]] == [len(rows) for rows in torch.arange(vocab).chunk(4)]


def test_dense_hsdp(loads):
    loaded = loads["dense-hsdp"].checked()
    assert chunk_layout(loaded.out) == chunk_layout(loaded.job_layout)
    # replicas are saved once: the 4 ranks hold 2 distinct shards of each sharded weight
    assert len(chunk_layout(loaded.out)["model.layers.0.mlp.up_proj.weight"]) == 2


def test_dense_cp_shards_over_dp_and_cp(loads):
    """--cp 2 with --dp 1 --tp 2: FSDP shards over dp*cp as torchtitan's dp_shard_cp does; the job on that mesh
    loads it and saves the same chunks."""
    loaded = loads["dense-cp"].checked()
    assert "4 ranks: cp=2 x tp=2" in loaded.made.stderr
    assert chunk_layout(loaded.out) == chunk_layout(loaded.job_layout)
    assert data_files(loaded.out) == [f"__{rank}_0.distcp" for rank in range(4)]


def test_reshard_to_fsdp1_loads_in_fsdp1_job(loads):
    """AReaL's (dp=2, tp=2) DCP to verl-style FSDP1 files for 2 ranks: the model part, unwrapped."""
    loaded = loads["fsdp1"].checked()
    assert sorted(p.name for p in loaded.out.glob("model_world_size_*.pt")) == [
        "model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"]


def test_import_hf_lays_weights_out_for_a_mesh(loads, tmp_path):
    """import-hf for dp 2 x tp 2, loaded by the job on that mesh (a folder holding the HF folder's config.json, which
    a reshard of it then uses without --config-dir: its 2 key/value heads refuse tp 4)."""
    loaded = loads["import-hf"].checked()
    model_layout = {k: v for k, v in chunk_layout(loaded.job_layout).items() if not k.startswith("optimizer.")}
    assert chunk_layout(loaded.out) == model_layout
    hf = loaded.out.parent / "hf"
    assert (loaded.out / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    dcptool("reshard", loaded.out, tmp_path / "tp2", "--dp", "1", "--tp", "2")
    assert (tmp_path / "tp2" / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    _refused(loaded.out, "--dp", "1", "--tp", "4", dst=tmp_path / "tp4",
             expect=f"does not divide the 2 key/value heads (num_key_value_heads in {loaded.out / 'config.json'})")


def test_the_config_travels_with_the_output(loads, checkpoints, tmp_path):
    """reshard given --config-dir keeps the model's config.json in its output, and a reshard of that output finds
    it there: its 4 key/value heads let tp 4 split what a tp 2 save alone does not vouch for, and the job on that
    mesh loads the result (its dcp.load reads a folder holding config.json); tp 8 is refused by those counts,
    named in the kept file; without the file, tp 4 is refused. convert keeps it too, where each format keeps it,
    and no format's detection is misled by it."""
    import torch.distributed.checkpoint as dcp

    loaded = loads["config-travels"].checked()
    _, reference = checkpoints("wide_dp2_tp2")
    tp2 = loaded.out.parent / "tp2"
    assert chunk_layout(loaded.out) == chunk_layout(loaded.job_layout)
    for out in (tp2, loaded.out):
        assert (out / "config.json").read_bytes() == (reference / "config.json").read_bytes()
        assert formats.detect(out) == "dcp"
    assert f"kept the model's config in the output for later commands: config.json ({tp2 / 'config.json'})" in \
        loaded.made.stderr
    listed = dcptool("reshard", tp2, tmp_path / "tp8", "--tp", "8", "--dp", "1", "--dry-run", "--json", check=False)
    assert f"does not divide the 4 key/value heads (num_key_value_heads in {tp2 / 'config.json'})" in listed.stdout
    bare = tmp_path / "bare"
    shutil.copytree(tp2, bare)
    (bare / "config.json").unlink()
    _refused(bare, "--tp", "4", "--dp", "1", expect="neither a config.json nor the tensors give their number",
             dst=tmp_path / "tp4")

    for to, out, kept in (("fsdp1", "verl", "huggingface/config.json"), ("hf-dcp", "hf-dcp", "config.json"),
                          ("torch", "state.pt", None)):
        result = dcptool("convert", tp2, tmp_path / out, "--to", to, *(["--world-size", "2"] if to == "fsdp1" else []))
        assert formats.detect(tmp_path / out) == to
        if kept:
            assert (tmp_path / out / kept).read_bytes() == (reference / "config.json").read_bytes()
        else:  # one file: nothing beside it, and a line saying so
            assert sorted(p.name for p in tmp_path.glob("state*")) == ["state.pt"]
            assert "a torch output is one file; give it to later commands with --config-dir" in result.stderr
    full = load_reference(reference)  # torch's HF-storage reader loads a folder holding the config
    model = {key: torch.empty_like(value) for key, value in full.items() if key.startswith("model.")}
    dcp.load(model, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "hf-dcp")), no_dist=True)
    assert all(torch.equal(model[key], full[key]) for key in model)


def test_dry_run_prints_the_plan_and_writes_nothing(checkpoints, tmp_path):
    source, reference = checkpoints("fsdp2_dp2")
    out = tmp_path / "out"
    result = dcptool("reshard", source, out, "--tp", "2", "--dry-run", "--json", "--config-dir", reference)
    plan = json.loads(result.stdout)
    assert plan["mesh"]["dp"] == 1 and plan["mesh"]["tp"] == 2 and plan["plan"] == "hf"
    q = plan["tensors"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["placement"] == "tp=2:Shard(0)" and q["source_chunks"] == 2 and len(q["chunks"]) == 2
    moment = plan["tensors"]["optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg"]
    assert moment["follows"] == "model.layers.0.self_attn.q_proj.weight" and moment["chunks"] == q["chunks"]
    # and the model's config the output keeps, as it is
    assert plan["files"]["config.json"] == (reference / "config.json").stat().st_size
    assert sorted(plan["files"]) == ["__0_0.distcp", "__1_0.distcp", "config.json"]
    assert not out.exists()


def _refused(*args, expect: str, dst):
    result = dcptool("reshard", *args, dst, check=False)
    assert result.returncode == 2, result.stderr
    assert expect in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr
    assert not dst.exists()


def test_moe_refuses_ep_not_dividing_the_experts(moe_source, tmp_path):
    _refused(moe_source[0], "--dp", "8", "--ep", "8", expect="experts of size 4 cannot be split by ep=8",
             dst=tmp_path / "never")


def test_refusals_name_the_tensor_or_setting(checkpoints, tmp_path):
    dense, reference = checkpoints("fsdp2_dp2")
    dst = tmp_path / "never"
    _refused(dense, "--tp", "4", "--world-size", "4", "--dp", "1",
             expect="q_proj.weight (and 3 more weights like it): --tp 4 splits its attention heads", dst=dst)
    unsplittable = dcptool("reshard", dense, dst, "--tp", "4", "--dp", "1", "--dry-run", "--json", check=False)
    assert "model.embed_tokens.weight: dim 0 of size 250 cannot be split by tp=4" in \
        json.loads(unsplittable.stdout)["problems"]
    _refused(dense, "--tp", "4", "--dp", "1", "--config-dir", reference, expect="(and 2 more problems", dst=dst)
    listed = dcptool("reshard", dense, dst, "--tp", "4", "--dp", "1", "--config-dir", reference, "--dry-run", "--json",
                     check=False)
    assert any("--tp 4 does not divide the 2 key/value heads" in line for line in json.loads(listed.stdout)["problems"])
    _refused(dense, "--world-size", "8", "--dp", "2", "--tp", "2", expect="--world-size 8 != dp_replicate*dp*cp*tp = 4",
             dst=dst)
    _refused(dense, "--tp", "3", expect="does not divide the source's world size (2 ranks)", dst=dst)
    _refused(dense, "--ep", "2", expect="finds no grouped expert tensors", dst=dst)
    plan = tmp_path / "plan.yaml"
    plan.write_text("rules:\n  - {match: 'no_such_weight$', tp: colwise}\n")
    _refused(dense, "--plan", plan, expect="names no tensor of the checkpoint", dst=dst)
    plan.write_text("rules:\n  - {match: 'q_proj', tp: sideways}\n")
    _refused(dense, "--plan", plan, expect="tp 'sideways' is not one of colwise, rowwise, replicate", dst=dst)


def test_plan_file_places_tensors_as_written(checkpoints, tmp_path):
    """A plan file's rules, planned (--dry-run) and written: torch's metadata holds the chunks the rules say (rowwise:
    halves of dim 1, as torch.chunk splits it; no rule: replicated, one chunk), and dcp.load reads the job's state."""
    import torch.distributed.checkpoint as dcp

    source, reference = checkpoints("fsdp2_dp2")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"name": "rows-only", "rules": [{"match": r"proj\.weight$", "tp": "rowwise"}]}))
    options = ["--tp", "2", "--plan", plan, "--config-dir", reference]
    result = json.loads(dcptool("reshard", source, tmp_path / "x", *options, "--dry-run", "--json").stdout)
    assert result["plan"] == "rows-only"
    assert result["tensors"]["model.layers.0.self_attn.q_proj.weight"]["placement"] == "tp=2:Shard(1)"
    assert result["tensors"]["model.embed_tokens.weight"]["placement"] == "replicated"

    out = tmp_path / "rows-only"
    dcptool("reshard", source, out, *options)
    full = load_reference(reference)
    layout = chunk_layout(out)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        rows, columns = full[key].shape
        halves = torch.arange(columns).chunk(2)
        assert layout[key] == [((0, int(half[0])), (rows, len(half))) for half in halves], key
    assert layout["model.embed_tokens.weight"] == [((0, 0), tuple(full["model.embed_tokens.weight"].shape))]
    loaded = {key: torch.empty_like(value) for key, value in full.items()}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)
    for key, value in full.items():
        assert torch.equal(loaded[key], value), key


def test_entries_of_single_dp_ranks_are_dropped_with_a_warning_or_kept(checkpoints, tmp_path):
    """torchtitan saves dataloader.dp_rank_{i} per data-parallel rank: meaningless on another mesh."""
    source, _ = checkpoints("fsdp2_dp2")
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(formats.open_checkpoint(source).objects)
    dropped = dcptool("reshard", source, tmp_path / "dropped", "--dp", "4")
    assert "dropped 2 entries of single data-parallel ranks (dataloader.dp_rank_0, dataloader.dp_rank_1)" in \
        dropped.stderr
    kept = dcptool("reshard", source, tmp_path / "kept", "--dp", "4", "--keep-rank-state")
    assert "kept 2 entries" in kept.stderr
    objects = {p: set(formats.open_checkpoint(tmp_path / p).objects) for p in ("dropped", "kept")}
    assert not any("dp_rank" in k for k in objects["dropped"])
    assert objects["kept"] - objects["dropped"] == {"dataloader.dp_rank_0", "dataloader.dp_rank_1"}
    assert "train_state.step" in objects["dropped"]
