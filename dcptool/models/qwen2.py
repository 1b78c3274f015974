"""Qwen2 (AReaL Archon): Llama names plus q/k/v biases; its RoPE matches HF's, so nothing is permuted."""

from dcptool.models import common
from dcptool.models.kind import ModelKind


def hf_weights(config: dict, fused: bool) -> dict:
    """Qwen2's weights: q, k and v always have biases, o never."""
    return common.decoder_weights(config, lambda layer: {
        **common.attention_weights(config, qkv_bias=True, o_bias=False, qk_norms=False),
        **common.dense_layer_mlp(config)})


KIND = ModelKind(
    name="qwen2",
    rows=tuple(common.dense_decoder_rows(biases=True)),
    hf_weights=hf_weights,
    tp_rules=common.DENSE_TP,
    ties=(common.TIED_EMBEDDINGS,),
    divisors=common.HEAD_DIVISORS,
    fsdp_units=common.DECODER_LAYERS,
    megatron=common.megatron_decoder(biases=True),
    args_config={"architectures": ["Qwen2ForCausalLM"]},  # q/k/v biases always
)
