"""DeepSeek-V3: multi-head latent attention, dense first layers, routed and shared experts.

HF's ``e_score_correction_bias`` is torchtitan's ``expert_bias``. Its RoPE is interleaved on both
sides (HF's ``rope_interleave``), so nothing is permuted.
"""

from dcptool.adapters.common import EMBEDDINGS, FINAL_NORM, LAYER_NORMS, LM_HEAD, RECOMPUTED, dense_mlp, routed_experts
from dcptool.adapters.table import Row

# HF name in self_attn -> torchtitan name in attention (the same in Archon and torchtitan 0.3).
MLA = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
       "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}

ROWS = [
    EMBEDDINGS, FINAL_NORM, LM_HEAD, *LAYER_NORMS, *RECOMPUTED,
    *[Row(f"model.layers.{{L}}.self_attn.{hf}.weight", f"layers.{{L}}.attention.{titan}.weight",
          f"layers.{{L}}.attention.{titan}.weight") for hf, titan in MLA.items()],
    *dense_mlp(),
    *routed_experts(),
    *dense_mlp("mlp.shared_experts", "moe.shared_experts"),
    Row("model.layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.expert_bias",
        "layers.{L}.moe.expert_bias_E"),
]
