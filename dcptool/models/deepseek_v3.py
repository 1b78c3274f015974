"""DeepSeek-V3: multi-head latent attention, dense first layers, routed and shared experts.

HF's ``e_score_correction_bias`` is torchtitan's ``expert_bias``. Its RoPE is interleaved on both
sides (HF's ``rope_interleave``), so nothing is permuted. The multi-token-prediction layers (HF's
layer 61 of the 671B model) are torchtitan 0.3's ``mtp_layers`` and Megatron-Core's ``mtp.layers``;
Archon names have none, and transformers ignores them.
"""

from dcptool.models import common
from dcptool.models.kind import MegatronName, ModelKind, Row

# transformers v5 reads n_routed_experts as num_local_experts.
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts")

# HF name in self_attn -> torchtitan name in attention (the same in Archon and torchtitan 0.3).
MLA = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
       "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}

LAYER = [
    *common.LAYER_NORMS,
    *[Row(f"model.layers.{{L}}.self_attn.{hf}.weight", f"layers.{{L}}.attention.{titan}.weight",
          f"layers.{{L}}.attention.{titan}.weight") for hf, titan in MLA.items()],
    *common.dense_mlp_rows(),
    *common.routed_expert_rows(),
    *common.dense_mlp_rows("mlp.shared_experts", "moe.shared_experts"),
    Row("model.layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.expert_bias",
        "layers.{L}.moe.expert_bias_E"),
]

# A prediction layer is a decoder layer, plus norms of the embedding and hidden state and their projection;
# HF also repeats the embedding and head there.
MTP = common.released_mtp_rows(LAYER)


# Megatron-Core's MLA (multi_latent_attention.py): the same projections, rows in HF's order (its RoPE
# takes the interleaved rope dims apart itself). The MLA specs have no sharded_state_dict_keys_map: the local
# spec saves its input_layernorm, q/kv norms and pre_mlp_layernorm apart; TE's keeps input_layernorm apart,
# fuses the q/kv norms into the up projections, and the norm before the MLP into a dense layer's linear_fc1
# (a MoE layer keeps pre_mlp_layernorm). Dense first layers make the layers non-uniform: Megatron saves them
# per layer. Checked against megatron-core 0.19.2's own save (tests/test_megatron_deepseek.py) and its specs
# (tests/test_megatron_te_spec.py).
MEGATRON = (
    MegatronName("input_layernorm.weight", ("input_layernorm.weight",)),
    *[MegatronName(f"self_attention.{megatron}", (f"self_attn.{hf}",), saved_by=specs) for megatron, hf, specs in (
        ("linear_q_proj.weight", "q_proj.weight", ("local", "te")),
        ("linear_q_down_proj.weight", "q_a_proj.weight", ("local", "te")),
        ("q_layernorm.weight", "q_a_layernorm.weight", ("local",)),
        ("linear_q_up_proj.layer_norm_weight", "q_a_layernorm.weight", ("te",)),
        ("linear_q_up_proj.weight", "q_b_proj.weight", ("local", "te")),
        ("linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight", ("local", "te")),
        ("kv_layernorm.weight", "kv_a_layernorm.weight", ("local",)),
        ("linear_kv_up_proj.layer_norm_weight", "kv_a_layernorm.weight", ("te",)),
        ("linear_kv_up_proj.weight", "kv_b_proj.weight", ("local", "te")),
        ("linear_proj.weight", "o_proj.weight", ("local", "te")))],
    MegatronName("pre_mlp_layernorm.weight", ("post_attention_layernorm.weight",), saved_by=("local", "te:moe")),
    MegatronName("mlp.linear_fc1.layer_norm_weight", ("post_attention_layernorm.weight",), saved_by=("te:dense",)),
    *common.megatron_dense_mlp(),
    *common.megatron_routed_experts(expert_bias="mlp.gate.e_score_correction_bias"),
    *common.megatron_dense_mlp("mlp.shared_experts", "mlp.shared_experts"),
)


# Megatron-Core's multi-token prediction layers: a decoder layer named as above, and its own tensors.
MEGATRON_MTP = common.MEGATRON_RELEASED_MTP


def hf_weights(config: dict, fused: bool) -> dict:
    """Latent attention; routed experts (with their score bias) and shared ones from layer ``first_k_dense_replace`` on."""
    return common.decoder_weights(config, lambda layer: layer_weights(config, layer, fused))


def layer_weights(config: dict, layer: int, fused: bool) -> dict:
    """A decoder layer's attention and MLP (its norms apart): dense below ``first_k_dense_replace``, MoE from it on."""
    if layer < config.get("first_k_dense_replace", 0):
        return {**latent_attention_weights(config), **common.dense_layer_mlp(config)}
    experts = common.required_experts(KIND, config)
    shared = config["moe_intermediate_size"] * config["n_shared_experts"]
    return {**latent_attention_weights(config), **common.routed_experts_weights(config, experts, fused),
            "mlp.gate.e_score_correction_bias": (experts,),
            **common.dense_mlp_weights("mlp.shared_experts", config["hidden_size"], shared, False)}


def prediction_weights(config: dict, fused: bool) -> tuple[dict, dict]:
    """The prediction layers' weights (``common.released_mtp_weights``): required, and the optional copies."""
    return common.released_mtp_weights(config, KIND.extra_layers, lambda layer: layer_weights(config, layer, fused))


def latent_attention_weights(config: dict) -> dict:
    """Multi-head latent attention (q through a low rank when ``q_lora_rank`` is set)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rope, nope, v_dim = config["qk_rope_head_dim"], config["qk_nope_head_dim"], config["v_head_dim"]
    q_rank, kv_rank = config.get("q_lora_rank"), config["kv_lora_rank"]
    bias = bool(config.get("attention_bias"))
    weights = {}
    if q_rank is None:
        weights["self_attn.q_proj.weight"] = (heads * (nope + rope), hidden)
    else:
        weights.update({"self_attn.q_a_proj.weight": (q_rank, hidden), "self_attn.q_a_layernorm.weight": (q_rank,),
                        "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank)})
        if bias:
            weights["self_attn.q_a_proj.bias"] = (q_rank,)
    weights.update({"self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, hidden),
                    "self_attn.kv_a_layernorm.weight": (kv_rank,),
                    "self_attn.kv_b_proj.weight": (heads * (nope + v_dim), kv_rank),
                    "self_attn.o_proj.weight": (hidden, heads * v_dim)})
    if bias:
        weights.update({"self_attn.kv_a_proj_with_mqa.bias": (kv_rank + rope,), "self_attn.o_proj.bias": (hidden,)})
    return weights


# TP rules. HF names, as transformers' plan of DeepseekV3: no attention projection split (its heads come out of
# kv_b_proj, which the plan keeps whole), and the router's score bias is a buffer, which FSDP2 leaves whole.
# torchtitan's names, as torchtitan 0.3 (deepseek_v3/sharding.py): MLA's up projections (wq or wq_b, wkv_b)
# colwise and wo rowwise, its low-rank projections and norms whole.
TP_RULES = common.tp_rules(
    {"hf": ((r"mlp\.gate\.e_score_correction_bias$", {"fsdp": None}),
            *(rule for rule in common.DENSE_TP["hf"] if "self_attn" not in rule[0])),
     "torchtitan": ((r"attention\.(wq_b|wkv_b)\.weight$", common.COLWISE), *common.DENSE_TP["torchtitan"])},
    common.ROUTED_EXPERTS_TP)

KIND = ModelKind(
    name="deepseek_v3",
    rows=(common.EMBEDDINGS, common.FINAL_NORM, common.LM_HEAD, *common.RECOMPUTED, *LAYER, *MTP),
    hf_weights=hf_weights,
    **{**common.moe_kind_fields(EXPERT_FIELDS), "tp_rules": TP_RULES},
    extra_layers="num_nextn_predict_layers",
    extra_weights=prediction_weights,
    megatron=MEGATRON,
    megatron_mtp=MEGATRON_MTP,
)
