"""GLM-4.5 / GLM-4.6 MoE (``Glm4MoeForCausalLM``): grouped-query attention with q/k/v biases, RoPE on part of
each head (``partial_rotary_factor``, rotate-half order on both sides: nothing is permuted) and optional per-head
q/k norms (``use_qk_norm``); dense first layers (``first_k_dense_replace``), then routed experts chosen by a
sigmoid router with a score bias (``e_score_correction_bias``) beside shared experts; multi-token-prediction
layers laid out as DeepSeek-V3's (``model.layers.{num_hidden_layers + n}``, which transformers ignores).

Neither Archon nor torchtitan has a GLM model: its rows name HF tensors only, and a mapping to or from those
families is refused. Megatron-Core holds it as a GPT model with ``add_qkv_bias``, ``rotary_percent``,
``qk_layernorm``, a ``moe_layer_freq`` list, the sigmoid router with ``moe_router_enable_expert_bias``,
``moe_shared_expert_intermediate_size`` and ``mtp_num_layers`` (Megatron-Bridge's GLM-4.5 model): the same tensors
as a Qwen decoder's, the router's bias and the shared experts besides.
"""

from dataclasses import replace

from dcptool.models import common
from dcptool.models.kind import ArgsFields, ModelKind, Row

# transformers v5 reads n_routed_experts as num_local_experts.
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts")
EXPERT_BIAS = "mlp.gate.e_score_correction_bias"


def hf_weights(config: dict, fused: bool) -> dict:
    """q/k/v biases (``attention_bias``), q/k norms (``use_qk_norm``); routed experts with their score bias and
    ``n_shared_experts`` shared ones from layer ``first_k_dense_replace`` on."""
    return common.decoder_weights(config, lambda layer: layer_weights(config, layer, fused))


def layer_weights(config: dict, layer: int, fused: bool) -> dict:
    """A decoder layer's attention and MLP (its norms apart): dense below ``first_k_dense_replace``, MoE from it on."""
    attention = common.attention_weights(config, qkv_bias=bool(config.get("attention_bias")), o_bias=False,
                                         qk_norms=bool(config.get("use_qk_norm")))
    if layer < config.get("first_k_dense_replace", 1):
        return {**attention, **common.dense_layer_mlp(config)}
    experts = common.required_experts(KIND, config)
    shared = config["moe_intermediate_size"] * config.get("n_shared_experts", 1)
    return {**attention, **common.routed_experts_weights(config, experts, fused), EXPERT_BIAS: (experts,),
            **common.dense_mlp_weights("mlp.shared_experts", config["hidden_size"], shared, False)}


def prediction_weights(config: dict, fused: bool) -> tuple[dict, dict]:
    """The prediction layers' weights (``common.released_mtp_weights``): required, and the optional copies."""
    return common.released_mtp_weights(config, KIND.extra_layers, lambda layer: layer_weights(config, layer, fused))


LAYER = [*common.LAYER_NORMS, *common.attention_rows(rope=False, biases=True, qk_norms=True), *common.dense_mlp_rows(),
         *common.routed_expert_rows(), *common.dense_mlp_rows("mlp.shared_experts"),
         Row(f"model.layers.{{L}}.{EXPERT_BIAS}", None, None)]
HF_ROWS = [common.EMBEDDINGS, common.FINAL_NORM, common.LM_HEAD, *common.RECOMPUTED, *LAYER,
           *common.released_mtp_rows(LAYER)]

# Megatron-Core's GPT layers (local spec: the norms fused into linear_qkv and linear_fc1 by name; dense first layers
# make the layers non-uniform, saved per layer), the router's bias and the shared experts as Megatron-Bridge's
# GLM-4.5 bridge maps them; prediction layers as DeepSeek-V3's. Checked against megatron-core 0.19.2's own save
# (tests/test_megatron_glm.py).
MEGATRON = (*common.megatron_decoder(biases=True, qk_norms=True),
            *common.megatron_routed_experts(expert_bias=EXPERT_BIAS),
            *common.megatron_dense_mlp("mlp.shared_experts", "mlp.shared_experts"))

# TP rules, as transformers' plan of Glm4Moe: the dense and expert rules, and the router's score bias, a buffer,
# which FSDP2 leaves whole.
TP_RULES = common.tp_rules({"hf": ((r"mlp\.gate\.e_score_correction_bias$", {"fsdp": None}),)},
                           common.DENSE_TP, common.ROUTED_EXPERTS_TP)

KIND = ModelKind(
    name="glm4_moe",
    rows=tuple(replace(row, archon=None, torchtitan=None) for row in HF_ROWS if row.hf),
    hf_weights=hf_weights,
    **{**common.moe_kind_fields(EXPERT_FIELDS), "tp_rules": TP_RULES},
    extra_layers="num_nextn_predict_layers",
    extra_weights=prediction_weights,
    megatron=MEGATRON,
    megatron_mtp=common.MEGATRON_RELEASED_MTP,
    # Megatron-LM's args of a GLM-4.5 run (Megatron-Bridge's GLM-4.5 model): its routing in one group
    args_config={"architectures": ["Glm4MoeForCausalLM"], "n_group": 1, "topk_group": 1},
    args_fields=ArgsFields(qkv_bias="attention_bias", qk_norm="use_qk_norm", partial_rotary="partial_rotary_factor",
                           dense_layers="first_k_dense_replace", shared_experts="n_shared_experts",
                           routed_scaling="routed_scaling_factor", predictions="num_nextn_predict_layers",
                           sigmoid_router=True),
)
