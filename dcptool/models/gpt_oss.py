"""GPT-OSS (``GptOssForCausalLM``), in its bf16 layout: grouped-query attention with biases on q, k, v and o and a
learned sink logit per head (``self_attn.sinks``, a softmax over the scores and the sink), sliding-window and full
attention alternating (``layer_types``), YaRN RoPE; every layer a MoE of ``num_local_experts`` experts routed by
a linear layer with a bias (softmax of the top k), each expert a clamped SwiGLU with biases whose fused
``gate_up_proj`` ``[E, H, 2F]`` alternates gate and up columns (gate first) and whose ``down_proj`` is
``[E, F, H]``: both ``x @ W``, the transpose of a Linear's weight. (The release's MXFP4 experts are dequantized
into this layout by ``dcptool.planning.quant``.)

Neither Archon nor torchtitan names it here: its rows name HF tensors only. Megatron-Core holds it as a GPT model
(Megatron-Bridge's GPT-OSS model): ``add_bias_linear``, ``softmax_type="learnable"`` (the sinks are
``core_attention.softmax_offset``), ``window_size`` with ``window_attn_skip_freq=2``, ``position_embedding_type=
"yarn"``, the experts' ``quick_gelu`` with ``glu_linear_offset=1`` and ``activation_func_clamp_value=7``, their
``linear_fc1`` ``[E, gate; up, H]`` and ``linear_fc2`` ``[E, H, F]`` with biases, the router's bias.
"""

from dataclasses import replace

from dcptool.models import common
from dcptool.models.kind import MegatronName, ModelKind, Row

EXPERT_FIELDS = ("num_local_experts", "num_experts")
ROUTER = ("mlp.router.weight", "mlp.router.bias")
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
           "mlp.experts.down_proj_bias")


def hf_weights(config: dict, fused: bool) -> dict:
    """q/k/v/o with biases (``attention_bias``, set by default), a sink per head, the router with its bias and the
    experts, fused in every form (``fused`` changes nothing)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    experts = common.required_experts(KIND, config)
    bias = bool(config.get("attention_bias", True))

    def layer_weights(layer: int) -> dict:
        return {**common.attention_weights(config, qkv_bias=bias, o_bias=bias, qk_norms=False),
                "self_attn.sinks": (config["num_attention_heads"],),
                "mlp.router.weight": (experts, hidden), "mlp.router.bias": (experts,),
                "mlp.experts.gate_up_proj": (experts, hidden, 2 * inner),
                "mlp.experts.gate_up_proj_bias": (experts, 2 * inner),
                "mlp.experts.down_proj": (experts, inner, hidden), "mlp.experts.down_proj_bias": (experts, hidden)}

    return common.decoder_weights(config, layer_weights)


LAYER = [*common.LAYER_NORMS, *common.attention_rows(rope=False, biases=True),
         *(Row(f"model.layers.{{L}}.{name}", None, None) for name in ("self_attn.o_proj.bias", "self_attn.sinks",
                                                                       *ROUTER, *EXPERTS))]
HF_ROWS = [common.EMBEDDINGS, common.FINAL_NORM, common.LM_HEAD, *common.RECOMPUTED, *LAYER]

# Megatron-Core's GPT layers with biases, the sinks as the attention's learnable softmax offset, every layer a MoE
# (the local spec names the norm before it as fused into linear_fc1, the TE spec as pre_mlp_layernorm), as
# Megatron-Bridge's GPT-OSS bridge maps them; the experts' fused HF tensors taken apart and put together as
# views (gate and up alternating in HF, Megatron's halves; HF's x @ W, Megatron's W x). Checked against
# megatron-core 0.19.2's own save (tests/test_megatron_gpt_oss.py).
MEGATRON = (
    *common.megatron_attention(biases=True),
    MegatronName("self_attention.linear_proj.bias", ("self_attn.o_proj.bias",)),
    MegatronName("self_attention.core_attention.softmax_offset", ("self_attn.sinks",)),
    *common.megatron_mlp_norm(),
    *(MegatronName(name, (name,)) for name in ROUTER),
    MegatronName("mlp.experts.experts.linear_fc1.weight", ("mlp.experts.gate_up_proj",), "interleaved"),
    MegatronName("mlp.experts.experts.linear_fc1.bias", ("mlp.experts.gate_up_proj_bias",), "interleaved"),
    MegatronName("mlp.experts.experts.linear_fc2.weight", ("mlp.experts.down_proj",), "transposed"),
    MegatronName("mlp.experts.experts.linear_fc2.bias", ("mlp.experts.down_proj_bias",)),
)

KIND = ModelKind(
    name="gpt_oss",
    rows=tuple(replace(row, archon=None, torchtitan=None) for row in HF_ROWS if row.hf),
    hf_weights=hf_weights,
    # No built-in TP rules: transformers' plan of GPT-OSS splits only the embedding, and the Llama-shaped rules'
    # dims do not fit its experts ([E, H, 2F], gate and up alternating).
    **{**common.moe_kind_fields(EXPERT_FIELDS), "tp_rules": {"hf": (), "torchtitan": ()}},
    megatron=MEGATRON,
    mxfp4_experts=True,  # the release's experts: *_blocks and *_scales
)
