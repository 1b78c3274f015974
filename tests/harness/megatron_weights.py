"""A tiny transformers model as a Megatron-Core GPTModel: its config and its weights by Megatron's names.

Written for the tests from Megatron-Core's own modules (megatron-core 0.19: ``attention.py`` groups
q, k and v per query group in ``linear_qkv``; ``mlp.py``'s SwiGLU ``linear_fc1`` is [gate; up]; the
local layer spec keeps ``input_layernorm`` / ``pre_mlp_layernorm`` apart in the module's state dict;
``SequentialMLP`` holds ``local_experts.{e}``), with plain torch ops. It never imports dcptool, so the
tests can hold dcptool's Megatron tables against it.

``gpt_model(hf_config, ...)`` builds the GPTModel (megatron-core must be installed, with its model
parallel state initialised); ``megatron_weights(hf_state, hf_config, vocab_rows)`` gives the weights
of that model's ``state_dict()`` (one process, TP = 1) from an HF state dict.
"""

from __future__ import annotations

from typing import Any

import torch

# Megatron-LM's default make_vocab_size_divisible_by: the vocabulary is padded to a multiple of it x TP.
VOCAB_MULTIPLE = 128


def padded_vocab(vocab: int, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def _experts(config: dict) -> int | None:
    return config.get("num_experts") or config.get("num_local_experts")


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def rope_theta(config: dict) -> float:
    """transformers 5 keeps it in rope_parameters, 4 at the top level."""
    return (config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta") or 10000.0


# TransformerConfig's settings of a deterministic float32 run on CPU: no dropout, none of the CUDA fusions.
CPU_RUN = dict(use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
               masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
# A MoE layer of DeepSeek-V3's routing as Megatron has it (GLM-4.5's too): a sigmoid router with a score bias, no
# auxiliary loss, experts one by one, tokens gathered.
SIGMOID_MOE = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                   moe_token_dispatcher_type="allgather")


def transformer_config(config: dict, **parallel) -> Any:
    """Megatron's TransformerConfig of an HF config (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE); ``parallel``:
    tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size."""
    from megatron.core.transformer import TransformerConfig

    kind = config["model_type"]
    fields = dict(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], num_query_groups=config["num_key_value_heads"],
        kv_channels=_head_dim(config), ffn_hidden_size=config["intermediate_size"],
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and config.get("qkv_bias", True)),
        qk_layernorm=kind in ("qwen3", "qwen3_moe"), **CPU_RUN, **parallel)
    if _experts(config):
        fields.update(num_moe_experts=_experts(config), moe_router_topk=config["num_experts_per_tok"],
                      moe_ffn_hidden_size=config["moe_intermediate_size"], moe_grouped_gemm=False,
                      moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                      moe_token_dispatcher_type="allgather",
                      # HF: softmax over every expert, top-k, renormalised (norm_topk_prob) = Megatron's
                      # softmax over the top-k logits.
                      moe_router_pre_softmax=not config.get("norm_topk_prob", False))
    if config.get("shared_expert_intermediate_size"):  # Qwen2-MoE: one shared expert, scaled by a sigmoid gate
        fields.update(moe_shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return TransformerConfig(**fields)


def gpt_model(config: dict, vocab_rows: int, **parallel) -> Any:
    """The GPTModel (local layer spec, RoPE of the config's base) of an HF config, its vocabulary ``vocab_rows``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    transformer = transformer_config(config, **parallel)
    spec = get_gpt_layer_local_spec(num_experts=_experts(config), moe_grouped_gemm=False,
                                    qk_layernorm=transformer.qk_layernorm, normalization="RMSNorm")
    return GPTModel(transformer, spec, vocab_size=vocab_rows, max_sequence_length=config["max_position_embeddings"],
                    share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
                    position_embedding_type="rope", rotary_base=int(rope_theta(config)))


def vocab_padded(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """An embedding or output weight with zero rows up to ``rows``, as Megatron pads its vocabulary."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int, dim: int) -> torch.Tensor:
    """attention.py's linear_qkv rows: per query group, its q heads, then its k and v head."""
    rest = q.shape[1:]
    q = q.reshape(groups, heads // groups * dim, *rest)
    return torch.cat([q, k.reshape(groups, dim, *rest), v.reshape(groups, dim, *rest)], 1).reshape(-1, *rest)


def swiglu_rows(hf: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """mlp.py's linear_fc1 of the HF MLP at ``prefix``: [gate; up]."""
    return torch.cat([hf[prefix + "gate_proj.weight"], hf[prefix + "up_proj.weight"]])


def routed_and_shared(hf: dict[str, torch.Tensor], mlp: str, dst: str, experts: int) -> dict[str, torch.Tensor]:
    """A MoE layer's router (with its score bias), routed experts stacked [E, ...] and shared experts, as
    Megatron's MoE layer holds them (``dst`` + name), from HF's DeepSeek-style names under ``mlp``."""
    return {dst + "mlp.router.weight": hf[mlp + "gate.weight"],
            dst + "mlp.router.expert_bias": hf[mlp + "gate.e_score_correction_bias"],
            dst + "mlp.experts.experts.linear_fc1.weight": torch.stack(
                [swiglu_rows(hf, f"{mlp}experts.{e}.") for e in range(experts)]),
            dst + "mlp.experts.experts.linear_fc2.weight": torch.stack(
                [hf[f"{mlp}experts.{e}.down_proj.weight"] for e in range(experts)]),
            dst + "mlp.shared_experts.linear_fc1.weight": swiglu_rows(hf, mlp + "shared_experts."),
            dst + "mlp.shared_experts.linear_fc2.weight": hf[mlp + "shared_experts.down_proj.weight"]}


def megatron_weights(hf: dict[str, torch.Tensor], config: dict, vocab_rows: int) -> dict[str, torch.Tensor]:
    """The GPTModel's ``state_dict()`` weights (local spec, TP = 1) from an HF state dict; the vocabulary
    rows past ``vocab_size`` are zero."""
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], _head_dim(config)
    out: dict[str, torch.Tensor] = {}

    def pad(weight: torch.Tensor) -> torch.Tensor:
        return vocab_padded(weight, vocab_rows)

    def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return qkv_rows(q, k, v, heads, groups, dim)

    out["embedding.word_embeddings.weight"] = pad(hf["model.embed_tokens.weight"])
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not config.get("tie_word_embeddings"):
        out["output_layer.weight"] = pad(hf["lm_head.weight"])
    for layer in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = grouped(*(hf[f"{attn}{p}_proj.weight"] for p in "qkv"))
        if attn + "q_proj.bias" in hf:
            out[dst + "self_attention.linear_qkv.bias"] = grouped(*(hf[f"{attn}{p}_proj.bias"] for p in "qkv"))
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        if attn + "q_norm.weight" in hf:
            out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        mlp = src + "mlp."
        if mlp + "gate.weight" in hf:
            out[dst + "mlp.router.weight"] = hf[mlp + "gate.weight"]
            for expert in range(_experts(config)):
                one = f"{mlp}experts.{expert}."
                local = f"{dst}mlp.experts.local_experts.{expert}."
                out[local + "linear_fc1.weight"] = torch.cat([hf[one + "gate_proj.weight"], hf[one + "up_proj.weight"]])
                out[local + "linear_fc2.weight"] = hf[one + "down_proj.weight"]
            shared = mlp + "shared_expert."
            if shared + "gate_proj.weight" in hf:  # shared_experts.py's SharedExpertMLP and its gate_weight [1, hidden]
                out[dst + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([hf[shared + "gate_proj.weight"],
                                                                               hf[shared + "up_proj.weight"]])
                out[dst + "mlp.shared_experts.linear_fc2.weight"] = hf[shared + "down_proj.weight"]
                out[dst + "mlp.shared_experts.gate_weight"] = hf[mlp + "shared_expert_gate.weight"]
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
            out[dst + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
    return out


def causal_mask(tokens: int) -> torch.Tensor:
    """Megatron's attention mask: True where a position may not attend."""
    return torch.triu(torch.ones(1, 1, tokens, tokens, dtype=torch.bool), diagonal=1)


def logits(model, input_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The GPTModel's logits of the real vocabulary (its padding columns cut). Its attention forks the CUDA
    RNG tracker (for dropout, 0 here), which a CPU process has none of: the fork is made a no-op."""
    import contextlib

    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        return model(input_ids, positions, causal_mask(input_ids.shape[1]))[..., :vocab]


# The local spec's sharded_state_dict_keys_map (gpt_layer_specs.py): the norms saved under the fused names.
_SAVED_AS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def checkpoint_keys(weights: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The global tensors a torch_dist checkpoint of the GPTModel holds (``megatron_weights``' keys as
    ``TransformerBlock.sharded_state_dict`` saves them): every layer's tensor stacked on a new dim 0
    (``decoder.layers.X`` [L, ...]), SequentialMLP's experts stacked too (``mlp.experts.experts.X`` [L, E, ...])."""
    layers = config["num_hidden_layers"]
    out = {k: v for k, v in weights.items() if not k.startswith("decoder.layers.")}
    names = sorted({k.split(".", 3)[3] for k in weights if k.startswith("decoder.layers.")})
    for name in names:
        if ".local_experts." in name:
            if not name.startswith("mlp.experts.local_experts.0."):
                continue
            rest = name.removeprefix("mlp.experts.local_experts.0.")
            experts = _experts(config)
            out[f"decoder.layers.mlp.experts.experts.{rest}"] = torch.stack([torch.stack(
                [weights[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{rest}"] for e in range(experts)])
                for i in range(layers)])
            continue
        out["decoder.layers." + _SAVED_AS.get(name, name)] = torch.stack(
            [weights[f"decoder.layers.{i}.{name}"] for i in range(layers)])
    return out
