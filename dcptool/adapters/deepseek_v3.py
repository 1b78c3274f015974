"""DeepSeek-V3: multi-head latent attention, dense first layers, routed and shared experts.

HF's ``e_score_correction_bias`` is torchtitan's ``expert_bias``. Its RoPE is interleaved on both
sides (HF's ``rope_interleave``), so nothing is permuted. The multi-token-prediction layers (HF's
layer 61 of the 671B model) are torchtitan 0.3's ``mtp_layers``; Archon names have none.
"""

from dataclasses import replace

from dcptool.adapters.common import EMBEDDINGS, FINAL_NORM, LAYER_NORMS, LM_HEAD, RECOMPUTED, dense_mlp, routed_experts
from dcptool.adapters.table import Row

# HF name in self_attn -> torchtitan name in attention (the same in Archon and torchtitan 0.3).
MLA = {"q_proj": "wq", "q_a_proj": "wq_a", "q_a_layernorm": "q_norm", "q_b_proj": "wq_b",
       "kv_a_proj_with_mqa": "wkv_a", "kv_a_layernorm": "kv_norm", "kv_b_proj": "wkv_b", "o_proj": "wo"}

LAYER = [
    *LAYER_NORMS,
    *[Row(f"model.layers.{{L}}.self_attn.{hf}.weight", f"layers.{{L}}.attention.{titan}.weight",
          f"layers.{{L}}.attention.{titan}.weight") for hf, titan in MLA.items()],
    *dense_mlp(),
    *routed_experts(),
    *dense_mlp("mlp.shared_experts", "moe.shared_experts"),
    Row("model.layers.{L}.mlp.gate.e_score_correction_bias", "layers.{L}.moe.expert_bias",
        "layers.{L}.moe.expert_bias_E"),
]

# A prediction layer is a decoder layer, plus norms of the embedding and hidden state and their
# projection; HF also repeats the embedding and head there (the main ones serve: left out).
MTP = [
    *[replace(row, archon=None, torchtitan="mtp_" + row.torchtitan, mtp=True) for row in LAYER],
    *[Row(f"model.layers.{{L}}.{hf}.weight", None, f"mtp_layers.{{L}}.{titan}.weight", mtp=True)
      for hf, titan in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                        ("shared_head.norm", "mtp_norm"))],
    Row("model.layers.{L}.embed_tokens.weight", None, None, mtp=True),
    Row("model.layers.{L}.shared_head.head.weight", None, None, mtp=True),
]

ROWS = [EMBEDDINGS, FINAL_NORM, LM_HEAD, *RECOMPUTED, *LAYER, *MTP]
