"""Does a Hugging Face ``config.json`` fit the tensors of an export? Checked before export-hf writes anything.

For the model kinds the adapters know (``dcptool.adapters``: llama, qwen2, qwen3, qwen3_moe,
deepseek_v3) the config gives every weight's name and shape, as transformers builds the model
(hidden_size, num_hidden_layers, heads, kv heads, head_dim, intermediate_size, vocab_size,
experts, DeepSeek's latent attention ranks): a weight missing, one too many, or one of another
shape is refused, the first misfit named. For other kinds the config must at least name its
``model_type`` (what the Auto classes of transformers dispatch on). No torch: the shapes are worked out from the config alone.

>>> config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
...           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 10}
>>> misfit(config, {"model.embed_tokens.weight": (10, 4)})
'model.embed_tokens.weight: the config gives shape [10, 8], the tensors [10, 4]'
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcptool import dtypes
from dcptool.adapters import EXPERT_COUNT_FIELDS
from dcptool.errors import UsageError
from dcptool.storage import CheckpointFiles

if TYPE_CHECKING:
    from dcptool.core import OutTensor

Shape = tuple[int, ...]
KNOWN = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
# Buffers some saves keep and transformers recomputes: allowed, never required.
RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def export_config(config_dir: str | Path | None, tensors: list[OutTensor], dtype: str | None) -> dict | None:
    """The config.json an export of ``tensors`` writes, checked against them, its ``dtype`` and ``torch_dtype``
    set to ``dtype`` (or the tensors' floating-point dtype); None without ``config_dir``.

    A config that does not fit is a usage error naming the config file and the first misfit.
    """
    if config_dir is None:
        return None
    from dcptool.selection import read_config

    config = read_config(config_dir)
    problem = misfit(config, {t.key: t.shape for t in tensors})
    if problem:
        raise UsageError(f"{CheckpointFiles(config_dir).path('config.json')} does not fit the tensors: {problem}")
    floating = [t.dtype for t in tensors if t.dtype in dtypes.CASTABLE]
    written = dtype or max(set(floating), key=floating.count, default=None)
    return config | {"dtype": written, "torch_dtype": written} if written else config


def misfit(config: dict[str, Any], shapes: dict[str, Shape]) -> str | None:
    """The first way ``shapes`` (name -> shape) do not fit ``config``, as a phrase; None when they fit."""
    if not isinstance(config, dict):
        return "not a JSON object"
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind:
        return "no model_type (transformers cannot tell which model it describes)"
    if kind not in KNOWN:
        return None
    try:
        required, optional = expected_weights(config, fused=any(".experts.gate_up_proj" in name for name in shapes))
    except (KeyError, TypeError) as exc:
        return f"{kind} config without a usable {exc}"
    extra_layers = int(config.get("num_nextn_predict_layers") or 0) if kind == "deepseek_v3" else 0
    layers = int(config["num_hidden_layers"])
    for name, shape in shapes.items():
        expected = required.get(name, optional.get(name))
        if expected is None:
            layer = _LAYER.match(name)
            if RECOMPUTED.search(name) or (layer and layers <= int(layer.group(1)) < layers + extra_layers):
                continue  # a recomputed buffer, or a DeepSeek prediction layer (transformers ignores them)
            return f"{name} {list(shape)}: no such weight in a {kind} model with this config"
        if tuple(shape) != expected:
            return f"{name}: the config gives shape {list(expected)}, the tensors {list(shape)}"
    missing = [name for name in required if name not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"{missing[0]} {list(required[missing[0]])}: the config needs it, the tensors lack it{more}"
    return None


def expected_weights(config: dict[str, Any], fused: bool = False) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The weights a model of ``config`` has: (required, optional) dicts of name -> shape.

    ``fused``: MoE experts in transformers v5's fused tensors (``experts.gate_up_proj``) instead of one per expert.
    """
    kind = config["model_type"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    required: dict[str, Shape] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    optional: dict[str, Shape] = {}
    (optional if config.get("tie_word_embeddings", False) else required)["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights: dict[str, Shape] = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
        weights.update((_latent_attention if kind == "deepseek_v3" else _attention)(config))
        weights.update(_mlp(config, layer, fused))
        required.update({prefix + name: shape for name, shape in weights.items()})
    return required, optional


def _attention(config: dict) -> dict[str, Shape]:
    """q, k, v, o of Llama, Qwen2 and Qwen3 (biases and q/k norms as each kind has them)."""
    kind, hidden, heads = config["model_type"], config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    outputs = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    weights = {f"self_attn.{p}_proj.weight": (n, hidden) for p, n in outputs.items()}
    weights["self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    if kind == "qwen2" or config.get("attention_bias"):
        weights.update({f"self_attn.{p}_proj.bias": (n,) for p, n in outputs.items()})
    if kind != "qwen2" and config.get("attention_bias"):
        weights["self_attn.o_proj.bias"] = (hidden,)
    if kind in ("qwen3", "qwen3_moe"):
        weights.update({f"self_attn.{p}_norm.weight": (head_dim,) for p in ("q", "k")})
    return weights


def _latent_attention(config: dict) -> dict[str, Shape]:
    """DeepSeek-V3's multi-head latent attention (q through a low rank when ``q_lora_rank`` is set)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope, nope, v_dim = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
    bias = bool(config.get("attention_bias"))
    weights: dict[str, Shape] = {}
    if q_rank is None:
        weights["self_attn.q_proj.weight"] = (heads * (nope + rope), hidden)
    else:
        weights.update({"self_attn.q_a_proj.weight": (q_rank, hidden), "self_attn.q_a_layernorm.weight": (q_rank,),
                        "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank)})
        if bias:
            weights["self_attn.q_a_proj.bias"] = (q_rank,)
    weights.update({"self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
                    "self_attn.kv_a_layernorm.weight": (kv_rank,),
                    "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_rank),
                    "self_attn.o_proj.weight": (hidden, heads * v_dim)})
    if bias:
        weights.update({"self_attn.kv_a_proj_with_mqa.bias": (kv_rank + rope,), "self_attn.o_proj.bias": (hidden,)})
    return weights


def _mlp(config: dict, layer: int, fused: bool) -> dict[str, Shape]:
    """The MLP of one layer: dense (gate, up, down), or a router and routed experts (and DeepSeek's shared ones)."""
    kind, hidden = config["model_type"], config["hidden_size"]
    if not _sparse(config, layer):
        return _dense_mlp("mlp", hidden, config["intermediate_size"], bool(config.get("mlp_bias")))
    experts = _expert_count(config)
    inner = config["moe_intermediate_size"]
    weights: dict[str, Shape] = {"mlp.gate.weight": (experts, hidden)}
    if fused:
        weights.update({"mlp.experts.gate_up_proj": (experts, 2 * inner, hidden),
                        "mlp.experts.down_proj": (experts, hidden, inner)})
    else:
        for expert in range(experts):
            weights.update(_dense_mlp(f"mlp.experts.{expert}", hidden, inner, False))
    if kind == "deepseek_v3":
        weights["mlp.gate.e_score_correction_bias"] = (experts,)
        weights.update(_dense_mlp("mlp.shared_experts", hidden, inner * config["n_shared_experts"], False))
    return weights


def _sparse(config: dict, layer: int) -> bool:
    """Whether a layer's MLP is routed experts, as transformers decides it."""
    kind = config["model_type"]
    if kind == "qwen3_moe":
        return (layer not in (config.get("mlp_only_layers") or []) and _expert_count(config) > 0
                and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)
    if kind == "deepseek_v3":
        return layer >= config.get("first_k_dense_replace", 0)
    return False


def _expert_count(config: dict) -> int:
    """Routed experts, under whichever name the config uses (transformers v5 writes num_local_experts)."""
    for field in EXPERT_COUNT_FIELDS:
        if field in config:
            return config[field]
    raise KeyError(EXPERT_COUNT_FIELDS[0])


def _dense_mlp(prefix: str, hidden: int, inner: int, bias: bool) -> dict[str, Shape]:
    weights = {f"{prefix}.gate_proj.weight": (inner, hidden), f"{prefix}.up_proj.weight": (inner, hidden),
               f"{prefix}.down_proj.weight": (hidden, inner)}
    if bias:
        weights.update({f"{prefix}.gate_proj.bias": (inner,), f"{prefix}.up_proj.bias": (inner,),
                        f"{prefix}.down_proj.bias": (hidden,)})
    return weights
