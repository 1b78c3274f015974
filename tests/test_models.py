"""Model kinds (dcptool.models): each kind's table of HF weights against the model transformers builds from the
same config on the meta device, and the answers the registry gives for every kind at once."""

from __future__ import annotations

import pytest
from conftest import oracle
from harness.family_models import HF_ONLY_MODELS, MODELS

from dcptool import families, models
from dcptool.planning import completeness, hf_config


def _variants() -> list[tuple[str, dict]]:
    """Every model of the family tests, and the config switches each kind's table reads."""
    found = []
    for name, (kind, fields) in (MODELS | HF_ONLY_MODELS).items():
        config = {"model_type": kind, **fields}
        found += [(name, config), (f"{name}+attention_bias", {**config, "attention_bias": True}),
                  (f"{name}+mlp_bias", {**config, "mlp_bias": True})]
        if kind in ("qwen3_moe", "qwen2_moe"):
            found += [(f"{name}+mlp_only_layers", {**config, "mlp_only_layers": [0]}),
                      (f"{name}+decoder_sparse_step", {**config, "decoder_sparse_step": 2})]
        if kind == "qwen2_moe":
            found.append((f"{name}+no_qkv_bias", {**config, "qkv_bias": False}))
        if kind == "deepseek_v3":
            found.append((f"{name}+no_q_lora", {**config, "q_lora_rank": None, "first_k_dense_replace": 0}))
            # Kimi-K2: DeepSeek-V3's fields under its own model_type (transformers builds DeepSeek-V3's model)
            found.append(("kimi_k2", {**config, "model_type": "kimi_k2"}))
        if kind == "gpt_oss":
            found.append((f"{name}+no_attention_bias", {**config, "attention_bias": False}))
        if kind == "glm4_moe":
            found += [(f"{name}+no_qk_norm", {**config, "use_qk_norm": False, "attention_bias": False}),
                      (f"{name}+no_dense_layer", {**config, "first_k_dense_replace": 0, "n_shared_experts": 2})]
    return found


def meta_weights(config: dict) -> dict[str, tuple[int, ...]]:
    """The names and shapes of every weight transformers saves for ``config``: the model built on the meta device."""
    torch, transformers = oracle("torch"), oracle("transformers")
    fields = {key: value for key, value in config.items() if key != "model_type"}
    architecture = models.kind_of(config).architecture_of or config["model_type"]  # no class of Kimi-K2's own
    settings = transformers.AutoConfig.for_model(architecture, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(settings)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name, config", _variants(), ids=[name for name, _ in _variants()])
def test_table_matches_the_meta_model(name, config):
    """Names and shapes from the kind's table are those of transformers' model (fused experts as it builds them)."""
    built = meta_weights(config)
    kind = models.kind_of(config)
    fused = any(key.endswith(".experts.gate_up_proj") for key in built)
    required, optional = hf_config.expected_weights(config, kind, fused)
    assert {**required, **optional} == built
    assert set(optional) == ({"lm_head.weight"} if config.get("tie_word_embeddings") else set())
    assert hf_config.misfit(config, {key: built[key] for key in required}) is None


@pytest.mark.parametrize("name, config", _variants(), ids=[name for name, _ in _variants()])
def test_completeness_by_the_table_is_transformers_own(name, config):
    """export-hf's completeness asks a kind's table (no torch) before transformers: both say the same weights are
    needed, under the names save_pretrained writes (experts one by one) and under the model's own (fused)."""
    oracle("transformers")
    # Kimi-K2 has no class in transformers: its architecture's (DeepSeek-V3's) model answers for it
    architecture = models.kinds()[config["model_type"]].architecture_of or config["model_type"]
    built, why = completeness.by_transformers({**config, "model_type": architecture})
    assert built is not None, why
    saved = {form for forms in built.required.values() for form in forms}
    for fused, names in ((False, saved), (True, set(built.required))):
        table, _ = completeness.by_table(config, fused)
        assert set(table.required) == names, fused
        assert not completeness.find(config, names).missing and not completeness.find(config, names).unexpected


def test_every_kind_is_one_module():
    assert sorted(models.kinds()) == ["deepseek_v3", "glm4_moe", "gpt_oss", "kimi_k2", "llama", "qwen2", "qwen2_moe",
                                      "qwen3", "qwen3_moe"]
    for kind in models.kinds().values():
        assert type(kind).__module__ == "dcptool.models.kind"
        # layers after the main ones need their weights declared: exports must hold them (planning.completeness)
        assert (kind.extra_layers is None) == (kind.extra_weights is None), kind.name
        assert {"hf", "torchtitan"} <= set(kind.tp_rules), kind.name


@pytest.mark.parametrize("kind, family", [(kind, family) for kind in sorted(models.kinds()) for family in models.FAMILIES
                                          if any(row.name(family) for row in models.kinds()[kind].rows)])
def test_kind_detected_from_its_names(kind, family):
    """Without a config, a checkpoint's names tell its kind: the smallest table that names them all (in the
    families that have the kind: Qwen2-MoE and GLM-4.5 have HF names only); a kind that is another's
    architecture (Kimi-K2) is told as that one."""
    names = []
    for row in models.kinds()[kind].rows:
        name = row.name(family)
        if name and not row.mtp and not name.endswith(("inv_freq", "freqs_cis")):
            names.append(name.replace("{L}", "1").replace("{E}", "0"))
    assert families.kind_of(names, families.get(family), None) == (models.kinds()[kind].architecture_of or kind)


def test_answers_for_every_kind():
    moe = {"model_type": "qwen3_moe", "num_attention_heads": 8, "num_key_value_heads": 2, "num_experts": 6}
    assert models.parallel_divisors({"text_config": moe}) == [
        ("tp", "num_attention_heads", 8, "attention heads"), ("tp", "num_key_value_heads", 2, "key/value heads"),
        ("ep", "num_experts", 6, "experts")]
    # A model without a kind module: every kind's fields (torchtitan's names too).
    assert models.parallel_divisors({"model_type": "mixtral", "n_heads": 4, "num_local_experts": 8}) == [
        ("tp", "n_heads", 4, "attention heads"), ("ep", "num_local_experts", 8, "experts")]
    assert models.tied_outputs({"model_type": "llama", "tie_word_embeddings": True}) == ["lm_head.weight"]
    assert models.tied_outputs({"model_type": "gpt2", "tie_word_embeddings": True}, "hf") == ["lm_head.weight"]
    assert models.tied_outputs({"model_type": "qwen3", "tie_word_embeddings": False}) == []
    assert models.tied_outputs({"text_config": {"tie_word_embeddings": True}}, "archon") == ["output.weight"]
    assert models.fsdp_units()[0] == r"layers\.\d+"
    assert models.expert_of("model.layers.3.mlp.experts.17.up_proj.weight") == ("model.layers.3.mlp.experts", 17,
                                                                               "up_proj.weight")
    assert models.grouped_experts("layers.1.moe.experts.w1", (4, 32, 64))
    assert not models.grouped_experts("layers.1.moe.shared_experts.w1.weight", (32, 64))


def test_tie_flags_say_tied_untied_or_nothing():
    assert models.tie_flags(None) == {} and models.tie_flags({"model_type": "llama"}) == {}
    assert models.tie_flags({"model_type": "qwen3", "tie_word_embeddings": False}) == {"tie_word_embeddings": False}
    nested = {"text_config": {"tie_word_embeddings": True}, "tie_word_embeddings": False}  # the language model's wins
    assert models.tie_flags(nested) == {"tie_word_embeddings": True}
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "transformer.wte.weight"]
    assert models.embedding_pairs(names) == [("model.embed_tokens.weight", "lm_head.weight"),
                                             ("transformer.wte.weight", "lm_head.weight")]
