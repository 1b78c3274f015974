"""Qwen3 dense: Llama names plus per-head q/k RMSNorms; RoPE as HF's (no permutation)."""

from dcptool.adapters.common import llama_like

ROWS = llama_like(qk_norms=True)
