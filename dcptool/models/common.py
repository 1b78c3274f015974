"""What Llama-shaped model kinds share: their rows, the HF weights of their parts, their TP rules, ties and units.

Row columns: Hugging Face, AReaL Archon (= torchtitan before 0.3), torchtitan 0.3. ``{L}`` is a layer.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable

from dcptool.models.kind import (
    Divisor,
    MegatronMTP,
    MegatronName,
    ModelKind,
    PlanRule,
    Row,
    Shape,
    Tie,
)

# ---------------------------------------------------------------------------------------------
# Rows: each parameter under every family's name

EMBEDDINGS = Row("model.embed_tokens.weight", "tok_embeddings.weight", "tok_embeddings.weight")
FINAL_NORM = Row("model.norm.weight", "norm.weight", "norm.weight")
LM_HEAD = Row("lm_head.weight", "output.weight", "lm_head.weight")

LAYER_NORMS = (
    Row("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight", "layers.{L}.attention_norm.weight"),
    Row("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight", "layers.{L}.ffn_norm.weight"),
)


def attention_rows(rope: bool, biases: bool = False, qk_norms: bool = False) -> list[Row]:
    """q, k, v, o projections; ``rope``: torchtitan keeps q and k rows RoPE-interleaved (Llama 3 only)."""
    rows = []
    for hf, titan, heads in (("q", "wq", "num_attention_heads"), ("k", "wk", "num_key_value_heads"), ("v", "wv", None)):
        permute = heads if rope else None
        rows.append(Row(f"model.layers.{{L}}.self_attn.{hf}_proj.weight", f"layers.{{L}}.attention.{titan}.weight",
                        f"layers.{{L}}.attention.qkv_linear.{titan}.weight", rope_heads=permute))
        if biases:
            rows.append(Row(f"model.layers.{{L}}.self_attn.{hf}_proj.bias", f"layers.{{L}}.attention.{titan}.bias",
                            f"layers.{{L}}.attention.qkv_linear.{titan}.bias", rope_heads=permute))
    rows.append(Row("model.layers.{L}.self_attn.o_proj.weight", "layers.{L}.attention.wo.weight",
                    "layers.{L}.attention.wo.weight"))
    if qk_norms:
        rows += [Row(f"model.layers.{{L}}.self_attn.{n}_norm.weight", f"layers.{{L}}.attention.{n}_norm.weight",
                     f"layers.{{L}}.attention.{n}_norm.weight") for n in ("q", "k")]
    return rows


def dense_mlp_rows(hf_prefix: str = "mlp", titan_prefix: str = "feed_forward") -> list[Row]:
    """gate / up / down projections as w1 / w3 / w2."""
    return [Row(f"model.layers.{{L}}.{hf_prefix}.{hf}_proj.weight", f"layers.{{L}}.{titan_prefix}.{w}.weight",
                f"layers.{{L}}.{titan_prefix}.{w}.weight") for hf, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]


def routed_expert_rows() -> list[Row]:
    """Per-expert HF weights <-> grouped [E, out, in] tensors; transformers v5's fused layout as the alternative HF form."""
    fused_gate_up = "model.layers.{L}.mlp.experts.gate_up_proj"
    return [
        Row("model.layers.{L}.mlp.experts.{E}.gate_proj.weight", "layers.{L}.moe.experts.w1",
            "layers.{L}.moe.routed_experts.inner_experts.w1_EFD", experts=True, fused=(fused_gate_up, 0)),
        Row("model.layers.{L}.mlp.experts.{E}.up_proj.weight", "layers.{L}.moe.experts.w3",
            "layers.{L}.moe.routed_experts.inner_experts.w3_EFD", experts=True, fused=(fused_gate_up, 1)),
        Row("model.layers.{L}.mlp.experts.{E}.down_proj.weight", "layers.{L}.moe.experts.w2",
            "layers.{L}.moe.routed_experts.inner_experts.w2_EDF", experts=True,
            fused=("model.layers.{L}.mlp.experts.down_proj", 0)),
        Row("model.layers.{L}.mlp.gate.weight", "layers.{L}.moe.router.gate.weight", "layers.{L}.moe.router.gate.weight"),
    ]


# Recomputed from the config by every engine: dropped with a note, never converted.
RECOMPUTED = (
    Row("model.layers.{L}.self_attn.rotary_emb.inv_freq", None, None),
    Row("model.rotary_emb.inv_freq", None, None),
    Row(None, "freqs_cis", "freqs_cis"),
)


def released_mtp_weights(config: dict, count_field: str, layer_weights: Callable[[int], dict[str, Shape]]
                         ) -> tuple[dict[str, Shape], dict[str, Shape]]:
    """The weights of the ``config[count_field]`` prediction layers after the main ones, as DeepSeek-V3's release
    holds them (``model.layers.61`` of the 671B model; GLM-4.5's the same): a decoder layer (its norms and
    ``layer_weights(layer)``), the norms of the embedding and of the hidden state, their projection and a final norm
    (required); and copies of the embedding and the head (optional: the main ones serve, and torchtitan's and
    Megatron-Core's prediction layers share them)."""
    hidden, vocab, main = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    required, copies = {}, {}
    for layer in range(main, main + int(config.get(count_field) or 0)):
        own = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
               **layer_weights(layer), "enorm.weight": (hidden,), "hnorm.weight": (hidden,),
               "eh_proj.weight": (hidden, 2 * hidden), "shared_head.norm.weight": (hidden,)}
        required.update((f"model.layers.{layer}.{name}", shape) for name, shape in own.items())
        copies.update({f"model.layers.{layer}.embed_tokens.weight": (vocab, hidden),
                       f"model.layers.{layer}.shared_head.head.weight": (vocab, hidden)})
    return required, copies


def released_mtp_rows(layer: list[Row]) -> list[Row]:
    """A multi-token-prediction layer as DeepSeek-V3's release holds it (GLM-4.5's the same), numbered after the
    main layers (``model.layers.{num_hidden_layers + n}``): a decoder layer of ``layer``'s rows, norms of the
    embedding and the hidden state and their projection, the norm before the head, and copies of the embedding
    and head (the main ones serve: left out of other families). torchtitan 0.3 names them ``mtp_layers.{L}``
    where it names the decoder layer; Archon names none."""
    own = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "mtp_norm"))
    return [
        *[replace(row, archon=None, torchtitan=row.torchtitan and "mtp_" + row.torchtitan, mtp=True) for row in layer],
        *[Row(f"model.layers.{{L}}.{hf}.weight", None, f"mtp_layers.{{L}}.{titan}.weight", mtp=True)
          for hf, titan in own],
        Row("model.layers.{L}.embed_tokens.weight", None, None, mtp=True),
        Row("model.layers.{L}.shared_head.head.weight", None, None, mtp=True),
    ]


def dense_decoder_rows(rope: bool = False, biases: bool = False, qk_norms: bool = False) -> list[Row]:
    """The rows of a dense decoder: everything but the MLP of MoE layers."""
    return [EMBEDDINGS, FINAL_NORM, LM_HEAD, *LAYER_NORMS, *attention_rows(rope, biases, qk_norms), *dense_mlp_rows(),
            *RECOMPUTED]


# ---------------------------------------------------------------------------------------------
# The weights transformers builds from a config (HF names, shapes), part by part

def decoder_weights(config: dict, layer_weights: Callable[[int], dict[str, Shape]]) -> dict[str, Shape]:
    """Embeddings, final norm, output weight and every layer's norms plus ``layer_weights(layer)``, in that order."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    weights: dict[str, Shape] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
                                 "lm_head.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        inner = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                 **layer_weights(layer)}
        weights.update((f"model.layers.{layer}.{name}", shape) for name, shape in inner.items())
    return weights


def attention_weights(config: dict, qkv_bias: bool, o_bias: bool, qk_norms: bool) -> dict[str, Shape]:
    """q, k, v, o of grouped-query attention, with the biases and per-head q/k norms a kind has."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    outputs = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    weights = {f"self_attn.{p}_proj.weight": (n, hidden) for p, n in outputs.items()}
    weights["self_attn.o_proj.weight"] = (hidden, heads * head_dim)
    if qkv_bias:
        weights.update({f"self_attn.{p}_proj.bias": (n,) for p, n in outputs.items()})
    if o_bias:
        weights["self_attn.o_proj.bias"] = (hidden,)
    if qk_norms:
        weights.update({f"self_attn.{p}_norm.weight": (head_dim,) for p in ("q", "k")})
    return weights


def dense_mlp_weights(prefix: str, hidden: int, inner: int, bias: bool) -> dict[str, Shape]:
    """gate, up and down projections under ``prefix`` (``mlp``, ``mlp.experts.3``, ``mlp.shared_experts``)."""
    weights = {f"{prefix}.gate_proj.weight": (inner, hidden), f"{prefix}.up_proj.weight": (inner, hidden),
               f"{prefix}.down_proj.weight": (hidden, inner)}
    if bias:
        weights.update({f"{prefix}.gate_proj.bias": (inner,), f"{prefix}.up_proj.bias": (inner,),
                        f"{prefix}.down_proj.bias": (hidden,)})
    return weights


def dense_layer_mlp(config: dict, bias: bool = False) -> dict[str, Shape]:
    """The MLP of a dense layer of ``intermediate_size``."""
    return dense_mlp_weights("mlp", config["hidden_size"], config["intermediate_size"], bias)


def routed_experts_weights(config: dict, experts: int, fused: bool) -> dict[str, Shape]:
    """A router and ``experts`` experts of ``moe_intermediate_size``, one tensor per expert or fused (transformers v5)."""
    hidden, inner = config["hidden_size"], config["moe_intermediate_size"]
    weights: dict[str, Shape] = {"mlp.gate.weight": (experts, hidden)}
    if fused:
        weights.update({"mlp.experts.gate_up_proj": (experts, 2 * inner, hidden),
                        "mlp.experts.down_proj": (experts, hidden, inner)})
    else:
        for expert in range(experts):
            weights.update(dense_mlp_weights(f"mlp.experts.{expert}", hidden, inner, False))
    return weights


def required_experts(kind: ModelKind, config: dict) -> int:
    """The routed expert count; a config without it raises KeyError naming the kind's own field."""
    count = kind.expert_count(config)
    if count is None:
        raise KeyError(kind.expert_fields[0])
    return count


# ---------------------------------------------------------------------------------------------
# Tensor-parallel rules, by built-in plan: HF names as transformers' TP plans split them, torchtitan's
# (and Archon's) as torchtitan's parallelize functions do. Each pattern names disjoint tensors.

# The built-in plans of these rules, in the order ``--plan auto`` prefers them among equals: name -> description.
TP_PLANS = {
    "hf": "Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen2-MoE / Mixtral names (transformers' TP plans)",
    "torchtitan": "torchtitan names before and after 0.3, also AReaL's Archon engine (wq wk wv wo w1 w2 w3, "
                  "grouped experts)",
}

COLWISE, ROWWISE = {"tp": "colwise"}, {"tp": "rowwise"}

DENSE_TP: dict[str, tuple[PlanRule, ...]] = {
    "hf": (
        (r"embed_tokens\.weight$", COLWISE),  # RowwiseParallel on an embedding splits the vocabulary
        (r"lm_head\.weight$", COLWISE),
        (r"self_attn\.[qkv]_proj\.(weight|bias)$", COLWISE),
        (r"self_attn\.o_proj\.weight$", ROWWISE),
        (r"(gate|up)_proj\.weight$", COLWISE),  # dense MLP, per-expert and shared experts
        (r"down_proj\.weight$", ROWWISE),
    ),
    "torchtitan": (
        (r"tok_embeddings\.weight$", COLWISE),
        (r"(^|\.)(output|lm_head)\.weight$", COLWISE),
        (r"attention\.(qkv_linear\.)?w[qkv]\.(weight|bias)$", COLWISE),
        (r"attention\.wo\.weight$", ROWWISE),
        (r"(feed_forward|shared_experts?)\.w[13]\.weight$", COLWISE),
        (r"(feed_forward|shared_experts?)\.w2\.weight$", ROWWISE),
    ),
}

ROUTED_EXPERTS_TP: dict[str, tuple[PlanRule, ...]] = {
    "hf": (
        (r"experts\.gate_up_proj$", {"tp": "colwise", "experts": True}),  # transformers v5 fused experts
        (r"experts\.down_proj$", {"tp": "rowwise", "experts": True}),
    ),
    "torchtitan": (
        (r"moe\.(experts\.w[13]|routed_experts\.inner_experts\.w[13]_EFD)$", {"tp": "colwise", "experts": True}),
        (r"moe\.(experts\.w2|routed_experts\.inner_experts\.w2_EDF)$", {"tp": "rowwise", "experts": True}),
        (r"moe\.(expert_bias|tokens_per_expert)(_E)?$", {"fsdp": None}),  # buffers: FSDP2 leaves them whole
    ),
}


def tp_rules(*parts: dict[str, tuple[PlanRule, ...]]) -> dict[str, tuple[PlanRule, ...]]:
    """The rules of ``parts`` (like ``DENSE_TP``) joined plan by plan."""
    plans = dict.fromkeys(plan for part in parts for plan in part)
    return {plan: tuple(rule for part in parts for rule in part.get(plan, ())) for plan in plans}


# ---------------------------------------------------------------------------------------------
# Ties, mesh divisors, FSDP units

TIED_EMBEDDINGS = Tie(LM_HEAD, EMBEDDINGS)

# HF and torchtitan names of the head counts.
HEAD_DIVISORS = (
    Divisor("tp", ("num_attention_heads", "n_heads"), "attention heads"),
    Divisor("tp", ("num_key_value_heads", "n_kv_heads"), "key/value heads"),
)

# Attention projections a TP split must cut between whole heads, in every family's names: (pattern,
# what counts the heads, as HEAD_DIVISORS names it, and the dim that holds them).
HEAD_SPLITS = (
    (re.compile(r"(self_attn\.q_proj|attention\.(qkv_linear\.)?wq)\.(weight|bias)$"), "attention heads", 0),
    (re.compile(r"(self_attn\.[kv]_proj|attention\.(qkv_linear\.)?w[kv])\.(weight|bias)$"), "key/value heads", 0),
    (re.compile(r"(self_attn\.o_proj|attention\.wo)\.weight$"), "attention heads", 1),
)
# A per-head norm of the keys (Qwen3's k_norm, [head_dim]): the tensors then give the head counts.
HEAD_NORM = re.compile(r"(self_attn|attention)\.k_norm\.weight$")

# verl wraps each decoder layer in an FSDP unit of its own (transformer_auto_wrap_policy over the
# model's decoder-layer class): model.layers.N.
DECODER_LAYERS = (r"layers\.\d+",)


def moe_kind_fields(expert_fields: tuple[str, ...]) -> dict:
    """The ``ModelKind`` fields every MoE kind shares: the dense TP rules plus the routed experts', tied
    embeddings allowed, routed experts counted under ``expert_fields`` (which ep must divide, as tp the heads),
    FSDP per decoder layer."""
    return {"tp_rules": tp_rules(DENSE_TP, ROUTED_EXPERTS_TP), "ties": (TIED_EMBEDDINGS,),
            "expert_fields": expert_fields, "divisors": (*HEAD_DIVISORS, Divisor("ep", expert_fields, "experts")),
            "fsdp_units": DECODER_LAYERS}


# ---------------------------------------------------------------------------------------------
# Megatron-Core's names (megatron-core 0.19: gpt_layer_specs.py, attention.py, mlp.py, moe/). The layer
# norms are saved under the next linear layer's name (``layer_norm_weight``): Transformer Engine's spec fuses
# them into that layer (TELayerNormColumnParallelLinear), and the local spec keeps them apart but saves them
# under those names (its ``sharded_state_dict_keys_map``), so that both specs load each other's checkpoints.
# Apart from that: a MoE layer of the TE spec has no linear_fc1 to fuse into and keeps its ``pre_mlp_layernorm``,
# which the local spec still saves as ``mlp.linear_fc1.layer_norm_weight``. Where two Megatron names hold one HF
# tensor, what dcptool writes is the first that the layer spec asked for saves (``MegatronName.saved_by``).

# Outside the decoder layers: Megatron name -> HF name. Megatron pads the embedding's and the output's
# rows to a multiple of make_vocab_size_divisible_by x TP.
MEGATRON_OUTSIDE = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                    "decoder.final_layernorm.weight": "model.norm.weight",
                    "output_layer.weight": "lm_head.weight"}
MEGATRON_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")
MEGATRON_LAYERS = "decoder.layers."


def megatron_attention(biases: bool = False, qk_norms: bool = False) -> list[MegatronName]:
    """Grouped-query attention: q, k and v in one ``linear_qkv``, the input norm fused into it."""
    qkv = ("q", "k", "v")
    names = [MegatronName("self_attention.linear_qkv.layer_norm_weight", ("input_layernorm.weight",)),
             # the local spec's module name, as its plain state dict (Megatron-LM's legacy files) holds it
             MegatronName("input_layernorm.weight", ("input_layernorm.weight",), saved_by=()),
             MegatronName("self_attention.linear_qkv.weight", tuple(f"self_attn.{p}_proj.weight" for p in qkv), "qkv"),
             MegatronName("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",))]
    if biases:
        names.append(MegatronName("self_attention.linear_qkv.bias", tuple(f"self_attn.{p}_proj.bias" for p in qkv),
                                  "qkv"))
    if qk_norms:
        names += [MegatronName(f"self_attention.{p}_layernorm.weight", (f"self_attn.{p}_norm.weight",)) for p in "qk"]
    return names


def megatron_mlp_norm() -> list[MegatronName]:
    """The norm before the MLP: fused into a dense ``linear_fc1``; a MoE layer of the TE spec keeps it apart
    (the local spec names it as fused there too)."""
    return [MegatronName("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",),
                         saved_by=("local", "te:dense")),
            MegatronName("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), saved_by=("te:moe",))]


def megatron_dense_mlp(megatron: str = "mlp", hf: str = "mlp") -> list[MegatronName]:
    """A SwiGLU MLP: gate and up stacked in ``linear_fc1``, down in ``linear_fc2``."""
    return [MegatronName(f"{megatron}.linear_fc1.weight", (f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"), "halves"),
            MegatronName(f"{megatron}.linear_fc2.weight", (f"{hf}.down_proj.weight",))]


def megatron_routed_experts(expert_bias: str | None) -> list[MegatronName]:
    """The router and routed experts ``[E, ...]`` (SequentialMLP and grouped GEMM save them alike);
    ``expert_bias``: the HF name of the router's load-balancing bias (None: HF has no place for it)."""
    experts = "mlp.experts.{E}"
    return [MegatronName("mlp.router.weight", ("mlp.gate.weight",)),
            MegatronName("mlp.router.expert_bias", (expert_bias,) if expert_bias else ()),
            MegatronName("mlp.experts.experts.linear_fc1.weight",
                         (f"{experts}.gate_proj.weight", f"{experts}.up_proj.weight"), "expert_halves"),
            MegatronName("mlp.experts.experts.linear_fc2.weight", (f"{experts}.down_proj.weight",), "experts")]


def megatron_decoder(biases: bool = False, qk_norms: bool = False) -> tuple[MegatronName, ...]:
    """A dense Llama-shaped decoder layer in Megatron's names."""
    return (*megatron_attention(biases, qk_norms), *megatron_mlp_norm(), *megatron_dense_mlp())


# Megatron-Core's multi-token prediction (multi_token_prediction.py): mtp.layers.{n}.transformer_layer.X (the
# decoder layer, named as the kind's table names it) and these of its own; it feeds [enorm(embedding);
# hnorm(hidden)] to eh_proj, as DeepSeek-V3's and GLM-4.5's released MTP layers do. HF's layer repeats the
# embedding and the head, which Megatron's prediction layers share with the main model.
MEGATRON_RELEASED_MTP = MegatronMTP(
    own=tuple(MegatronName(f"{megatron}.weight", (f"{hf}.weight",)) for megatron, hf in (
        ("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_layernorm", "shared_head.norm"))),
    shared=(("embed_tokens.weight", ("model.embed_tokens.weight",)),
            ("shared_head.head.weight", ("lm_head.weight", "model.embed_tokens.weight"))),
)


# ---------------------------------------------------------------------------------------------
# Models with no kind module (no naming table, no expected weights): what dcptool still knows of them

OTHER_TP: dict[str, tuple[PlanRule, ...]] = {"hf": (
    (r"experts\.\d+\.w[13]\.weight$", COLWISE),  # Mixtral's per-expert names
    (r"experts\.\d+\.w2\.weight$", ROWWISE),
)}
OTHER_FSDP_UNITS = (
    r"h\.\d+",  # GPT-2, BLOOM, Falcon: transformer.h.N
    r"blocks\.\d+",  # vision towers: visual.blocks.N
    r"layer\.\d+",  # BERT-style encoders: encoder.layer.N
)
# The tie of a causal LM's head to its input embedding, as transformers makes it by default.
OTHER_TIES = (TIED_EMBEDDINGS,)
# Input embeddings and output weights by name in any model (GPT-2's wte, Llama's embed_tokens, torchtitan's
# tok_embeddings, BERT's word_embeddings; lm_head, output, GPT-NeoX's embed_out): where a tie could be.
INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|tok_embeddings|word_embeddings)\.weight$")
OUTPUT_EMBEDDING = re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")
# The weights of a decoder layer's linear layers (HF names), what block-scaled FP8 releases (DeepSeek-V3, Qwen3-FP8)
# quantize: 2-D weights of model.layers.N, and transformers v5's fused experts [E, out, in]; but not the router
# (Qwen's and DeepSeek's mlp.gate, GPT-OSS's mlp.router) nor the embedding and head a DeepSeek prediction layer repeats.
DECODER_WEIGHT = re.compile(r"^model\.layers\.\d+\.(.+\.weight|mlp\.experts\.(gate_up_proj|down_proj))$")
NOT_LINEAR = re.compile(r"\.mlp\.(gate|router)\.weight$|\.(embed_tokens|shared_head\.head)\.weight$")
# Routed experts of any MoE: a grouped [E, ...] tensor (a name part "expert(s)") or one per expert.
GROUPED_EXPERTS = re.compile(r"(^|[._])experts?([._]|$)")
PER_EXPERT = re.compile(r"^(.*?\bexperts)\.(\d+)\.(.+)$")  # model.layers.3.mlp.experts.17.up_proj.weight

# The parts of any model a tensor belongs to, by its HF name (saved or as transformers v5 names it): what
# an export that lacks a tensor lacks, and what ``--allow-missing`` accepts. (part, what it is called,
# pattern), the first match wins; the prediction layers (``mtp``) are also told by their layer number
# (``part_of``), and whatever matches nothing else is ``other``.
PARTS = (
    ("vision", "vision tower",
     re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder|multi_modal_projector|mm_projector)\.")),
    ("audio", "audio tower", re.compile(r"(^|\.)(audio_tower|audio_model|audio_encoder)\.")),
    ("mtp", "MTP layers", re.compile(r"(^|\.)mtp")),
    ("lm_head", "lm_head", OUTPUT_EMBEDDING),
    ("embeddings", "embeddings", INPUT_EMBEDDING),
    ("experts", "experts", GROUPED_EXPERTS),
    ("norms", "norms", re.compile(r"norm[^.]*\.(weight|bias)$")),
    ("layers", "decoder layers", re.compile(r"(^|\.)layers\.\d+\.")),
    ("other", "other tensors", re.compile("")),
)
# A decoder layer's number in HF names, in a language model alone or inside a multimodal one.
DECODER_LAYER = re.compile(r"^(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")
