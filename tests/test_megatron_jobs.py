"""Megatron-Core's own checkpoints to Hugging Face and back, against transformers and Megatron itself.

A tiny transformers model of each kind (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms, Qwen3-MoE)
becomes a GPTModel (local layer spec) through ``harness.megatron_weights`` (a mapping written apart from
dcptool's tables) and is saved by megatron-core 0.19.2 itself in real gloo jobs (``harness.megatron``) at
TP=2, PP=2 or TP=2 x EP=2. Oracles: the export's weights are the transformers model's, bitwise, and
``from_pretrained`` gives its logits, with the model's config.json and with the one made from the run's args;
dcptool's ``import-hf --adapter megatron`` of the transformers model is loaded by Megatron's own
``dist_checkpointing.load`` at another TP / PP / EP, that GPTModel's forward gives transformers' logits, and the
args the import wrote are those of Megatron's own save. Needs megatron-core (skipped without it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dcptool, megatron_load
from harness.family_models import load_hf_state, read_config, save_hf
from harness.megatron_weights import (
    checkpoint_keys,
    megatron_weights,
    padded_vocab,
    rope_theta,
)
from harness.runtime import reference_dir

# kind -> (the layout Megatron saves it with, the layout it loads dcptool's import with)
LAYOUTS = {"llama": ({"tp": 2}, {"pp": 2}), "qwen2": ({"pp": 2}, {"tp": 2}),
           "qwen3": ({"tp": 2}, {"tp": 1}), "qwen3_moe": ({"tp": 2, "ep": 2}, {"tp": 2})}
# Kinds saved by Megatron for their own test only (with the layout of the save): Qwen2-MoE at EP 2.
SAVED_ONLY = {"qwen2_moe": {"ep": 2}}
TOKENS = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))


def model_options(config: dict) -> dict:
    """harness.megatron's model.json of an HF config (Megatron-LM's default vocabulary multiple, 128)."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return {"num_layers": config["num_hidden_layers"], "hidden": config["hidden_size"],
            "heads": config["num_attention_heads"], "kv_groups": config["num_key_value_heads"],
            "ffn": config["intermediate_size"], "experts": experts, "moe_ffn": config.get("moe_intermediate_size", 32),
            "topk": config.get("num_experts_per_tok", 2), "qk_layernorm": config["model_type"].startswith("qwen3"),
            "qkv_bias": config["model_type"] == "qwen2" or (config["model_type"] == "qwen2_moe"
                                                             and config.get("qkv_bias", True)),
            # HF without norm_topk_prob: softmax over every expert, then top-k (Qwen2-MoE)
            "pre_softmax": bool(experts) and not config.get("norm_topk_prob", False),
            "shared_ffn": config.get("shared_expert_intermediate_size", 0),
            "shared_gate": bool(config.get("shared_expert_intermediate_size")), "vocab": config["vocab_size"], "divisible_by": 128,
            "tied": bool(config.get("tie_word_embeddings")), "seq_len": config["max_position_embeddings"],
            "rope_base": rope_theta(config), "eps": config["rms_norm_eps"]}


def layout_flags(layout: dict) -> tuple[int, list[str]]:
    """Processes and harness flags of a layout ({"tp": 2}: 2 ranks, --tp 2)."""
    world = 1
    flags = []
    for name, size in layout.items():
        world *= size
        flags += [f"--{name}", str(size)]
    return max(world, 1), flags


@pytest.fixture(scope="module")
def runs(megatron_runs, tmp_path_factory):
    """``runs(kind)``: (transformers folder, Megatron's own save of it, its model.json), made once."""
    root = tmp_path_factory.mktemp("megatron-hf")
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = save_hf(kind, root / kind, seed=7, **({"norm_topk_prob": True} if kind == "qwen3_moe" else {}))
            config = read_config(hf)
            weights = root / f"{kind}-weights.pt"
            rows = padded_vocab(config["vocab_size"], 1)  # 256 at tp 1 and 2 (multiples of 128 and 256)
            torch.save(checkpoint_keys(megatron_weights(load_hf_state(hf), config, rows), config), weights)
            saved_as = SAVED_ONLY[kind] if kind in SAVED_ONLY else LAYOUTS[kind][0]
            nproc, flags = layout_flags(saved_as)
            options = [f for name, value in model_options(config).items() for f in (
                [f"--{name.replace('_', '-')}"] if value is True else [] if value is False else
                [f"--{name.replace('_', '-')}", str(value)])]
            run = megatron_runs(f"from-hf-{kind}", nproc, [*flags, *options, "--weights", str(weights)])
            made[kind] = (hf, run / "iter_0000100", run / "model.json")
        return made[kind]

    return get


def common_state(folder: Path) -> dict:
    """The common state of a torch_dist folder as Megatron reads it (``dist_checkpointing.load_common_state_dict``)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(folder)


def transformers_logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_export_of_megatrons_save_is_the_transformers_model(kind, runs, tmp_path):
    """export-hf of Megatron's own save (TP=2, PP=2 or TP=2 x EP=2): the transformers weights, bitwise; its logits,
    also without --config-dir (config.json made from the run's args); verify and checksum --against agree across
    the families."""
    hf, run, _ = runs(kind)
    export = tmp_path / "export"
    result = dcptool("export-hf", run, export, "--config-dir", hf)
    assert f"names: megatron ({kind}), written as hf" in result.stdout + result.stderr
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key
    assert torch.equal(transformers_logits(export), transformers_logits(hf))
    from_args = tmp_path / "from-args"
    result = dcptool("export-hf", run, from_args)
    assert "config.json made from the Megatron-LM run's args" in result.stdout + result.stderr
    assert torch.equal(transformers_logits(from_args), transformers_logits(hf))
    assert "compared bitwise" in dcptool("verify", run, export).stdout
    dcptool("checksum", export, "--write")
    assert dcptool("checksum", export, "--against", run).returncode == 0


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_megatron_loads_dcptools_import(kind, runs, tmp_path):
    """import-hf --adapter megatron, loaded by Megatron's dist_checkpointing.load at another layout than the
    save's: the weights Megatron holds are its own save's, and its forward gives transformers' logits. The args
    the import wrote are those of Megatron's own save of the model (but for its parallel layout). The folder keeps
    the source's config.json for later commands, which Megatron's load passes over."""
    hf, run, model = runs(kind)
    imported = tmp_path / "imported"
    _, load_as = LAYOUTS[kind]
    dcptool("import-hf", hf, imported, "--adapter", "megatron", "--tp", str(load_as.get("tp", 1)))
    assert (imported / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    written, saved = (vars(common_state(folder)["args"]) for folder in (imported, run))
    both = {name for name in written.keys() & saved.keys() if not name.endswith("parallel_size")}
    assert {"num_layers", "num_query_groups", "kv_channels", "padded_vocab_size", "rotary_base", "params_dtype",
            "qk_layernorm", "add_qkv_bias", "untie_embeddings_and_output_weights", "norm_epsilon"} <= both
    assert {name: written[name] for name in both} == {name: saved[name] for name in both}
    tokens = tmp_path / "tokens.pt"
    torch.save(TOKENS, tokens)
    _, flags = layout_flags(load_as)
    with_tokens = ["--tokens", tokens] if load_as.get("pp", 1) == 1 else []
    loaded = megatron_load(imported, model, tmp_path / "loaded.pt", *flags, *with_tokens)
    config = read_config(hf)
    expected = checkpoint_keys(megatron_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 1)),
                               config)
    for key, tensor in expected.items():
        assert torch.equal(loaded[key], tensor), key
    if with_tokens:
        got = loaded["__logits__"][..., :config["vocab_size"]]
        torch.testing.assert_close(got, transformers_logits(hf), rtol=1e-5, atol=1e-5)


def test_qwen2_moe_save_exports_and_loads(runs, tmp_path):
    """Qwen2-MoE (q/k/v biases, routed experts, a shared expert with its sigmoid gate: Megatron's
    moe_shared_expert_intermediate_size and moe_shared_expert_gate) saved by Megatron at EP 2: export-hf
    of it is the transformers model bitwise, with its logits; dcptool's import-hf, loaded by Megatron at TP 2,
    holds the same weights and its forward gives transformers' logits."""
    hf, run, model = runs("qwen2_moe")
    export = tmp_path / "export"
    result = dcptool("export-hf", run, export, "--config-dir", hf)
    assert "names: megatron (qwen2_moe), written as hf" in result.stdout + result.stderr
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key
    # Bitwise weights; the logits to float rounding: transformers' expert loop gathers each expert's tokens
    # into fresh buffers, and which matmul kernel runs on them can follow their alignment.
    torch.testing.assert_close(transformers_logits(export), transformers_logits(hf), rtol=1e-6, atol=1e-6)

    imported, tokens = tmp_path / "imported", tmp_path / "tokens.pt"
    dcptool("import-hf", hf, imported, "--adapter", "megatron", "--tp", "2")
    torch.save(TOKENS, tokens)
    loaded = megatron_load(imported, model, tmp_path / "loaded.pt", "--tp", "2", "--tokens", tokens)
    saved = torch.load(reference_dir(run.parent) / "full.pt", weights_only=True)  # Megatron's own save, whole
    assert "decoder.layers.mlp.shared_experts.gate_weight" in saved
    for key, tensor in saved.items():
        assert torch.equal(loaded[key], tensor), key
    got = loaded["__logits__"][..., :read_config(hf)["vocab_size"]]
    torch.testing.assert_close(got, transformers_logits(hf), rtol=1e-5, atol=1e-5)


def test_run_args_optimizer_state_and_ties(megatron_runs, tmp_path):
    """Without --config-dir, the run's args give the head counts and the vocabulary; a fully_reshardable
    optimizer state follows its parameter into torchtitan's names and layout (slot after the name), taken
    apart as the weight is; a tied run (no output_layer) exports no lm_head."""
    import torch.distributed.checkpoint as dcp

    run = megatron_runs("tp2") / "iter_0000100"  # Llama-like, TP 2, AdamW state in fully_reshardable form
    export = tmp_path / "export"
    result = dcptool("export-hf", run, export)
    assert "head counts and vocab_size from the Megatron-LM run's args" in result.stdout + result.stderr
    assert load_hf_state(export)["model.embed_tokens.weight"].shape[0] == 100  # the padding (to 128) dropped
    assert "compared bitwise" in dcptool("verify", run, export).stdout

    titan = tmp_path / "titan"
    result = dcptool("convert", run, titan, "--to", "dcp", "--adapter", "torchtitan")
    assert "dp_reshardable" not in result.stderr and "ShardedObject" in result.stdout + result.stderr
    names = json.loads(dcptool("inspect", titan, "--json").stdout)["tensors"]
    weight = "layers.1.attention.qkv_linear.wk.weight"
    slots = {slot: f"optimizer.state.{weight}.{slot}" for slot in ("param", "exp_avg", "exp_avg_sq")}
    assert set(slots.values()) <= set(names)
    state = {key: torch.empty(names[key]["shape"]) for key in (weight, *slots.values())}
    dcp.load(state, storage_reader=dcp.FileSystemReader(titan), no_dist=True)
    # harness.megatron's optimizer: param = the weight, exp_avg = 0.1 x, exp_avg_sq = its square
    assert torch.equal(state[slots["param"]], state[weight])
    assert torch.equal(state[slots["exp_avg"]], state[weight] * 0.1)
    assert torch.equal(state[slots["exp_avg_sq"]], state[weight] ** 2)
    assert "compared bitwise" in dcptool("verify", titan, run).stdout  # Llama q/k rows permuted with the args

    tied = megatron_runs("legacy_tp2_pp2_dist") / "iter_0000100"  # TP 2, PP 2, tied embeddings
    export = tmp_path / "tied"
    dcptool("export-hf", tied, export)
    assert "lm_head.weight" not in load_hf_state(export)
    assert "compared bitwise" in dcptool("verify", tied, export).stdout
