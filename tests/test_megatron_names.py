"""Megatron-Core's names (the ``megatron`` naming family): stacked layers, q/k/v grouped per query group,
gate and up fused, layer norms fused into the next linear layer, experts ``[L, E, ...]``, vocabulary padding.

Oracles: ``harness.megatron_weights`` (an HF state dict as Megatron-Core's GPTModel holds it, written from
Megatron's modules with plain torch ops, never importing dcptool), torch's own ``dcp.load`` of what
dcptool writes, and transformers' ``from_pretrained`` logits of the export. The checkpoints saved by
Megatron-Core itself are in tests/test_megatron_jobs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dcptool
from harness.family_models import load_hf_state, read_config, save_hf
from harness.megatron_deepseek import save_hf_with_mtp
from harness.megatron_weights import checkpoint_keys, megatron_weights, padded_vocab, rope_theta

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``hf_models(kind)``: a random tiny transformers model of that kind, saved once."""
    root = tmp_path_factory.mktemp("megatron-hf")
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = save_hf(kind, root / kind, seed=5, **({"norm_topk_prob": True} if kind == "qwen3_moe" else {}))
        return made[kind]

    return get


def load_global(folder: Path, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Tensors of a DCP folder read as Megatron's tools read torch_dist: dcp.load into empty global tensors."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(shape) for key, shape in shapes.items()}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return state


@pytest.mark.parametrize("kind", [*KINDS, "qwen2_moe"])
def test_import_hf_writes_megatrons_tensors(kind, hf_models, tmp_path):
    """Every tensor as Megatron-Core's GPTModel saves it (the independent mapping), padding rows zero."""
    hf = hf_models(kind)
    config = read_config(hf)
    out = tmp_path / "mcore"
    result = dcptool("import-hf", hf, out, "--adapter", "megatron", "--tp", "2")
    assert f"names: hf ({kind}), written as megatron" in result.stdout + result.stderr
    expected = checkpoint_keys(megatron_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 2)),
                               config)
    got = load_global(out, {key: tensor.shape for key, tensor in expected.items()})
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    described = json.loads(dcptool("inspect", out, "--json").stdout)
    assert set(described["tensors"]) == set(expected)  # nothing more, nothing less


def common_state(folder: Path) -> dict:
    """The common state of a torch_dist folder as Megatron's loader gets it: torch's DCP reader, weights_only
    with ``argparse.Namespace`` allowed (as megatron-core's safe_globals allows it)."""
    import argparse

    from torch.distributed.checkpoint.state_dict_loader import (
        _load_state_dict_from_keys,
    )

    with torch.serialization.safe_globals([argparse.Namespace]):
        return _load_state_dict_from_keys({"common_state/shard_0_1"}, checkpoint_id=str(folder))["common_state/shard_0_1"][0]


def test_import_writes_megatron_lms_args(hf_models, tmp_path):
    """import-hf --adapter megatron writes Megatron-LM's args (arguments.py's names) from config.json, the
    vocabulary padded to a multiple of --make-vocab-size-divisible-by x --tp as Megatron-LM pads it, and
    iteration 0; the dtype written is params_dtype."""
    hf = hf_models("qwen3_moe")
    config = read_config(hf)
    out = tmp_path / "mcore"
    dcptool("import-hf", hf, out, "--adapter", "megatron", "--tp", "2", "--make-vocab-size-divisible-by", "48",
            "--dtype", "bfloat16")
    rows = -(-config["vocab_size"] // (48 * 2)) * 48 * 2  # Megatron-LM's _vocab_size_with_padding
    state = common_state(out)
    assert state["iteration"] == 0 and state["checkpoint_version"] == 3.0
    args = vars(state["args"])
    expected = {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
                "ffn_hidden_size": config["intermediate_size"], "num_attention_heads": config["num_attention_heads"],
                "num_query_groups": config["num_key_value_heads"], "group_query_attention": True,
                "kv_channels": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                "max_position_embeddings": config["max_position_embeddings"], "norm_epsilon": config["rms_norm_eps"],
                "vocab_size": config["vocab_size"], "padded_vocab_size": rows, "make_vocab_size_divisible_by": 48,
                "tensor_model_parallel_size": 2, "num_experts": config.get("num_experts") or config["num_local_experts"],
                "moe_router_topk": config["num_experts_per_tok"], "moe_ffn_hidden_size": config["moe_intermediate_size"],
                "moe_router_pre_softmax": False, "qk_layernorm": True, "add_qkv_bias": False, "swiglu": True,
                "untie_embeddings_and_output_weights": True, "normalization": "RMSNorm",
                "position_embedding_type": "rope", "rotary_base": int(rope_theta(config)),
                "params_dtype": torch.bfloat16, "bf16": True, "tokenizer_type": "HuggingFaceTokenizer"}
    assert {name: args.get(name) for name in expected} == expected
    shapes = json.loads(dcptool("inspect", out, "--json").stdout)["tensors"]
    assert shapes["embedding.word_embeddings.weight"]["shape"][0] == rows


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_names_export_to_the_source_model(kind, hf_models, tmp_path):
    """import-hf --adapter megatron, then export-hf without --config-dir: the import keeps the source's config.json
    in its torch_dist folder, where the export finds it (a config.json made from the run's args when there is none:
    test_config_from_args_only_for_a_model_it_describes); transformers' logits of the export are the source's;
    verify and checksum --against agree across the families."""
    from transformers import AutoModelForCausalLM

    hf = hf_models(kind)
    mcore, export = tmp_path / "mcore", tmp_path / "export"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    assert (mcore / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    result = dcptool("export-hf", mcore, export)
    assert f"names: megatron ({kind}), written as hf" in result.stdout + result.stderr
    assert "made from the Megatron-LM run's args" not in result.stdout + result.stderr
    assert read_config(export) == read_config(hf) | {"torch_dtype": "float32"}  # the source's; both dtype names said
    source = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    exported = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    ids = torch.randint(0, read_config(hf)["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(source(ids).logits, exported(ids).logits)
    assert load_hf_state(export).keys() == load_hf_state(hf).keys()
    for a, b in ((mcore, export), (export, mcore), (hf, mcore)):
        assert "compared bitwise" in dcptool("verify", a, b).stdout
    if kind.startswith("qwen3"):  # a manifest holds no config: the head size comes from the q/k norms
        dcptool("checksum", hf, "--write")
        assert dcptool("checksum", hf, "--against", mcore).returncode == 0
        dcptool("checksum", mcore, "--write")  # the other way: Megatron's padding rows have no counterpart
        refused = dcptool("checksum", mcore, "--against", hf, check=False)
        assert refused.returncode == 2 and "Megatron pads the vocabulary" in refused.stderr, refused.stderr


def test_config_from_args_only_for_a_model_it_describes(hf_models, tmp_path):
    """dcptool's import re-saved as legacy per-rank files with its args: exported without --config-dir to the
    source's logits; with args that describe another model (LayerNorm, interleaved RoPE) no config.json is made,
    in a line saying which."""
    from argparse import Namespace

    from transformers import AutoModelForCausalLM

    hf = hf_models("qwen3")
    mcore = tmp_path / "mcore"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    shapes = {key: tuple(info["shape"]) for key, info in json.loads(dcptool("inspect", mcore, "--json").stdout)
              ["tensors"].items()}
    model = {}  # the local layer spec's per-layer names, as a legacy file holds them
    for key, tensor in load_global(mcore, shapes).items():
        if key.startswith("decoder.layers."):
            model.update({key.replace("layers.", f"layers.{i}.", 1): layer for i, layer in enumerate(tensor)})
        else:
            model[key] = tensor
    args = vars(common_state(mcore)["args"])
    for field, value in ((None, None), ("normalization", "LayerNorm"), ("rotary_interleaved", True)):
        folder = tmp_path / f"legacy-{field}" / "iter_0000000"
        (folder / "mp_rank_00").mkdir(parents=True)
        torch.save({"model": model, "args": Namespace(**{**args, **({field: value} if field else {})}),
                    "iteration": 0, "checkpoint_version": 3.0}, folder / "mp_rank_00" / "model_optim_rng.pt")
        export = tmp_path / f"export-{field}"
        result = dcptool("export-hf", folder, export)
        if field is None:
            assert "config.json made from the Megatron-LM run's args" in result.stdout + result.stderr
            source = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
            exported = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
            ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                assert torch.equal(source(ids).logits, exported(ids).logits)
        else:
            assert f"no config.json made from the run's args: args {field} describe a model" in result.stderr
            assert not (export / "config.json").exists()


def test_fused_experts_and_other_families(hf_models, tmp_path):
    """Qwen3-MoE's experts to transformers v5's fused layout and to torchtitan's grouped ones, from
    Megatron's [L, E, ...]: the same values as the HF source (verify across families, bitwise)."""
    hf = hf_models("qwen3_moe")
    mcore = tmp_path / "mcore"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    fused = tmp_path / "fused"
    dcptool("export-hf", mcore, fused, "--config-dir", hf, "--hf-experts", "fused")
    state = load_hf_state(fused)
    source = load_hf_state(hf)
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[3], torch.cat([source["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                              source["model.layers.1.mlp.experts.3.up_proj.weight"]]))
    titan = tmp_path / "titan"
    result = dcptool("convert", mcore, titan, "--to", "dcp", "--adapter", "torchtitan", "--config-dir", hf)
    assert "written as torchtitan" in result.stderr + result.stdout
    assert "compared bitwise" in dcptool("verify", titan, hf).stdout
    back = tmp_path / "back"  # and from torchtitan's names to Megatron's again: the same bytes
    dcptool("convert", titan, back, "--to", "megatron", "--adapter", "megatron", "--config-dir", hf)
    assert "equal" in dcptool("verify", back, mcore, "--values-only").stdout


def test_deepseek_v3_round_trip(tmp_path):
    """DeepSeek-V3 (latent attention, a dense first layer, shared experts, the router's score bias, a
    multi-token-prediction layer): HF -> Megatron names (per-layer keys: the layers are not uniform;
    ``mtp.layers.0``) -> HF, bitwise; the prediction layer's copies of the embedding and head are Megatron's
    shared ones. Megatron's own save of it: tests/test_megatron_deepseek.py."""
    hf = save_hf_with_mtp(tmp_path / "hf", seed=2, num_nextn_predict_layers=1)
    mcore, export = tmp_path / "mcore", tmp_path / "export"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    keys = set(json.loads(dcptool("inspect", mcore, "--json").stdout)["tensors"])
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.router.expert_bias",
            "decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
            "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.0.self_attention.linear_kv_down_proj.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"} <= keys
    assert not any(key.startswith("decoder.layers.2.") for key in keys)
    dcptool("export-hf", mcore, export, "--config-dir", hf)
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)


@pytest.mark.parametrize("qk_norm, rotary", [(True, 0.5), (False, 0.25)])
def test_glm4_moe_round_trip(qk_norm, rotary, tmp_path):
    """GLM-4.5 MoE (q/k/v biases, optional q/k norms, a dense first layer, the router's score bias, shared experts,
    a prediction layer in the released names): HF -> Megatron names -> HF, per-expert and fused, bitwise; the
    names alone say glm4_moe (without q/k norms too, where Qwen2-MoE's table names as many: its has no HF place
    for the router's bias, which Megatron keeps only for a sigmoid router). The import's Megatron-LM args make
    the export's config.json without --config-dir, which gives the source's logits. Megatron's own save of it:
    tests/test_megatron_glm.py."""
    from transformers import AutoModelForCausalLM

    hf = save_hf_with_mtp(tmp_path / "hf", seed=3, kind="glm4_moe", num_nextn_predict_layers=1, use_qk_norm=qk_norm,
                          partial_rotary_factor=rotary)
    mcore, export, fused = tmp_path / "mcore", tmp_path / "export", tmp_path / "fused"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron", "--tp", "2")
    keys = set(json.loads(dcptool("inspect", mcore, "--json").stdout)["tensors"])
    assert {"decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_qkv.bias",
            "decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
            "mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias"} <= keys
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in keys) == qk_norm
    assert "names: megatron (glm4_moe)" in dcptool("inspect", mcore).stdout
    result = dcptool("export-hf", mcore, export, "--config-dir", hf)
    assert "names: megatron (glm4_moe), written as hf" in result.stdout + result.stderr
    source = load_hf_state(hf)
    assert load_hf_state(export).keys() == source.keys()
    assert "compared bitwise" in dcptool("verify", export, hf).stdout
    dcptool("export-hf", mcore, fused, "--config-dir", hf, "--hf-experts", "fused")
    gate_up = load_hf_state(fused)["model.layers.2.mlp.experts.gate_up_proj"]  # the prediction layer's experts
    assert torch.equal(gate_up[1], torch.cat([source["model.layers.2.mlp.experts.1.gate_proj.weight"],
                                              source["model.layers.2.mlp.experts.1.up_proj.weight"]]))
    refused = dcptool("import-hf", hf, tmp_path / "titan", "--adapter", "torchtitan", check=False)
    assert refused.returncode == 2 and "glm4_moe has no torchtitan names" in refused.stderr, refused.stderr
    from_args = tmp_path / "from-args"
    (mcore / "config.json").unlink()  # the config the import kept: the run's args make one
    result = dcptool("export-hf", mcore, from_args)
    assert "config.json made from the Megatron-LM run's args" in result.stdout + result.stderr
    assert "compared bitwise" in dcptool("verify", from_args, hf).stdout
    ids = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        source, made = (AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()(ids).logits
                        for folder in (hf, from_args))
    torch.testing.assert_close(made, source, rtol=1e-6, atol=1e-6)


def test_glm4_moe_args_it_cannot_describe(tmp_path):
    """A GLM-4.5 run's args whose model its config.json cannot state (MoE layers that are not all after the dense
    ones, shared experts not a whole number of routed experts' size, a softmax router, routing in groups) make no
    config.json, in a line naming them; a config Megatron has no such model for (a sigmoid router whose top k is
    not normalised) writes no args."""
    from dcptool.families.megatron import args as megatron_args

    hf = save_hf_with_mtp(tmp_path / "hf", seed=3, kind="glm4_moe", num_nextn_predict_layers=1)
    mcore = tmp_path / "mcore"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    written = vars(common_state(mcore)["args"])
    made, _ = megatron_args.hf_config_from_args("glm4_moe", written)
    assert made is not None and made["first_k_dense_replace"] == 1 and made["n_shared_experts"] == 1
    for field, value in (("moe_layer_freq", [1, 0]), ("moe_shared_expert_intermediate_size", 48),
                         ("moe_router_score_function", "softmax"), ("moe_router_num_groups", 2)):
        made, line = megatron_args.hf_config_from_args("glm4_moe", {**written, field: value})
        assert made is None and f"args {field} describe a model that config.json of glm4_moe does not" in line
    unnormalised = tmp_path / "unnormalised"
    config = read_config(hf) | {"norm_topk_prob": False}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(config))
    result = dcptool("import-hf", hf, unnormalised, "--adapter", "megatron", "--config-dir", tmp_path / "config")
    assert "no args" in result.stdout + result.stderr
    assert "args" not in common_state(unnormalised)


def test_qwen2_moe_round_trip(hf_models, tmp_path):
    """Qwen2-MoE (q/k/v biases, routed experts, a shared expert and its sigmoid gate): HF -> Megatron names ->
    HF, per-expert and fused; transformers' logits of the export are the source's. Archon and torchtitan have
    no such model: a mapping to them is refused, nothing written."""
    from transformers import AutoModelForCausalLM

    hf = hf_models("qwen2_moe")
    mcore, export, fused = tmp_path / "mcore", tmp_path / "export", tmp_path / "fused"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron", "--tp", "2")
    shapes = json.loads(dcptool("inspect", mcore, "--json").stdout)["tensors"]
    config = read_config(hf)
    assert "names: megatron (qwen2_moe)" in dcptool("inspect", mcore).stdout  # told from the names alone
    assert shapes["decoder.layers.mlp.shared_experts.gate_weight"]["shape"] == [2, 1, config["hidden_size"]]
    assert shapes["decoder.layers.mlp.shared_experts.linear_fc1.weight"]["shape"] == [
        2, 2 * config["shared_expert_intermediate_size"], config["hidden_size"]]
    result = dcptool("export-hf", mcore, export, "--config-dir", hf)
    assert "names: megatron (qwen2_moe), written as hf" in result.stdout + result.stderr
    source = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    exported = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    ids = torch.randint(0, config["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    # The weights bitwise (verify); the logits to float rounding: transformers' expert loop gathers each
    # expert's tokens into fresh buffers, and which matmul kernel runs on them can follow their alignment.
    with torch.no_grad():
        torch.testing.assert_close(source(ids).logits, exported(ids).logits, rtol=1e-6, atol=1e-6)
    assert load_hf_state(export).keys() == load_hf_state(hf).keys()
    assert "compared bitwise" in dcptool("verify", hf, mcore).stdout
    assert "compared bitwise" in dcptool("verify", export, hf).stdout
    dcptool("export-hf", mcore, fused, "--config-dir", hf, "--hf-experts", "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_hf_state(fused)
    with torch.no_grad():
        torch.testing.assert_close(source(ids).logits, AutoModelForCausalLM.from_pretrained(
            fused, attn_implementation="eager").eval()(ids).logits, rtol=1e-6, atol=1e-6)
    refused = dcptool("import-hf", hf, tmp_path / "titan", "--adapter", "torchtitan", check=False)
    assert refused.returncode == 2 and "qwen2_moe has no torchtitan names" in refused.stderr, refused.stderr
    assert not (tmp_path / "titan").exists()


def test_refusals(hf_models, tmp_path):
    """One line and exit 2: head counts or a vocabulary that do not fit the tensors, a Megatron model
    kind no table knows, Llama's fused qkv without head counts, a data-parallel mesh for a Megatron import."""
    hf = hf_models("qwen3")
    mcore = tmp_path / "mcore"
    dcptool("import-hf", hf, mcore, "--adapter", "megatron")
    for field, value, words in (("num_key_value_heads", 1, "linear_qkv has"),
                                ("vocab_size", 4096, "vocab_size 4096")):
        config = tmp_path / f"config-{field}"
        config.mkdir()
        (config / "config.json").write_text(json.dumps({**read_config(hf), field: value}))
        result = dcptool("export-hf", mcore, tmp_path / f"out-{field}", "--config-dir", config, check=False)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / f"out-{field}").exists()

    # Llama's fused qkv without head counts: a plain DCP of dcptool's import (no args), without the config.json
    # the convert keeps
    llama = tmp_path / "llama"
    dcptool("import-hf", hf_models("llama"), tmp_path / "llama-mcore", "--adapter", "megatron")
    dcptool("convert", tmp_path / "llama-mcore", llama, "--to", "dcp")
    (llama / "config.json").unlink()
    result = dcptool("export-hf", llama, tmp_path / "out-llama", check=False)
    assert result.returncode == 2 and "needs the head counts" in result.stderr and "--config-dir" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    # --make-vocab-size-divisible-by pads Megatron-Core's vocabulary: refused with another adapter
    result = dcptool("import-hf", hf, tmp_path / "titan", "--adapter", "torchtitan", "--make-vocab-size-divisible-by",
                     "64", check=False)
    assert result.returncode == 2 and "--make-vocab-size-divisible-by" in result.stderr and "--adapter megatron" in \
        result.stderr and not (tmp_path / "titan").exists(), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    result = dcptool("import-hf", hf, tmp_path / "zero", "--adapter", "megatron", "--make-vocab-size-divisible-by",
                     "0", check=False)
    assert result.returncode == 2 and "--make-vocab-size-divisible-by 0" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "zero").exists()

    # Megatron reshards as it loads: a data-parallel mesh for its import is refused, not ignored
    result = dcptool("import-hf", hf, tmp_path / "mesh", "--adapter", "megatron", "--dp", "2", check=False)
    assert result.returncode == 2 and "--dp" in result.stderr and not (tmp_path / "mesh").exists(), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    import torch.distributed.checkpoint as dcp  # a hybrid (Mamba) model: Megatron names no table knows

    unknown = tmp_path / "hybrid"
    dcp.save({"embedding.word_embeddings.weight": torch.ones(8, 4), "decoder.layers.mixer.in_proj.weight":
              torch.ones(2, 8, 4)}, storage_writer=dcp.FileSystemWriter(unknown), no_dist=True)
    result = dcptool("export-hf", unknown, tmp_path / "out-hybrid", check=False)
    assert result.returncode == 2 and "decoder.layers.mixer.in_proj.weight" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
