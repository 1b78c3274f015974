"""Model kinds: one module of this package per kind (HF's ``model_type``) holds everything dcptool knows of it.

Each kind module defines ``KIND``, a ``ModelKind`` (``dcptool.models.kind``): its parameters under
every naming family (Hugging Face, AReaL Archon, torchtitan), the HF weights and shapes its config
implies, its tensor-parallel rules, tie rules, expert-count fields, the config counts tp and ep
must divide, and the layers FSDP wraps. ``kinds()`` finds them by listing the package, so a new
model kind is one new module; ``common`` holds the parts Llama-shaped kinds share and what dcptool
knows of models without a module. The functions below answer for every kind at once, so no other
module names one.

>>> kinds()["qwen3_moe"].expert_count({"num_experts": 128})
128
>>> parallel_divisors({"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8})
[('tp', 'num_attention_heads', 32, 'attention heads'), ('tp', 'num_key_value_heads', 8, 'key/value heads')]
>>> tied_outputs({"model_type": "qwen3", "tie_word_embeddings": True}, "archon")
['output.weight']
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from dcptool.models import common
from dcptool.models.kind import (
    FAMILIES,
    MEGATRON_SPECS,
    Divisor,
    MegatronName,
    ModelKind,
    PlanRule,
    Row,
    Shape,
    Tie,
)

__all__ = ["FAMILIES", "MEGATRON_SPECS", "MegatronName", "ModelKind", "Row", "Shape", "Tie", "kinds", "kind_of",
           "text_config", "parallel_divisors",
           "fsdp_units", "tp_rules", "head_split", "head_dim", "active_ties", "tied_outputs", "expert_of", "grouped_experts",
           "peft_trainable", "PARTS", "part_of", "decoder_layer", "extra_weights", "linear_weight"]

_HELPERS = {"common", "kind", "transformers_plans"}


@cache
def kinds() -> dict[str, ModelKind]:
    """Every model kind by its ``model_type``, found by listing this package."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _HELPERS:
            kind = importlib.import_module(f"{__name__}.{module.name}").KIND
            found[kind.name] = kind
    return found


def text_config(config: dict | None) -> dict:
    """The language model's config: multimodal configs nest it as ``text_config``."""
    config = config or {}
    return config.get("text_config", config)


def kind_of(config: dict | None) -> ModelKind | None:
    """The kind ``config``'s ``model_type`` names, None when no module of this package is that kind."""
    return kinds().get((config or {}).get("model_type"))


def parallel_divisors(config: dict | None) -> list[tuple[str, str, int, str]]:
    """The counts of ``config`` a mesh setting must divide: ``(setting, field, count, what)`` for each field set.

    The kind's own fields; for a model without a kind module, those of every kind.
    """
    config = text_config(config)
    kind = kind_of(config)
    divisors = kind.divisors if kind else _every_divisor()
    return [(d.setting, field, config[field], d.what) for d in divisors for field in d.fields
            if isinstance(config.get(field), int)]


@cache
def _every_divisor() -> tuple[Divisor, ...]:
    merged: dict[tuple[str, str], tuple[str, ...]] = {}
    for kind in kinds().values():
        for d in kind.divisors:
            merged[d.setting, d.what] = tuple(dict.fromkeys((*merged.get((d.setting, d.what), ()), *d.fields)))
    return tuple(Divisor(setting, fields, what) for (setting, what), fields in merged.items())


def head_split(name: str) -> tuple[str, int] | None:
    """What counts the heads of an attention projection a TP split must not cut (``"key/value heads"``, as
    ``parallel_divisors`` names it) and the dim that holds them; None for other tensors."""
    return next(((what, dim) for pattern, what, dim in common.HEAD_SPLITS if pattern.search(name)), None)


def head_dim(shapes: dict[str, Shape]) -> tuple[str, int] | None:
    """The head size that the tensors themselves give (a per-head key norm), with the tensor that gives it."""
    return next(((name, shape[0]) for name, shape in shapes.items()
                 if common.HEAD_NORM.search(name) and len(shape) == 1 and shape[0] > 0), None)


@cache
def fsdp_units() -> tuple[str, ...]:
    """Regular expressions for the layers FSDP wraps as units of their own (``layers\\.\\d+``), every kind's and others'.

    A parameter belongs to the unit of the outermost such layer its name passes through; the root unit holds the rest.
    """
    return tuple(dict.fromkeys([*(u for kind in kinds().values() for u in kind.fsdp_units), *common.OTHER_FSDP_UNITS]))


def tp_plans() -> dict[str, str]:
    """The built-in tensor-parallel plans whose rules the kinds declare: name -> description, ``hf`` first."""
    return dict(common.TP_PLANS)


def tp_rules(plan: str) -> list[PlanRule]:
    """The rules of built-in plan ``plan`` (``hf``, ``torchtitan``): every kind's, then those of models without a module."""
    rules: dict[tuple, PlanRule] = {}
    for part in [*(kind.tp_rules for kind in kinds().values()), common.OTHER_TP]:
        for pattern, options in part.get(plan, ()):
            rules.setdefault((pattern, tuple(sorted(options.items()))), (pattern, options))
    return list(rules.values())


def active_ties(config: dict | None, kind: ModelKind | None = None) -> list[Tie]:
    """The ties ``config`` sets: ``kind``'s (by default its ``model_type``'s), or a causal LM's head to its embedding.

    A flag is read from the language model's config, else from the outer one.
    """
    config = config or {}
    inner = text_config(config)
    kind = kind or kind_of(inner)
    ties = kind.ties if kind else common.OTHER_TIES
    return [tie for tie in ties if inner.get(tie.flag, config.get(tie.flag))]


def tie_flags(config: dict | None) -> dict[str, bool]:
    """The tie flags ``config`` sets, by name, with their values (``{"tie_word_embeddings": False}``): a flag set
    false says the weights are untied, where a missing one says nothing."""
    config = config or {}
    inner = text_config(config)
    kind = kind_of(inner)
    flags = {tie.flag for tie in (kind.ties if kind else common.OTHER_TIES)}
    found = {flag: inner.get(flag, config.get(flag)) for flag in sorted(flags)}
    return {flag: bool(value) for flag, value in found.items() if value is not None}


def embedding_pairs(names) -> list[tuple[str, str]]:
    """The (input embedding, output weight) pairs among ``names`` that a tie could join, in any model (``embed_tokens``,
    ``wte``, ``tok_embeddings`` ... and ``lm_head``, ``output``, ``embed_out``)."""
    inputs = [name for name in names if common.INPUT_EMBEDDING.search(name)]
    outputs = [name for name in names if common.OUTPUT_EMBEDDING.search(name)]
    return [(a, b) for a in inputs for b in outputs]


def is_input_embedding(name: str) -> bool:
    """Whether ``name`` is a model's input embedding (``embed_tokens``, ``wte``, ``tok_embeddings``, ``word_embeddings``)."""
    return bool(common.INPUT_EMBEDDING.search(name))


def tied_outputs(config: dict | None, family: str = "hf") -> list[str]:
    """The output weights ``config`` ties to an embedding, as ``family`` names them: an HF export leaves them out."""
    return [tie.output.name(family) for tie in active_ties(config) if tie.output.name(family)]


def expert_of(name: str) -> tuple[str, int, str] | None:
    """A per-expert parameter's layer prefix, expert number and rest (``model.layers.3.mlp.experts``, 17,
    ``up_proj.weight``); None for a name of no single expert."""
    match = common.PER_EXPERT.match(name)
    return (match[1], int(match[2]), match[3]) if match else None


def peft_trainable(name: str) -> bool:
    """Whether a peft (LoRA) model trains this parameter: its adapters' and ``modules_to_save``'s copies; peft
    freezes the rest, which an optimizer built over the trainable parameters never sees."""
    return ".lora_" in name or ".modules_to_save." in name


def linear_weight(name: str, shape: Shape) -> bool:
    """Whether an HF tensor is the weight of a decoder layer's linear layer: attention and MLP projections, routed and
    shared experts (one per expert, or transformers v5's fused ``[E, out, in]``), what block-scaled FP8 releases
    quantize; not routers, norms, biases, embeddings or heads.

    >>> linear_weight("model.layers.3.mlp.experts.7.down_proj.weight", (64, 32)), linear_weight("model.layers.3.mlp.gate.weight", (8, 64))
    (True, False)
    """
    match = common.DECODER_WEIGHT.match(name)
    if match is None or common.NOT_LINEAR.search(name):
        return False
    return len(shape) == (3 if match[2] else 2)


def grouped_experts(name: str, shape: Shape) -> bool:
    """Whether a model tensor holds routed experts grouped as ``[E, ...]`` (a name part ``expert(s)``, 3 dims or more)."""
    return len(shape) >= 3 and shape[0] > 1 and bool(common.GROUPED_EXPERTS.search(name))


PARTS: dict[str, str] = {part: what for part, what, _ in common.PARTS}
"""The parts of a model ``part_of`` tells (``vision``, ``mtp``, ``lm_head`` ...), each with what it is called."""


def part_of(name: str, config: dict | None) -> str:
    """The part of its model (a key of ``PARTS``) the tensor of HF name ``name`` belongs to: a layer numbered at or
    after ``config``'s main layers (``num_hidden_layers``) is a prediction layer (``mtp``).

    >>> part_of("visual.blocks.0.attn.qkv.weight", {}), part_of("model.layers.3.enorm.weight", {"num_hidden_layers": 3})
    ('vision', 'mtp')
    """
    found = [part for part, _, pattern in common.PARTS if pattern.search(name)]
    if found[0] in ("vision", "audio"):
        return found[0]
    layer = decoder_layer(name)
    main = text_config(config).get("num_hidden_layers")
    if layer is not None and isinstance(main, int) and layer >= main:
        return "mtp"
    return found[0]


def decoder_layer(name: str) -> int | None:
    """The number of the language model's decoder layer an HF name is in (``model.layers.3.*``,
    ``model.language_model.layers.3.*``); None outside its layers."""
    match = common.DECODER_LAYER.match(name)
    return int(match.group(1)) if match else None


def extra_weights(config: dict | None, fused: bool = False) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The weights (HF names, shapes) of the layers after the main ones that ``config``'s kind declares
    (``ModelKind.extra_weights``: DeepSeek's prediction layers) and that transformers does not build, as (required,
    optional); none for a kind without them, or a config that counts none."""
    inner = text_config(config)
    kind = kind_of(inner)
    return kind.extra_weights(inner, fused) if kind and kind.extra_weights else ({}, {})
