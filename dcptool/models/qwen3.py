"""Qwen3 dense: Llama names plus per-head q/k RMSNorms; RoPE as HF's (no permutation)."""

from dcptool.models import common
from dcptool.models.kind import ModelKind


def hf_weights(config: dict, fused: bool) -> dict:
    """Qwen3's weights: q/k norms of ``head_dim``, biases on q, k, v and o when ``attention_bias``."""
    bias = bool(config.get("attention_bias"))
    return common.decoder_weights(config, lambda layer: {
        **common.attention_weights(config, qkv_bias=bias, o_bias=bias, qk_norms=True),
        **common.dense_layer_mlp(config)})


KIND = ModelKind(
    name="qwen3",
    rows=tuple(common.dense_decoder_rows(qk_norms=True)),
    hf_weights=hf_weights,
    tp_rules=common.DENSE_TP,
    ties=(common.TIED_EMBEDDINGS,),
    divisors=common.HEAD_DIVISORS,
    fsdp_units=common.DECODER_LAYERS,
    megatron=common.megatron_decoder(qk_norms=True),
    args_config={"architectures": ["Qwen3ForCausalLM"], "attention_bias": False},
)
