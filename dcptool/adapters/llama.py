"""Llama 3: torchtitan interleaves the rows of q and k for its complex-number RoPE; HF keeps rotate-half order."""

from dcptool.adapters.common import llama_like

ROWS = llama_like(rope=True)
