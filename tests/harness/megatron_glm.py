"""A tiny transformers GLM-4.5 MoE as a Megatron-Core GPTModel: its config, its layer specs and its weights by the
keys Megatron's ``dist_checkpointing`` saves.

Written for the tests from megatron-core 0.19's own modules (and the settings Megatron-Bridge's GLM-4.5 model
gives them), never importing dcptool, so the tests can hold dcptool's GLM table against it:

* Attention (``attention.py``): q, k and v in ``linear_qkv``, per query group its query heads' rows, then its
  key's, then its value's, biases likewise (``add_qkv_bias``); per-head ``q_layernorm`` / ``k_layernorm``
  (HF's ``use_qk_norm``); heads of ``kv_channels`` (HF's ``head_dim``, not hidden / heads). RoPE on the first
  ``rotary_percent`` of each head in rotate-half order (``rope_utils``: the rest passes), as transformers'
  ``partial_rotary_factor``: no rows are permuted.
* The local layer spec saves the norms under the next linear layer's names (``sharded_state_dict_keys_map``:
  ``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), in MoE layers too.
* ``get_gpt_decoder_block_spec`` with ``moe_layer_freq`` [0] x ``first_k_dense_replace`` + [1] x the rest: the
  layers are not uniform, so ``TransformerBlock`` saves ``decoder.layers.{i}.X`` per layer.
* MoE: the sigmoid router with its expert bias (``mlp.router.weight``, ``mlp.router.expert_bias``: HF's
  ``gate.weight``, ``gate.e_score_correction_bias``), its top-k probabilities normalised (HF's ``norm_topk_prob``)
  and scaled by ``moe_router_topk_scaling_factor`` (``routed_scaling_factor``); experts ``[E, ...]``
  (``mlp.experts.experts.linear_fc1.weight`` = per expert [gate; up]); the shared experts
  (``mlp.shared_experts.linear_fc1`` = [gate; up], of ``moe_intermediate_size`` x ``n_shared_experts``), added
  to the routed ones without a gate.
* Multi-token prediction (``mtp_num_layers``): as DeepSeek-V3's (``harness.megatron_deepseek``): ``mtp.layers.{n}``'s
  ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` (HF's ``shared_head.norm``) and
  ``transformer_layer.X``, the last decoder layer's spec; GLM-4.5's release numbers it ``model.layers.{L+n}``.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.megatron_deepseek import MTP_OWN, moe_pattern
from harness.megatron_weights import (CPU_RUN, SIGMOID_MOE, qkv_rows, rope_theta, routed_and_shared, swiglu_rows,
                                     vocab_padded)


def partial_rotary(config: dict) -> float:
    """transformers 5 keeps it in rope_parameters, 4 at the top level (GLM's default: half of each head)."""
    return (config.get("rope_parameters") or {}).get("partial_rotary_factor") or config.get(
        "partial_rotary_factor", 0.5)


def transformer_config(config: dict, mtp_layers: int = 0, **parallel) -> Any:
    """Megatron's TransformerConfig of an HF GLM-4.5 config (n_group = topk_group = 1, normalised top-k);
    ``parallel``: tensor/pipeline/expert_model_parallel_size."""
    from megatron.core.transformer import TransformerConfig

    assert config.get("n_group", 1) == 1 and config.get("topk_group", 1) == 1, "group-limited routing"
    assert config.get("norm_topk_prob", True), "Megatron normalises a sigmoid router's top-k probabilities"
    return TransformerConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_key_value_heads"],
        kv_channels=config["head_dim"], ffn_hidden_size=config["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=config["attention_bias"],
        qk_layernorm=config["use_qk_norm"],
        num_moe_experts=config["n_routed_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=config["moe_intermediate_size"] * config["n_shared_experts"],
        moe_layer_freq=moe_pattern(config), moe_router_topk=config["num_experts_per_tok"],
        moe_router_topk_scaling_factor=config["routed_scaling_factor"], mtp_num_layers=mtp_layers or None,
        pipeline_dtype=torch.float32, **SIGMOID_MOE, **CPU_RUN, **parallel)


def gpt_model(config: dict, vocab_rows: int, mtp_layers: int = 0, **parallel) -> Any:
    """The GPTModel of an HF GLM-4.5 config (local specs: dense first layers, MoE after, prediction layers), its
    vocabulary ``vocab_rows``; megatron's model-parallel state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    transformer = transformer_config(config, mtp_layers, **parallel)
    block = get_gpt_decoder_block_spec(transformer, use_transformer_engine=False, normalization="RMSNorm")
    mtp = get_gpt_mtp_block_spec(transformer, block, use_transformer_engine=False) if mtp_layers else None
    return GPTModel(transformer, block, vocab_size=vocab_rows, max_sequence_length=config["max_position_embeddings"],
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
                    position_embedding_type="rope", rotary_percent=partial_rotary(config),
                    rotary_base=int(rope_theta(config)), mtp_block_spec=mtp)


def _layer(hf: dict[str, torch.Tensor], src: str, dst: str, config: dict) -> dict[str, torch.Tensor]:
    """One decoder layer's torch_dist tensors (``dst`` + name) from HF's (``src`` + name)."""
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attn, mlp = src + "self_attn.", src + "mlp."

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv_rows(q, k, v, heads, groups, dim)

    out = {dst + "self_attention.linear_qkv.layer_norm_weight": hf[src + "input_layernorm.weight"],
           dst + "self_attention.linear_qkv.weight": grouped(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv")),
           dst + "self_attention.linear_proj.weight": hf[attn + "o_proj.weight"],
           dst + "mlp.linear_fc1.layer_norm_weight": hf[src + "post_attention_layernorm.weight"]}
    if config["attention_bias"]:
        out[dst + "self_attention.linear_qkv.bias"] = grouped(*(hf[f"{attn}{p}_proj.bias"] for p in "qkv"))
    if config["use_qk_norm"]:
        out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
        out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
    if mlp + "gate.weight" not in hf:
        out[dst + "mlp.linear_fc1.weight"] = swiglu_rows(hf, mlp)
        out[dst + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
        return out
    return out | routed_and_shared(hf, mlp, dst, config["n_routed_experts"])


def checkpoint_weights(hf: dict[str, torch.Tensor], config: dict, vocab_rows: int,
                       mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """Every global tensor a torch_dist save of the GPTModel holds, by its key, from an HF state dict (the
    vocabulary rows past ``vocab_size`` zero)."""
    layers = config["num_hidden_layers"]
    out = {"embedding.word_embeddings.weight": vocab_padded(hf["model.embed_tokens.weight"], vocab_rows),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": vocab_padded(hf["lm_head.weight"], vocab_rows)}
    for layer in range(layers):
        out.update(_layer(hf, f"model.layers.{layer}.", f"decoder.layers.{layer}.", config))
    for n in range(mtp_layers):
        src, dst = f"model.layers.{layers + n}.", f"mtp.layers.{n}."
        out.update(_layer(hf, src, dst + "transformer_layer.", config))
        out.update({f"{dst}{megatron}.weight": hf[f"{src}{name}.weight"] for megatron, name in MTP_OWN.items()})
    return out
