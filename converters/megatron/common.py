"""Megatron-LM's common state (``args``, ``iteration``, ``checkpoint_version`` ...) read as data, and the facts of
the training run that ``inspect`` shows from it.

The state is unpickled by dcptool's restricted unpickler: ``argparse.Namespace`` and Megatron's enums (the
classes megatron-core's ``safe_globals.py`` lets torch load) become records, never Megatron's classes, so
nothing of Megatron is imported and a hostile pickle runs nothing. ``args`` is kept as plain values (an enum
as ``ModelType(1)``, a dtype by its name) for ``inspect --json`` and for the naming family's config.
"""

from __future__ import annotations

from typing import Any

from dcptool.errors import CheckpointError
from dcptool.safe_pickle import Record

# args fields -> the facts inspect shows of the run, in that order.
FACTS = {"tensor_model_parallel_size": "tensor_parallel", "pipeline_model_parallel_size": "pipeline_parallel",
         "expert_model_parallel_size": "expert_parallel",
         "virtual_pipeline_model_parallel_size": "virtual_pipeline", "num_layers": "layers"}


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-able data: records of enums as ``Name(value)``, dtypes by name; None for what is not
    data (other records, deeper than a few levels)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, str):  # a dtype or device the unpickler kept by its name
        return str(value)
    if depth > 4:
        return None
    if isinstance(value, (list, tuple)):
        return [plain(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {str(k): plain(v, depth + 1) for k, v in value.items() if isinstance(k, (str, int))}
    if isinstance(value, Record):
        name = type(value).qualname.rsplit(".", 1)[-1]
        if isinstance(getattr(value, "args", None), tuple) and len(value.args) == 1:  # an enum by its value
            return f"{name}({plain(value.args[0], depth + 1)})"
        if type(value).qualname in ("argparse.Namespace", "types.SimpleNamespace"):
            return {k: plain(v, depth + 1) for k, v in vars(value).items()}
    return None


def run_info(common: Any, where: str) -> dict[str, Any]:
    """What ``checkpoint.info`` shows of a Megatron-LM run from its common state: iteration, TP / PP / EP / VPP,
    layer count, a line on the model, and ``args`` as plain values."""
    if not isinstance(common, dict):
        raise CheckpointError(f"{where}: the common state is a {type(common).__name__}, not a dict")
    args = plain(common.get("args"))
    if common.get("args") is not None and not isinstance(args, dict):
        raise CheckpointError(f"{where}: args is not a Namespace")
    args = args or {}
    info: dict[str, Any] = {"iteration": common.get("iteration") if type(common.get("iteration")) is int else None}
    info.update({fact: args.get(field) for field, fact in FACTS.items()})
    info["model"] = describe(args) if args else None
    info["args"] = args or None
    return info


def describe(args: dict) -> str:
    """One line on the model the args describe: ``hidden 4096, 32 heads (8 query groups), 64 experts, ...``."""
    parts = []
    if args.get("hidden_size"):
        parts.append(f"hidden {args['hidden_size']}")
    if args.get("num_attention_heads"):
        groups = args.get("num_query_groups") if args.get("group_query_attention") else None
        parts.append(f"{args['num_attention_heads']} heads" + (f" ({groups} query groups)" if groups else ""))
    if args.get("multi_latent_attention"):
        parts.append("multi-latent attention")
    if args.get("num_experts"):
        parts.append(f"{args['num_experts']} experts" + (" (grouped GEMM)" if args.get("moe_grouped_gemm") else ""))
    for flag, words in (("qk_layernorm", "q/k layernorm"), ("add_qkv_bias", "qkv bias"),
                        ("swiglu", "SwiGLU")):
        if args.get(flag):
            parts.append(words)
    if args.get("untie_embeddings_and_output_weights") is False:
        parts.append("tied embeddings")
    if args.get("padded_vocab_size"):
        parts.append(f"vocabulary {args.get('vocab_size') or '?'} padded to {args['padded_vocab_size']}")
    return ", ".join(parts)
