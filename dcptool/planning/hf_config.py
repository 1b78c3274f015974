"""Does a Hugging Face ``config.json`` fit the tensors of an export? Checked before export-hf writes anything.

For the model kinds dcptool knows (``dcptool.models``) the config gives every weight's name and
shape, as transformers builds the model (hidden_size, num_hidden_layers, heads, kv heads, head_dim,
intermediate_size, vocab_size, experts, DeepSeek's latent attention ranks): a weight of another shape
is refused, the first misfit named (which weights are missing or too many is
``dcptool.planning.completeness``'s to say). For other kinds the config must at least name its
``model_type`` (what the Auto classes of transformers dispatch on). No torch: the shapes are worked
out from the config alone, by the kind.

>>> config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8,
...           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16, "vocab_size": 10}
>>> misfit(config, {"model.embed_tokens.weight": (10, 4)})
'model.embed_tokens.weight: the config gives shape [10, 8], the tensors [10, 4]'
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcptool import dtypes, models
from dcptool.errors import UsageError, option
from dcptool.storage import CheckpointFiles

if TYPE_CHECKING:
    from dcptool.engine.core import OutTensor

Shape = tuple[int, ...]
# Buffers some saves keep and transformers recomputes: allowed, never required.
RECOMPUTED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def export_config(config_dir: str | Path | None, tensors: list[OutTensor], dtype: str | None,
                  made: dict | None = None) -> dict | None:
    """The config.json an export of ``tensors`` writes (``config_dir``'s, else ``made``: one made from what
    the checkpoint says of its training run, ``Family.config_from_run``), checked against them, its ``dtype`` and ``torch_dtype`` set to ``dtype`` (or the
    tensors' floating-point dtype); None without either.

    A config that does not fit is a usage error naming the config file and the first misfit.
    """
    if config_dir is None and made is None:
        return None
    from dcptool.selection import read_config

    config = read_config(config_dir) if config_dir is not None else made
    problem = misfit(config, {t.key: t.shape for t in tensors})
    if problem and config_dir is None:
        raise UsageError(f"the config.json made from what the checkpoint says of its run does not fit the tensors: "
                         f"{problem}; give the model's config folder with {option('config_dir')}")
    if problem:
        raise UsageError(f"{CheckpointFiles(config_dir).path('config.json')} does not fit the tensors: {problem}")
    floating = [t.dtype for t in tensors if t.dtype in dtypes.CASTABLE]
    written = dtype or max(set(floating), key=floating.count, default=None)
    return config | {"dtype": written, "torch_dtype": written} if written else config


def without_stale_quantization(config: dict | None, tensors: list[OutTensor]) -> tuple[dict | None, list[str]]:
    """``config`` without a ``quantization_config`` that no tensor of the export is quantized by (every one is a
    float: a dequantized release, or a model trained from one, exported in bf16), and a note saying so; with it
    when a tensor still is (float8 codes, integers packing codes such as MXFP4's blocks). Left in, transformers
    would look for the quantized tensors, or quantize the weights again."""
    quantization = (config or {}).get("quantization_config")
    if quantization is None or any(t.dtype not in (*dtypes.CASTABLE, "float64") for t in tensors):
        return config, []
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    note = (f"left out the config's quantization_config ({method or 'no quant_method'}): "
            "no tensor of the export is quantized")
    return {k: v for k, v in config.items() if k != "quantization_config"}, [note]


def misfit(config: dict[str, Any], shapes: dict[str, Shape]) -> str | None:
    """The first way ``shapes`` (name -> shape) do not fit ``config``, as a phrase; None when they fit."""
    if not isinstance(config, dict):
        return "not a JSON object"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return "no model_type (transformers cannot tell which model it describes)"
    kind = models.kind_of(config)
    if kind is None:
        return None
    fused = any(".experts.gate_up_proj" in n for n in shapes)
    try:
        required, optional = expected_weights(config, kind, fused)
        extra, copies = models.extra_weights(config, fused)
        shapes_given = {**optional, **copies, **extra, **required}
    except (KeyError, TypeError) as exc:
        return f"{kind.name} config without a usable {exc}"
    for name, shape in shapes.items():
        expected = shapes_given.get(name)
        if expected is not None and tuple(shape) != expected:
            return f"{name}: the config gives shape {list(expected)}, the tensors {list(shape)}"
    return None


def expected_weights(config: dict[str, Any], kind: models.ModelKind,
                     fused: bool = False) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The weights a model of ``config`` has: (required, optional) dicts of name -> shape; the output weights
    the config ties to an embedding are optional (HF saves none of them).

    ``fused``: MoE experts in transformers v5's fused tensors (``experts.gate_up_proj``) instead of one per expert.
    """
    weights = kind.hf_weights(config, fused)
    tied = {tie.output.hf for tie in models.active_ties(config, kind)}
    required = {name: shape for name, shape in weights.items() if name not in tied}
    return required, {name: weights[name] for name in tied if name in weights}
