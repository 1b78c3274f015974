"""Megatron-Core checkpoints: saved by megatron-core 0.19.2 itself on CPU (tests/harness/megatron.py), read by
dcptool's ``megatron`` format against torch's own ``dcp.load`` and Megatron's gathered weights, written back with
``--to megatron`` and loaded by Megatron's own ``dist_checkpointing.load`` at another layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dcptool, megatron_load, read_tensor
from harness.family_models import load_hf_state, read_config
from harness.megatron_weights import checkpoint_keys, megatron_weights
from harness.runtime import reference_dir

from dcptool import formats


def whole_weights(run: Path) -> dict:
    """Every weight of the run's model, whole, gathered from Megatron's own sharded state dict in the saving job."""
    return torch.load(reference_dir(run) / "full.pt", weights_only=True)


def torch_dcp_load(folder: Path, like: dict) -> dict:
    """Every tensor of ``like``'s keys as torch itself reads the DCP folder (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader, load

    state = {key: torch.empty_like(value) for key, value in like.items()}
    load(state, storage_reader=FileSystemReader(str(folder)), no_dist=True)
    return state


def read_all(path: Path) -> dict:
    checkpoint = formats.open_checkpoint(path)
    assert checkpoint.format == "megatron"
    return {key: read_tensor(checkpoint, key) for key in checkpoint.tensors}


@pytest.mark.parametrize("name", ["tp2", "legacy_tp2_pp2_dist", "legacy_moe_tp2_ep2_dist"])  # TP; TP and PP; TP x EP
def test_torch_dist_read_as_torch_and_megatron_read_it(megatron_runs, name):
    run = megatron_runs(name)
    full = whole_weights(run)
    read = read_all(run / "iter_0000100")
    model = {key: value for key, value in read.items() if not key.startswith("optimizer.")}
    assert model.keys() == full.keys()
    by_torch = torch_dcp_load(run / "iter_0000100", read)  # the optimizer too
    for key, value in read.items():
        assert torch.equal(value, by_torch[key]), key
        if key in full:
            assert torch.equal(value, full[key]), key
    if name == "tp2":  # the fully_reshardable optimizer follows the weights' names and shapes
        assert {k.split(".", 3)[3] for k in read if k.startswith("optimizer.state.exp_avg.")} == full.keys()


def test_inspect_shows_the_run(megatron_runs):
    run = megatron_runs("legacy_moe_tp2_ep2_dist")
    text = dcptool("inspect", run / "iter_0000100").stdout
    assert "(megatron)" in text.splitlines()[0]
    for line in ("iteration: 100", "tensor_parallel: 2", "pipeline_parallel: 1", "expert_parallel: 2", "layers: 2",
                 "sharded_backend: torch_dist"):
        assert line in text.splitlines(), line
    assert "4 experts" in text and "q/k layernorm" in text and "rng_state/shard_0.0_1.*" in text
    report = json.loads(dcptool("inspect", run / "iter_0000100", "--json").stdout)
    args = report["info"]["args"]
    assert args["num_experts"] == 4 and args["expert_model_parallel_size"] == 2 and args["params_dtype"] == "float32"
    assert args["model_type"] == "ModelType(1)"  # Megatron's enum, read as data
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    extra = {key for key in report["objects"] if "._extra_state/" in key}
    saved = FileSystemReader(str(run / "iter_0000100")).read_metadata().state_dict_metadata  # torch's own reading
    assert extra == {key for key, entry in saved.items() if isinstance(entry, BytesStorageMetadata)
                     and "._extra_state/" in key}
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4" in extra
    assert "common_state/shard_0_1" in report["objects"]


def test_run_folder_lists_its_iterations_newest_first(megatron_runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(megatron_runs("tp2"), run)
    shutil.copytree(run / "iter_0000100", run / "iter_0000200")
    (run / "latest_checkpointed_iteration.txt").write_text("200")
    result = dcptool("inspect", run, check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "a folder holding 2 checkpoints" in result.stderr
    assert "(newest first): iter_0000200, iter_0000100" in result.stderr


@pytest.mark.parametrize("legacy", ["legacy_tp2_pp2", "legacy_moe_tp2_ep2", "legacy_pp2_vpp2"])
def test_legacy_files_read_as_torch_dist_of_the_same_model(megatron_runs, legacy):
    """The per-rank files join into the tensors a torch_dist save of the same model (same seed, same layout) holds:
    TP pieces by each parameter's parallel dim (SwiGLU halves included, the experts' too), stages by their layer
    offsets, experts by their EP rank; the tied output layer of the last stage left to the embedding."""
    files, dist = megatron_runs(legacy), megatron_runs(f"{legacy}_dist")
    read = read_all(files / "iter_0000100")
    by_torch = torch_dcp_load(dist / "iter_0000100", whole_weights(dist))
    assert read.keys() == by_torch.keys()
    for key, value in read.items():
        assert torch.equal(value, by_torch[key]), key
    text = dcptool("inspect", files / "iter_0000100").stdout
    assert "saved_as: legacy per-rank files (--ckpt-format torch)" in text and "left_out: rng_state" in text
    assert ("virtual_pipeline: 2" in text.splitlines()) == ("vpp" in legacy)  # model0, model1 of each stage


@pytest.mark.parametrize("name", ["legacy_moe_tp2_ep2", "legacy_moe_tp2_ep2_dist"])
def test_moe_at_tp2_ep2_exports_the_saved_model(megatron_runs, tmp_path, name):
    """A Qwen3-MoE-like run at TP 2 x EP 2 (experts split along TP too), legacy files and torch_dist: export-hf
    without --config-dir (config.json made from the run's args) loads in transformers with every weight in its
    place, and its weights, put back as Megatron holds them by the tests' own mapping, are the run's."""
    from transformers import AutoModelForCausalLM

    run = megatron_runs(name)
    export = tmp_path / "export"
    result = dcptool("export-hf", run / "iter_0000100", export)
    assert "config.json made from the Megatron-LM run's args" in result.stdout + result.stderr
    config = read_config(export)
    assert config["model_type"] == "qwen3_moe" and config["vocab_size"] == 100
    _, loading = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(loading.values()), loading  # nothing missing, unexpected or mismatched
    full = whole_weights(run)
    back = checkpoint_keys(megatron_weights(load_hf_state(export), config, full["embedding.word_embeddings.weight"]
                                            .shape[0]), config)
    assert back.keys() == full.keys()
    vocabulary = ("embedding.word_embeddings.weight", "output_layer.weight")
    for key, value in full.items():  # Megatron's padding rows hold its random init: the vocabulary's rows compare
        rows = 100 if key in vocabulary else value.shape[0]
        assert torch.equal(back[key][:rows], value[:rows]), key


def test_zarr_is_refused_saying_how_to_convert_it(tmp_path):
    folder = tmp_path / "iter_0000010"
    (folder / "decoder.layers.mlp.linear_fc1.weight").mkdir(parents=True)
    (folder / "decoder.layers.mlp.linear_fc1.weight" / ".zarray").write_text("{}")
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1}))
    result = dcptool("inspect", folder, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr
    assert "metadata.json: a zarr checkpoint, which Megatron-Core removed in 0.16" in lines[0]
    assert "megatron-core < 0.16" in lines[0] and "torch_dist" in lines[0]


@pytest.mark.parametrize("name, write, load", [
    ("tp2", ("convert",), ("--pp", 2)),  # TP 2 -> one writer rank -> Megatron at PP 2
    ("tp2", ("reshard", "--dp", 2), ("--tp", 2)),  # every tensor cut in two along dim 0 -> Megatron at TP 2
    ("legacy_tp2_pp2", ("convert",), ("--tp", 2)),  # legacy files -> torch_dist -> Megatron at TP 2, PP 1
    ("legacy_moe_tp2_ep2_dist", ("convert",), ("--ep", 1)),  # TP 2 x EP 2 -> Megatron with every expert on one rank
])
def test_written_megatron_loads_in_megatron_at_another_layout(megatron_runs, tmp_path, name, write, load):
    run = megatron_runs(name)
    out = tmp_path / "out"
    dcptool(write[0], run / "iter_0000100", out, "--to", "megatron", *write[1:])
    assert json.loads((out / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                "sharded_backend_version": 1}
    loaded = megatron_load(out, run / "model.json", tmp_path / "loaded.pt", *load)
    full = whole_weights(run)
    assert loaded.keys() == full.keys()
    for key, value in loaded.items():
        assert torch.equal(value, full[key]), key
    written = formats.open_checkpoint(out)
    common = written.object_archive(written.objects["common_state/shard_0_1"]).load()[0]
    assert common["iteration"] == 100 and written.info["tensor_parallel"] == 2


def test_common_and_rerun_state_written_back_as_megatron_saved_them(megatron_runs, tmp_path):
    """The common state (args Namespace, Megatron's enums, dtypes) and the rerun state (ShardedObject, enums) are
    read as data and pickled back as what they were: torch, with Megatron's own allowlist, loads them equal to
    what torch's DCP reader unpickles from the source."""
    from conftest import read_dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    torch.serialization.add_safe_globals([ShardedObject])
    source = megatron_runs("tp2") / "iter_0000100"
    dcptool("convert", source, tmp_path / "all.pt", "--to", "torch")
    written = torch.load(tmp_path / "all.pt", weights_only=True)
    saved = read_dcp(source, tmp_path)
    for key in ("common_state/shard_0_1", "rerun_state_machine_state/shard_0_2", "rng_state/shard_0.1_1.2"):
        assert key in written
    common, expected = written["common_state/shard_0_1"][0], saved["common_state/shard_0_1"][0]
    assert common["args"] == expected["args"] and common["args"].params_dtype is torch.float32
    assert type(common["args"].model_type).__module__ == "megatron.core.enums"
    assert written["rerun_state_machine_state/shard_0_2"] == saved["rerun_state_machine_state/shard_0_2"]


def test_weights_loaded_into_the_model_before_saving(megatron_runs):
    """The harness's ``--weights``: whole weights by torch_dist key (here another run's, saved at TP 2) placed into a
    model of another layout (PP 2, the same vocabulary rows) and saved: the save holds exactly those weights."""
    weights = reference_dir(megatron_runs("tp2")) / "full.pt"
    run = megatron_runs("tp2_weights_at_pp2", 2, ["--pp", "2", "--padded-vocab", "128", "--weights", str(weights)])
    given = torch.load(weights, weights_only=True)
    read = read_all(run / "iter_0000100")
    assert read.keys() == given.keys()
    for key, value in read.items():
        assert torch.equal(value, given[key]), key


MCORE_015_METADATA = """
import pickle, sys, types, torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
module = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")
class MCoreMetadata(Metadata):
    pass
class MCoreSavePlan(SavePlan):
    pass
for cls in (MCoreMetadata, MCoreSavePlan):
    cls.__module__ = module.__name__
    setattr(module, cls.__name__, cls)
sys.modules[module.__name__] = module
folder = sys.argv[1]
dcp.save({"decoder.final_layernorm.weight": torch.arange(4.0)}, checkpoint_id=folder, no_dist=True)
with open(folder + "/.metadata", "rb") as file:
    saved = pickle.load(file)
metadata = MCoreMetadata.__new__(MCoreMetadata)
metadata.__dict__.update(vars(saved), mcore_data={"decoder.final_layernorm.weight": {}},
                         all_local_plans=[MCoreSavePlan(items=[])])
with open(folder + "/.metadata", "wb") as file:
    pickle.dump(metadata, file)
open(folder + "/metadata.json", "w").write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
"""


def test_core_0_15_metadata_subclass_is_read_as_torch_metadata(tmp_path):
    """Megatron-Core 0.15 pickles ``.metadata`` as its ``MCoreMetadata`` subclass (and save plans as
    ``MCoreSavePlan``): read as torch's classes, as data."""
    import subprocess
    import sys

    folder = tmp_path / "iter_0000001"
    subprocess.run([sys.executable, "-c", MCORE_015_METADATA, str(folder)], check=True, timeout=300)
    assert b"MCoreMetadata" in (folder / ".metadata").read_bytes()
    checkpoint = formats.open_checkpoint(folder)
    assert checkpoint.format == "megatron"
    assert torch.equal(read_tensor(checkpoint, "decoder.final_layernorm.weight"), torch.arange(4.0))


def test_legacy_run_missing_a_rank_file_is_refused(megatron_runs, tmp_path):
    folder = shutil.copytree(megatron_runs("legacy_tp2_pp2") / "iter_0000100", tmp_path / "iter_0000100")
    shutil.rmtree(folder / "mp_rank_01_001")
    result = dcptool("inspect", folder, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr
    assert "the rank file of tensor rank 1, pipeline rank 1, expert rank 0 is missing" in lines[0]
    assert "args say TP 2, PP 2, EP 1" in lines[0]


@pytest.mark.parametrize("base", ["megatron-common-pt", "megatron", "megatron-legacy"])
def test_common_state_of_each_layout_gives_the_run(bases, base):
    """The common state in ``common.pt`` (before core 0.19), in the ``common_state`` object (0.19) and at the top
    level of legacy files (the fuzz corpus's bases, made without Megatron) gives the same run."""
    checkpoint = formats.open_checkpoint(bases / base)
    assert checkpoint.format == "megatron"
    info = checkpoint.info
    assert (info["iteration"], info["tensor_parallel"], info["pipeline_parallel"], info["layers"]) == (5, 2, 1, 2)
    assert info["args"]["model_type"] == "ModelType(1)" and info["args"]["params_dtype"] == "float32"
    weights = torch.arange(64.0).reshape(2, 8, 4)
    assert torch.equal(read_tensor(checkpoint, "decoder.layers.self_attention.linear_qkv.weight"), weights)


def test_check_names_what_megatron_load_would_miss(tmp_path):
    """A torch_dist folder saved by plain ``dcp.save`` (no common state, no ``_extra_state`` objects): ``check``
    exits 1 naming both; ``convert --to megatron`` adds them, and the output checks fine."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "plain"
    dcp.save({"decoder.layers.self_attention.linear_proj.weight": torch.ones(2, 4, 4)}, checkpoint_id=folder,
             no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    result = dcptool("check", folder, check=False)
    assert result.returncode == 1, result.stderr
    assert "no common state" in result.stdout and "Missing key" in result.stdout
    assert "decoder.layers.self_attention.linear_proj._extra_state/shard_0_2" in result.stdout
    dcptool("convert", folder, tmp_path / "fixed", "--to", "megatron")
    assert "fine" in dcptool("check", tmp_path / "fixed").stdout


def as_grouped_gemm(state: dict) -> dict:
    """A legacy rank file's state with SequentialMLP's experts renamed as Transformer Engine's GroupedMLP keeps them
    (its GroupedLinear registers local expert j's weight as ``weight{j}``, with one ``_extra_state`` byte tensor of
    FP8 scaling state per module)."""
    model = {}
    for key, value in state["model"].items():
        head, found, rest = key.partition(".mlp.experts.local_experts.")
        if not found:
            model[key] = value
            continue
        expert, _, name = rest.partition(".")  # linear_fc1.weight
        if name.endswith("._extra_state"):
            model[f"{head}.mlp.experts.{name}"] = torch.zeros(8, dtype=torch.uint8)
        else:
            model[f"{head}.mlp.experts.{name}{expert}"] = value
    return {**state, "model": model}


def test_legacy_grouped_gemm_experts_read_as_sequential_ones(megatron_runs, tmp_path):
    """Legacy files of Transformer Engine's GroupedMLP experts (``linear_fc1.weight{j}``, made here from the real TP 2
    x EP 2 save's SequentialMLP files by that renaming) read as the same tensors; TE's _extra_state tensors are
    left out with a line."""
    run = megatron_runs("legacy_moe_tp2_ep2") / "iter_0000100"
    grouped = tmp_path / "iter_0000100"
    shutil.copytree(run, grouped)
    for file in grouped.glob("mp_rank_*/model_optim_rng.pt"):
        torch.save(as_grouped_gemm(torch.load(file, weights_only=False)), file)
    assert any(".mlp.experts.linear_fc1.weight1" in key for key in torch.load(file, weights_only=False)["model"])
    expected, read = read_all(run), read_all(grouped)
    assert read.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(read[key], value), key
    assert "_extra_state tensors: Transformer Engine's FP8 scaling state" in dcptool("inspect", grouped).stdout


def test_legacy_experts_of_another_layout_are_refused(tmp_path):
    """Experts kept neither as SequentialMLP's nor as GroupedMLP's per-expert weights (TE's single grouped
    parameter): refused in one line, rather than a model with experts missing."""
    from argparse import Namespace

    args = Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                     num_layers=1, num_experts=2)
    model = {"decoder.layers.0.mlp.experts.linear_fc1.weight": torch.ones(8, 2),
             "decoder.layers.0.mlp.router.weight": torch.ones(2, 2)}
    (tmp_path / "iter_0000001" / "mp_rank_00").mkdir(parents=True)
    torch.save({"model": model, "args": args, "iteration": 1}, tmp_path / "iter_0000001" / "mp_rank_00" /
               "model_optim_rng.pt")
    result = dcptool("inspect", tmp_path / "iter_0000001", check=False)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "linear_fc1.weight: experts of legacy files kept neither as SequentialMLP's" in result.stderr
