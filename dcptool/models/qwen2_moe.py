"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, routed experts and a shared expert
whose output a sigmoid gate ``[1, hidden]`` scales.

Neither Archon nor torchtitan has a Qwen2-MoE model: its rows name HF tensors only, and a mapping to or
from those families is refused. Megatron-Core holds it as a GPT model with ``add_qkv_bias``,
``moe_shared_expert_intermediate_size`` and ``moe_shared_expert_gate``.
"""

from dataclasses import replace

from dcptool.models import common
from dcptool.models.kind import MegatronName, ModelKind, Row

# transformers v5 writes num_local_experts.
EXPERT_FIELDS = ("num_experts", "num_local_experts")
SHARED_GATE = "mlp.shared_expert_gate.weight"


def hf_weights(config: dict, fused: bool) -> dict:
    """Routed experts, a shared expert and its gate in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    hidden = config["hidden_size"]
    dense, step = config.get("mlp_only_layers") or [], config.get("decoder_sparse_step", 1)

    def layer_weights(layer: int) -> dict:
        attention = common.attention_weights(config, qkv_bias=config.get("qkv_bias", True), o_bias=False,
                                             qk_norms=False)
        experts = 0 if layer in dense or (layer + 1) % step else common.required_experts(KIND, config)
        if experts == 0:
            return {**attention, **common.dense_layer_mlp(config)}
        return {**attention, **common.routed_experts_weights(config, experts, fused),
                **common.dense_mlp_weights("mlp.shared_expert", hidden, config["shared_expert_intermediate_size"],
                                           False),
                SHARED_GATE: (1, hidden)}

    return common.decoder_weights(config, layer_weights)


HF_ROWS = [*common.dense_decoder_rows(biases=True), *common.routed_expert_rows(),
           *common.dense_mlp_rows("mlp.shared_expert"), Row(f"model.layers.{{L}}.{SHARED_GATE}", None, None)]

# transformers' plan of Qwen2-MoE keeps the shared expert whole (Qwen3-Next's splits its own).
TP_RULES = common.tp_rules({"hf": ((r"mlp\.shared_expert\.(gate|up|down)_proj\.weight$", {}),)},
                           common.moe_kind_fields(EXPERT_FIELDS)["tp_rules"])

KIND = ModelKind(
    name="qwen2_moe",
    rows=tuple(replace(row, archon=None, torchtitan=None) for row in HF_ROWS if row.hf),
    hf_weights=hf_weights,
    **{**common.moe_kind_fields(EXPERT_FIELDS), "tp_rules": TP_RULES},
    # Megatron-Core's SharedExpertMLP (moe/shared_experts.py): gate and up in linear_fc1, and the gate
    # as the parameter gate_weight [1, hidden].
    megatron=(*common.megatron_decoder(biases=True), *common.megatron_routed_experts(expert_bias=None),
              *common.megatron_dense_mlp("mlp.shared_experts", "mlp.shared_expert"),
              MegatronName("mlp.shared_experts.gate_weight", (SHARED_GATE,))),
)
