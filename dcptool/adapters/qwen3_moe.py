"""Qwen3-MoE: Qwen3 attention, routed experts grouped as [E, out, in] by torchtitan and Archon, a router.

Archon and torchtitan keep a load-balancing ``expert_bias`` that Hugging Face's model has no place
for: it is dropped on export with a note.
"""

from dcptool.adapters.common import llama_like, routed_experts
from dcptool.adapters.table import Row

ROWS = [*llama_like(qk_norms=True), *routed_experts(),
        Row(None, "layers.{L}.moe.expert_bias", "layers.{L}.moe.expert_bias_E")]
