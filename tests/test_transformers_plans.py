"""reshard by transformers' own TP and EP plans, against transformers' own distributed training.

Tiny random-weight Qwen3-Next, GLM-4.5 MoE, GPT-OSS and Qwen2.5-VL models (no dcptool table) are saved by a real FSDP2 job of
transformers (tests/harness/transformers_jobs.py), resharded by dcptool for tp=2 and for ep=2, and loaded by a
real job that builds the model on the meta device and parallelizes it with transformers' own code
(``maybe_distribute_model``: the model's plans through ``apply_tensor_parallelism`` and
``apply_expert_parallelism``): every rank's local shards are compared bitwise with the saved state, and that
job's own ``dcp.save`` must hold the chunks dcptool wrote, each in the file of the rank that holds it. The known
kinds' tables are checked against transformers' plans; the snapshot dcptool ships against the installed
transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import dcptool, oracle
from harness.family_models import HF_ONLY_MODELS, MODELS
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcptool import models
from dcptool.mesh import Mesh, local_chunk
from dcptool.models import transformers_plans
from dcptool.planning import plans, resharding
from jobs import run_steps

TRANSFORMERS_JOBS = "harness.transformers_jobs"

# Tiny models of kinds dcptool has no table for: config fields given to transformers' config classes.
SMALL_TEXT = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
TINY = {
    "qwen3_next": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "tie_word_embeddings": False,
                   "architectures": ["Qwen3NextForCausalLM"]},
    "glm4_moe": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "tie_word_embeddings": False, "architectures": ["Glm4MoeForCausalLM"]},
    "gpt_oss": {**SMALL_TEXT, "intermediate_size": 32, "head_dim": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2, "tie_word_embeddings": False, "architectures": ["GptOssForCausalLM"]},
    "qwen2_5_vl": {"text_config": {**SMALL_TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                     "mrope_section": [2, 3, 3]}},
                   "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2,
                                     "out_hidden_size": 64, "fullatt_block_indexes": [1]},
                   "tie_word_embeddings": False, "architectures": ["Qwen2_5_VLForConditionalGeneration"]},
}
# The meshes each is resharded for: on the 2 ranks the source was saved with (Qwen2.5-VL has no EP plan), and
# FSDP over TP on 4, where transformers saves contiguous what FSDP2 places as _StridedShard.
TARGETS = {"tp2": {"tp": 2}, "ep2": {"dp": 2, "ep": 2}, "dp2_tp2": {"dp": 2, "tp": 2}}
TARGETS_OF = {kind: ("tp2",) if kind == "qwen2_5_vl" else ("tp2", "ep2") for kind in TINY}
TARGETS_OF["qwen3_next"] += ("dp2_tp2",)


def chunk_files(path) -> dict:
    """Per tensor key, its chunks (offsets, sizes) and the file holding each, from torch's own reader."""
    metadata = FileSystemReader(str(path)).read_metadata()
    files = {(index.fqn, tuple(index.offset or ())): info.relative_path
             for index, info in metadata.storage_data.items()}
    return {key: sorted((tuple(c.offsets), tuple(c.sizes), files[key, tuple(c.offsets)]) for c in entry.chunks)
            for key, entry in metadata.state_dict_metadata.items() if isinstance(entry, TensorStorageMetadata)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per kind of TINY: (checkpoint, reference folder) saved by one 2-rank FSDP2 job of transformers."""
    transformers = oracle("transformers")
    root = tmp_path_factory.mktemp("transformers-plans")
    steps = {}
    for kind, fields in TINY.items():
        transformers.AutoConfig.for_model(kind, **fields).save_pretrained(root / f"{kind}-config")
        steps[kind] = ["save", root / kind, "--config", root / f"{kind}-config", "--dp", "2"]
    for kind, step in run_steps(2, steps, module=TRANSFORMERS_JOBS).items():
        assert step.returncode == 0, step.stdout
    return {kind: (root / kind, root / f"{kind}.reference") for kind in TINY}


@pytest.fixture(scope="module")
def loads(sources, tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """Per (kind, target): dcptool's reshard, the job's own save on that mesh, and the job step that loaded it:
    every case one step of a launch of its number of ranks (one of 2, one of 4)."""
    root = tmp_path_factory.mktemp("transformers-loads")
    cases, steps = {}, {2: {}, 4: {}}
    for kind, (source, reference) in sources.items():
        for target in TARGETS_OF[kind]:
            mesh = TARGETS[target]
            name = f"{kind}-{target}"
            out, own = root / name, root / f"{name}.own"
            flags = [item for setting, size in mesh.items() for item in (f"--{setting}", str(size))]
            dcptool("reshard", source, out, *flags, "--config-dir", reference)
            cases[name] = (out, own)
            steps[mesh.get("dp", 1) * mesh.get("tp", 1)][name] = [
                "load", out, "--config", reference, *flags, "--expect", reference / "full.pt", "--save-layout", own]
    done = {name: step for ranks, launch in steps.items() for name, step in
            run_steps(ranks, launch, module=TRANSFORMERS_JOBS).items()}
    return {name: (*paths, done[name]) for name, paths in cases.items()}


CASES = [f"{kind}-{target}" for kind in TINY for target in TARGETS_OF[kind]]


@pytest.mark.parametrize("case", CASES)
def test_reshard_by_transformers_plan_loads_in_transformers_job(loads, case):
    """Local shards bitwise in transformers' own job, and its dcp.save holds the chunks dcptool wrote; a tensor split
    over every rank has each chunk in the file of the one rank holding it (a chunk several ranks hold is in any
    holder's: dcp.save's pick)."""
    out, own, step = loads[case]
    assert step.returncode == 0 and "OK:" in step.stdout, step.stdout
    written, saved = chunk_files(out), chunk_files(own)
    assert {key: [c[:2] for c in chunks] for key, chunks in written.items()} == \
        {key: [c[:2] for c in chunks] for key, chunks in saved.items()}
    ranks = len({file for chunks in saved.values() for *_, file in chunks})
    split = [key for key, chunks in saved.items() if len(chunks) == ranks]
    assert split and all(written[key] == saved[key] for key in split)


def test_dry_run_names_transformers_plan_and_its_entries(sources, tmp_path):
    """Qwen3-Next's linear attention split as transformers' plan says (whole before this plan was read), the fused
    experts' gate and up halves each split (placed as _StridedShard, saved contiguous as transformers saves them)."""
    source, reference = sources["qwen3_next"]
    args = ("reshard", source, tmp_path / "out", "--tp", "2", "--config-dir", reference, "--dry-run")
    plan = json.loads(dcptool(*args, "--json").stdout)
    assert plan["plan"] == "transformers"
    assert plan["plan_description"].startswith("Qwen3NextForCausalLM's tp plan from ")
    entries = {entry["entry"]: (entry["style"], entry["parameters"]) for entry in plan["plan_entries"]}
    assert entries["model.layers.*.linear_attn.in_proj_qkvz"] == ("colwise_gather_output", 3)
    assert entries["model.layers.*.mlp.experts.gate_up_proj"] == ("packed_colwise", 4)
    tensors = plan["tensors"]
    for name in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
        assert tensors[f"model.layers.0.linear_attn.{name}.weight"]["placement"] == "tp=2:Shard(0)"
    experts = tensors["model.layers.0.mlp.experts.gate_up_proj"]
    assert (experts["placement"], experts["placed"]) == ("tp=2:Shard(1)", "tp=2:_StridedShard(1, sf=2)")
    assert tensors["model.layers.3.self_attn.q_norm.weight"]["placement"] == "replicated"
    assert not plan["problems"] and not plan["warnings"]
    text = dcptool(*args).stdout
    assert "(plan transformers: Qwen3NextForCausalLM's tp plan from " in text.splitlines()[0]
    assert any(line.split()[:2] == ["model.layers.*.linear_attn.in_proj_qkvz", "colwise_gather_output"]
               for line in text.splitlines())


def test_known_kind_keeps_its_table(checkpoints, tmp_path):
    source, reference = checkpoints("fsdp2_dp2")
    plan = json.loads(dcptool("reshard", source, tmp_path / "out", "--tp", "2", "--config-dir", reference,
                              "--dry-run", "--json").stdout)
    assert plan["plan"] == "hf" and plan["plan_description"].startswith("dcptool's table of model kind llama")
    assert {"entry": r"self_attn\.o_proj\.weight$", "style": "rowwise", "parameters": 2} in plan["plan_entries"]


def test_kind_with_neither_table_nor_plan_is_replicated_with_a_line(checkpoints, tmp_path):
    source, reference = checkpoints("fsdp2_dp2")
    config = json.loads((reference / "config.json").read_text()) | {"model_type": "no_such_kind", "architectures": []}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    args = ("reshard", source, tmp_path / "out", "--tp", "2", "--config-dir", tmp_path / "config")
    plan = json.loads(dcptool(*args, "--dry-run", "--json").stdout)
    assert not plan["problems"]
    assert any(warning.startswith("model type 'no_such_kind' has no table in dcptool and no plan in transformers")
               for warning in plan["warnings"])
    assert {tensor["placement"] for tensor in plan["tensors"].values()} == {"replicated"}
    written = dcptool(*args)
    assert "no table in dcptool and no plan in transformers" in written.stderr


def _saved_chunks(plan: plans.Plan, name: str, shape: tuple[int, ...], mesh: Mesh):
    """The chunks a job of ``plan`` saves of the tensor on ``mesh``."""
    rule = plan.rule_for(name) or resharding.DEFAULT_RULE
    spec = resharding.saved(resharding.tensor_spec(name, rule, shape, mesh, plan.engine), plan.engine)
    return sorted({local_chunk(shape, spec, mesh.coordinates(rank)) for rank in range(mesh.world)})


# Where a kind's table and transformers' plan lay a tensor out differently on purpose: (model, mesh, name) -> why.
DELIBERATE = {
    (model, "dp=8 ep=2", f"model.layers.{layer}.mlp.experts.{weight}"):
        "the table's jobs are torchtitan's, whose FSDP2 shards experts on dim 1 when the data-parallel ranks "
        "outnumber them; transformers' always shards dim 0"
    for model, layers in (("qwen3_moe", (0, 1)), ("qwen2_moe", (0, 1)), ("deepseek_v3", (1,)), ("glm4_moe", (1,)))
    for layer in layers for weight in ("gate_up_proj", "down_proj")
}
MESHES = {"dp=2 tp=2": Mesh(dp=2, tp=2), "dp=4 ep=2": Mesh(dp=4, ep=2), "dp=2 tp=2 ep=2": Mesh(dp=2, tp=2, ep=2),
          "dp=8 ep=2": Mesh(dp=8, ep=2)}


def test_tables_agree_with_transformers_plans():
    """Every kind's HF table lays out every weight of transformers' model as transformers' plan does, on meshes of
    TP, EP and both, but for the differences DELIBERATE lists."""
    from test_models import meta_weights

    differences = {}
    for model, (kind, fields) in (MODELS | HF_ONLY_MODELS).items():
        if not models.kinds()[kind].tp_rules["hf"]:
            continue  # a kind without rules of its own (GPT-OSS) is laid out by transformers' plan itself
        config = {"model_type": kind, **fields}
        weights = meta_weights(config)
        for where, mesh in MESHES.items():
            table = plans.choose("hf", list(weights), config, tp=mesh.tp, ep=mesh.ep)
            theirs = plans.choose("transformers", list(weights), config, tp=mesh.tp, ep=mesh.ep)
            assert table.description.startswith(f"dcptool's table of model kind {kind}")
            for name, shape in weights.items():
                if _saved_chunks(table, name, shape, mesh) != _saved_chunks(theirs, name, shape, mesh):
                    differences[model, where, name] = (table.rule_for(name), theirs.rule_for(name))
    assert set(differences) == set(DELIBERATE), {k: v for k, v in differences.items() if k not in DELIBERATE}


def test_snapshot_holds_the_installed_transformers_plans():
    """The snapshot dcptool ships is what the installed transformers resolves, for the kinds tested here and the
    known ones (scripts/transformers_plans.py --check compares every model type)."""
    transformers = oracle("transformers")
    shipped = transformers_plans.snapshot()
    assert shipped.transformers == transformers.__version__, "run python scripts/transformers_plans.py"
    known = {kind.architecture_of or name for name, kind in models.kinds().items()}  # Kimi-K2: DeepSeek-V3's class
    for model_type in (*TINY, *sorted(known), "qwen3_vl", "qwen3_vl_moe", "mixtral"):
        with transformers_plans._quiet(transformers):
            live = transformers_plans.read_model(transformers, model_type)
        assert shipped.models[model_type].as_json() == live.as_json(), model_type



@pytest.mark.parametrize("engine", ["torch", "transformers"])
def test_plan_file_packed_split_by_engine(checkpoints, tmp_path, engine):
    """A plan file's packed rule: a job of torch's conventions cannot save each half's part as placed (dcp.save
    records one region per rank: refused); transformers' saves it contiguous."""
    source, reference = checkpoints("fsdp2_dp2")
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({"name": "packed", "engine": engine, "rules": [
        {"match": r"mlp\.gate_proj\.weight$", "tp": "colwise", "packed": 2},
        {"match": r"mlp\.down_proj\.weight$", "tp": "rowwise", "dim": -1}]}))
    result = dcptool("reshard", source, tmp_path / "out", "--tp", "2", "--plan", plan_file, "--config-dir", reference,
                     "--dry-run", "--json", check=False)
    plan = json.loads(result.stdout)
    gate = plan["tensors"].get("model.layers.0.mlp.gate_proj.weight")
    if engine == "torch":
        assert result.returncode == 2 and gate is None
        assert any(p.startswith("model.layers.0.mlp.gate_proj.weight: on 2 ranks: tp=2 a rank's shard is not a "
                                "rectangle") for p in plan["problems"]), plan["problems"]
    else:
        assert result.returncode == 0, plan["problems"]
        assert (gate["placement"], gate["placed"]) == ("tp=2:Shard(0)", "tp=2:_StridedShard(0, sf=2)")
    assert plan["tensors"]["model.layers.0.mlp.down_proj.weight"]["placement"] == "tp=2:Shard(1)"
