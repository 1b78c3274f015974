"""Llama 3: torchtitan interleaves the rows of q and k for its complex-number RoPE; HF keeps rotate-half order."""

from dcptool.models import common
from dcptool.models.kind import ModelKind


def hf_weights(config: dict, fused: bool) -> dict:
    """Llama's weights: biases on q, k, v and o when ``attention_bias``, on the MLP when ``mlp_bias``."""
    bias = bool(config.get("attention_bias"))
    return common.decoder_weights(config, lambda layer: {
        **common.attention_weights(config, qkv_bias=bias, o_bias=bias, qk_norms=False),
        **common.dense_layer_mlp(config, bias=bool(config.get("mlp_bias")))})


KIND = ModelKind(
    name="llama",
    rows=tuple(common.dense_decoder_rows(rope=True)),
    hf_weights=hf_weights,
    tp_rules=common.DENSE_TP,
    ties=(common.TIED_EMBEDDINGS,),
    divisors=common.HEAD_DIVISORS,
    fsdp_units=common.DECODER_LAYERS,
    megatron=common.megatron_decoder(),
    args_config={"architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False},
)
