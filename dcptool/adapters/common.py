"""Rows every Llama-shaped model shares: embeddings, norms, attention, dense MLP, and the buffers nobody keeps.

Columns: Hugging Face, AReaL Archon (= torchtitan before 0.3), torchtitan 0.3. ``{L}`` is a layer.
"""

from dcptool.adapters.table import Row

EMBEDDINGS = Row("model.embed_tokens.weight", "tok_embeddings.weight", "tok_embeddings.weight")
FINAL_NORM = Row("model.norm.weight", "norm.weight", "norm.weight")
LM_HEAD = Row("lm_head.weight", "output.weight", "lm_head.weight", tied_to=EMBEDDINGS)

LAYER_NORMS = [
    Row("model.layers.{L}.input_layernorm.weight", "layers.{L}.attention_norm.weight", "layers.{L}.attention_norm.weight"),
    Row("model.layers.{L}.post_attention_layernorm.weight", "layers.{L}.ffn_norm.weight", "layers.{L}.ffn_norm.weight"),
]


def attention(rope: bool, biases: bool = False, qk_norms: bool = False) -> list[Row]:
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


def dense_mlp(hf_prefix: str = "mlp", titan_prefix: str = "feed_forward") -> list[Row]:
    """gate / up / down projections as w1 / w3 / w2."""
    return [Row(f"model.layers.{{L}}.{hf_prefix}.{hf}_proj.weight", f"layers.{{L}}.{titan_prefix}.{w}.weight",
                f"layers.{{L}}.{titan_prefix}.{w}.weight") for hf, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))]


def routed_experts() -> list[Row]:
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
RECOMPUTED = [
    Row("model.layers.{L}.self_attn.rotary_emb.inv_freq", None, None),
    Row("model.rotary_emb.inv_freq", None, None),
    Row(None, "freqs_cis", "freqs_cis"),
]


def llama_like(rope: bool = False, biases: bool = False, qk_norms: bool = False) -> list[Row]:
    """The rows of a dense decoder: everything but the MLP of MoE layers."""
    return [EMBEDDINGS, FINAL_NORM, LM_HEAD, *LAYER_NORMS, *attention(rope, biases, qk_norms), *dense_mlp(),
            *RECOMPUTED]
