"""What a model kind declares: its parameters under every naming family, and the facts that follow from its config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# The naming families whose names are columns of the rows (``Row``). Megatron-Core names a layer's parameters as
# stacked [layers, ...] tensors and fuses q/k/v and gate/up: its names are no row of one tensor each, so its
# table is apart (``ModelKind.megatron``).
FAMILIES = ("hf", "archon", "torchtitan")
Shape = tuple[int, ...]
# A rule of a tensor-parallel plan as a plan file writes it: a regular expression on the parameter
# name and its placement (``dcptool.planning.plans`` turns these into its rules).
PlanRule = tuple[str, dict]


@dataclass(frozen=True, eq=False)
class Row:
    """One parameter in every family; ``None`` where a family has no such tensor (dropped with a note).

    ``{L}`` stands for the layer and, in HF names, ``{E}`` for the expert. ``experts``: the
    torchtitan-style names hold every expert in one grouped ``[E, out, in]`` tensor, HF one tensor
    per expert; ``fused``: transformers v5's fused HF tensor and this row's part of it (dim 1).
    ``rope_heads``: the config field with the head count of a weight whose rows torchtitan
    interleaves for its RoPE (Llama's q and k). ``mtp``: a multi-token-prediction layer, which
    torchtitan numbers apart (``mtp_layers.{L}``) and HF after the main layers
    (``model.layers.{num_hidden_layers + L}``).
    """

    hf: str | None
    archon: str | None
    torchtitan: str | None
    experts: bool = False
    fused: tuple[str, int] | None = None
    rope_heads: str | None = None
    mtp: bool = False

    def name(self, family: str) -> str | None:
        """This parameter's name in ``family`` (one of ``FAMILIES``), None where the family has no such tensor."""
        return getattr(self, family)


# Megatron-Core's layer specs (gpt_layer_specs.py) whose names dcptool writes: the local spec
# (``get_gpt_layer_local_spec``, Megatron-LM's ``--transformer-impl local``) and Transformer Engine's
# (``get_gpt_layer_with_transformer_engine_spec``, ``--transformer-impl transformer_engine``, its default). Each is
# built for a dense layer or a MoE layer (``num_experts``), and some names differ between the two.
MEGATRON_SPECS = ("local", "te")


@dataclass(frozen=True)
class MegatronName:
    """One Megatron-Core tensor of a decoder layer (``megatron``: its name after ``decoder.layers.`` or
    ``decoder.layers.{i}.``) and the HF tensors of that layer it holds (after ``model.layers.{i}.``).

    ``how`` it holds them: ``plain`` (the one tensor), ``qkv`` (q, k and v rows grouped per query group:
    ``[groups, (q_per_group + 2) x head_dim, ...]``), ``halves`` (gate and up stacked on dim 0, Megatron's
    SwiGLU ``linear_fc1``), ``experts`` (``[E, ...]``, one HF tensor per expert ``{E}``),
    ``expert_halves`` (``[E, gate; up, ...]``), and for HF tensors that hold every expert: ``transposed`` (HF's
    ``[E, b, a]`` is Megatron's ``[E, a, b]``) and ``interleaved`` (Megatron's gate and up halves of dim 1 are
    HF's last dim, gate and up alternating, gate first; a 3-D ``[E, gate; up, H]`` is HF's ``[E, H, 2F]``).
    ``saved_by``: the layer specs (``MEGATRON_SPECS``) that save the tensor under this name, in every layer
    (``"te"``) or in their dense or MoE layers only (``"te:dense"``, ``"te:moe"``); none: a name dcptool reads
    but does not write. Every name is read, whichever spec saved it.
    """

    megatron: str
    hf: tuple[str, ...]
    how: str = "plain"
    saved_by: tuple[str, ...] = MEGATRON_SPECS

    def saved(self, spec: str, moe: bool) -> bool:
        """Whether layer spec ``spec`` saves this name in a MoE layer (``moe``) or a dense one."""
        return spec in self.saved_by or f"{spec}:{'moe' if moe else 'dense'}" in self.saved_by


@dataclass(frozen=True)
class MegatronMTP:
    """Megatron-Core's multi-token-prediction layer ``mtp.layers.{n}``: a decoder layer
    (``transformer_layer.X``, named as in ``ModelKind.megatron``) plus its ``own`` tensors (``enorm.weight``
    ...), which HF numbers after the main layers (``model.layers.{L+n}``). ``shared``: (HF name in the layer,
    the main HF names it repeats, first found) of the copies HF's layer holds of tensors Megatron shares
    with the main model (the embedding and the output layer)."""

    own: tuple[MegatronName, ...]
    shared: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class ArgsFields:
    """The fields of a kind's HF config that Megatron-LM's ``args`` state beyond those of a SwiGLU decoder with
    RMSNorm, RoPE on whole heads and experts routed by softmax (``ModelKind.args_fields``): each the config field
    that is an args field, None where the kind has no such thing. ``qkv_bias``: ``add_qkv_bias``; ``qk_norm``:
    ``qk_layernorm``; ``partial_rotary``: ``rotary_percent``; ``dense_layers``: the dense first layers of
    ``moe_layer_freq`` ([0] x k + [1] x the rest); ``shared_experts``: ``moe_shared_expert_intermediate_size`` in
    experts of ``moe_intermediate_size`` (no gate); ``routed_scaling``: ``moe_router_topk_scaling_factor``;
    ``predictions``: ``mtp_num_layers``. ``sigmoid_router``: the router scores by sigmoid with an expert bias
    (``moe_router_score_function``, ``moe_router_enable_expert_bias``) and normalises its top k (HF's
    ``norm_topk_prob``), in one group."""

    qkv_bias: str | None = None
    qk_norm: str | None = None
    partial_rotary: str | None = None
    dense_layers: str | None = None
    shared_experts: str | None = None
    routed_scaling: str | None = None
    predictions: str | None = None
    sigmoid_router: bool = False


@dataclass(frozen=True)
class Tie:
    """An output weight that is the embedding when the config's ``flag`` is set (HF then saves no output weight)."""

    output: Row
    embedding: Row
    flag: str = "tie_word_embeddings"


@dataclass(frozen=True)
class Divisor:
    """A count in the config (under any of ``fields``) that a mesh setting (``tp``, ``ep``) must divide."""

    setting: str
    fields: tuple[str, ...]
    what: str


@dataclass(frozen=True)
class ModelKind:
    """Everything dcptool knows of one model kind (HF's ``model_type``); one module of ``dcptool.models`` each.

    ``rows``: its parameters under every family's name. ``hf_weights(config, fused)``: every weight
    (with its shape) transformers builds from ``config``, output weight included whether tied or not;
    ``fused``: MoE experts as transformers v5's fused tensors instead of one per expert.
    ``tp_rules``: rules by built-in plan (``hf``, ``torchtitan``) for its names. ``ties``: output
    weights the config may tie. ``expert_fields``: config fields counting routed experts, first the
    kind's own. ``divisors``: config counts tp / ep must divide. ``fsdp_units``: regular expressions
    for the layers FSDP wraps as units of their own (``model.layers.N``). ``extra_layers``: the
    config field counting layers after the main ones that transformers ignores (DeepSeek's
    prediction layers); ``extra_weights(config, fused)``: their weights (HF names, shapes), as the
    kind's released checkpoints hold them: (required, optional), an export holding the required ones too;
    optional, the copies of main weights it may repeat. ``megatron``: its decoder layers' tensors in Megatron-Core's names (none: no
    Megatron table); ``megatron_mtp``: its prediction layers' in Megatron-Core's (none: not mapped).
    ``args_config``: the fields of its HF config.json that Megatron-LM's ``args`` do not say (its class,
    biases it never has), for a kind whose whole model ``args`` describe (a SwiGLU decoder with RMSNorm and
    RoPE, experts routed by softmax, or more as ``args_fields`` say); None: args and config.json are not made from
    each other. ``args_fields``: the config fields args state beyond those (``ArgsFields``).
    ``architecture_of``: the kind whose architecture, and so every table, this one is, under a config of its own
    (Kimi-K2: DeepSeek-V3's); names alone tell that kind, and only a config names this one. ``mxfp4_experts``: its
    releases store the routed experts as MXFP4 blocks and scales (GPT-OSS), which ``export-hf --quantize mxfp4`` writes.
    """

    name: str
    rows: tuple[Row, ...]
    hf_weights: Callable[[dict, bool], dict[str, Shape]]
    tp_rules: dict[str, tuple[PlanRule, ...]]
    ties: tuple[Tie, ...] = ()
    expert_fields: tuple[str, ...] = ()
    divisors: tuple[Divisor, ...] = ()
    fsdp_units: tuple[str, ...] = ()
    extra_layers: str | None = None
    extra_weights: Callable[[dict, bool], tuple[dict[str, Shape], dict[str, Shape]]] | None = None
    megatron: tuple[MegatronName, ...] = ()
    megatron_mtp: MegatronMTP | None = None
    args_config: dict | None = None
    args_fields: ArgsFields = ArgsFields()
    architecture_of: str | None = None
    mxfp4_experts: bool = False

    def expert_count(self, config: dict) -> int | None:
        """Routed experts, under whichever of ``expert_fields`` the config uses; None for a dense kind or config."""
        return next((config[f] for f in self.expert_fields if isinstance(config.get(f), int)), None)
