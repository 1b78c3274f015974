"""Qwen2 (AReaL Archon): Llama names plus q/k/v biases; its RoPE matches HF's, so nothing is permuted."""

from dcptool.adapters.common import llama_like

ROWS = llama_like(biases=True)
