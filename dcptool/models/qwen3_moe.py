"""Qwen3-MoE: Qwen3 attention, routed experts grouped as [E, out, in] by torchtitan and Archon, a router.

Archon and torchtitan keep a load-balancing ``expert_bias`` that Hugging Face's model has no place
for: it is dropped on export with a note.
"""

from dcptool.models import common
from dcptool.models.kind import ModelKind, Row

# transformers v5 writes num_local_experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts")


def hf_weights(config: dict, fused: bool) -> dict:
    """Qwen3's attention; routed experts in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    bias = bool(config.get("attention_bias"))
    dense, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)

    def layer_weights(layer: int) -> dict:
        attention = common.attention_weights(config, qkv_bias=bias, o_bias=bias, qk_norms=True)
        experts = 0 if layer in dense or (layer + 1) % step else common.required_experts(KIND, config)
        mlp = common.routed_experts_weights(config, experts, fused) if experts > 0 else common.dense_layer_mlp(config)
        return {**attention, **mlp}

    return common.decoder_weights(config, layer_weights)


KIND = ModelKind(
    name="qwen3_moe",
    rows=(*common.dense_decoder_rows(qk_norms=True), *common.routed_expert_rows(),
          Row(None, "layers.{L}.moe.expert_bias", "layers.{L}.moe.expert_bias_E")),
    hf_weights=hf_weights,
    **common.moe_kind_fields(EXPERT_FIELDS),
    megatron=(*common.megatron_decoder(qk_norms=True), *common.megatron_routed_experts(expert_bias=None)),
    args_config={"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": []},  # every layer routed (moe_layer_freq 1)
)
