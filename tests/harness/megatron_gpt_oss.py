"""A tiny transformers GPT-OSS as a Megatron-Core GPTModel: its config, its layer spec and its weights by the keys
Megatron's ``dist_checkpointing`` saves.

Written for the tests from megatron-core 0.19's own modules (and the settings Megatron-Bridge's GPT-OSS model
gives them), never importing dcptool, so the tests can hold dcptool's GPT-OSS table against it:

* Attention (``attention.py``): q, k and v in ``linear_qkv``, per query group its query heads' rows, then its
  key's, then its value's, biases likewise; ``linear_proj`` with a bias (``add_bias_linear``). The sinks are the
  learnable softmax offset of the local ``DotProductAttention`` (``softmax_type="learnable"``:
  ``core_attention.softmax_offset``, one logit per head that joins each row's softmax, as transformers' sinks).
  Sliding windows where the config's ``layer_types`` say (``window_size`` of ``sliding_window - 1`` tokens back,
  ``window_attn_skip_freq`` a list: 1 where the layer slides); YaRN RoPE (``position_embedding_type="yarn"`` and
  the config's ``yarn_*`` fields, as Megatron-Bridge sets them; ``truncate`` is
  ``yarn_correction_range_round_to_int``).
* Every layer a MoE (the local spec saves the norm before it as ``mlp.linear_fc1.layer_norm_weight``): the router
  with a bias (``add_bias_linear``), top-k of its logits then their softmax (``moe_router_pre_softmax=False``);
  experts ``[E, ...]`` (SequentialMLP): ``linear_fc1`` = per expert [gate; up] rows, ``W x`` (transformers'
  ``gate_up_proj`` ``[E, H, 2F]`` is ``x @ W`` with gate and up columns alternating), its bias likewise;
  ``linear_fc2`` ``[E, H, F]`` (transformers' ``down_proj`` ``[E, F, H]`` transposed) and its bias. The
  activation is ``quick_gelu`` (x sigmoid(1.702 x), transformers' ``swiglu_alpha``) of the gate clamped above at
  ``activation_func_clamp_value`` (``swiglu_limit``) times the up clamped both ways plus ``glu_linear_offset`` 1.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.megatron_weights import CPU_RUN, qkv_rows, rope_theta, vocab_padded


def transformer_config(config: dict, **parallel) -> Any:
    """Megatron's TransformerConfig of an HF GPT-OSS config; ``parallel``: tensor/pipeline/expert_model_parallel_size."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer import TransformerConfig

    assert config["swiglu_alpha"] == 1.702, "quick_gelu's slope"
    rope = config["rope_parameters"]
    transformer = TransformerConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_key_value_heads"],
        kv_channels=config["head_dim"], ffn_hidden_size=config["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True,
        activation_func=quick_gelu, activation_func_clamp_value=config["swiglu_limit"], glu_linear_offset=1.0,
        add_bias_linear=config["attention_bias"], add_qkv_bias=config["attention_bias"],
        softmax_type="learnable", window_size=(config["sliding_window"] - 1, 0),
        window_attn_skip_freq=[int(kind == "sliding_attention") for kind in config["layer_types"]],
        num_moe_experts=config["num_local_experts"], moe_ffn_hidden_size=config["intermediate_size"],
        moe_router_topk=config["num_experts_per_tok"], moe_router_pre_softmax=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", pipeline_dtype=torch.float32, bias_activation_fusion=False,
        **CPU_RUN, **parallel)
    # YaRN's settings are no fields of TransformerConfig (Megatron-Bridge's provider adds them): GPTModel reads them
    yarn = {"yarn_rotary_scaling_factor": rope["factor"],
            "yarn_original_max_position_embeddings": rope["original_max_position_embeddings"],
            "yarn_beta_fast": rope["beta_fast"], "yarn_beta_slow": rope["beta_slow"], "yarn_mscale": None,
            "yarn_mscale_all_dim": None, "yarn_correction_range_round_to_int": rope["truncate"]}
    for name, value in yarn.items():
        setattr(transformer, name, value)
    return transformer


def gpt_model(config: dict, vocab_rows: int, mtp_layers: int = 0, **parallel) -> Any:
    """The GPTModel of an HF GPT-OSS config (the local spec), its vocabulary ``vocab_rows``; megatron's
    model-parallel state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    assert not mtp_layers, "GPT-OSS has no prediction layers"
    transformer = transformer_config(config, **parallel)
    spec = get_gpt_layer_local_spec(num_experts=config["num_local_experts"], moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    return GPTModel(transformer, spec, vocab_size=vocab_rows, max_sequence_length=config["max_position_embeddings"],
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
                    position_embedding_type="yarn", rotary_base=int(rope_theta(config)))


def _layer(hf: dict[str, torch.Tensor], src: str, dst: str, config: dict) -> dict[str, torch.Tensor]:
    """One decoder layer's torch_dist tensors (``dst`` + name) from HF's (``src`` + name)."""
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attn, mlp = src + "self_attn.", src + "mlp."

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv_rows(q, k, v, heads, groups, dim)

    def gate_then_up(alternating: torch.Tensor) -> torch.Tensor:
        """[E, ..., 2F] with gate and up alternating on the last dim -> mlp.py's [E, gate; up, ...] rows."""
        rows = alternating.movedim(-1, 1)
        return torch.cat([rows[:, 0::2], rows[:, 1::2]], 1)

    out = {dst + "self_attention.linear_qkv.layer_norm_weight": hf[src + "input_layernorm.weight"],
           dst + "self_attention.linear_qkv.weight": grouped(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv")),
           dst + "self_attention.linear_qkv.bias": grouped(*(hf[f"{attn}{p}_proj.bias"] for p in "qkv")),
           dst + "self_attention.linear_proj.weight": hf[attn + "o_proj.weight"],
           dst + "self_attention.linear_proj.bias": hf[attn + "o_proj.bias"],
           dst + "self_attention.core_attention.softmax_offset": hf[attn + "sinks"],
           dst + "mlp.linear_fc1.layer_norm_weight": hf[src + "post_attention_layernorm.weight"],
           dst + "mlp.router.weight": hf[mlp + "router.weight"],
           dst + "mlp.router.bias": hf[mlp + "router.bias"],
           dst + "mlp.experts.experts.linear_fc1.weight": gate_then_up(hf[mlp + "experts.gate_up_proj"]),
           dst + "mlp.experts.experts.linear_fc1.bias": gate_then_up(hf[mlp + "experts.gate_up_proj_bias"]),
           dst + "mlp.experts.experts.linear_fc2.weight": hf[mlp + "experts.down_proj"].transpose(1, 2),
           dst + "mlp.experts.experts.linear_fc2.bias": hf[mlp + "experts.down_proj_bias"]}
    return {key: tensor.contiguous() for key, tensor in out.items()}


def checkpoint_weights(hf: dict[str, torch.Tensor], config: dict, vocab_rows: int) -> dict[str, torch.Tensor]:
    """Every global tensor a torch_dist save of the GPTModel holds, by its key, from an HF state dict (the
    vocabulary rows past ``vocab_size`` zero; the layers, all alike, stacked)."""
    layers = [_layer(hf, f"model.layers.{layer}.", "decoder.layers.", config)
              for layer in range(config["num_hidden_layers"])]
    out = {"embedding.word_embeddings.weight": vocab_padded(hf["model.embed_tokens.weight"], vocab_rows),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": vocab_padded(hf["lm_head.weight"], vocab_rows)}
    out.update({key: torch.stack([layer[key] for layer in layers]) for key in layers[0]})
    return out
