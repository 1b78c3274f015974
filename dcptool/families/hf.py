"""Hugging Face's names (transformers' modules, as in a model folder): the hub every other family maps to and from.

One tensor per routed expert (or, on request, transformers v5's fused ``gate_up_proj`` / ``down_proj``), q/k
rows in rotate-half order, prediction layers numbered after the main ones, and an output weight tied to the
embedding left out of a folder. HF names are saved by many engines in their own layouts: a checkpoint keeps
the layout it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dcptool.errors import UsageError, option
from dcptool.family_interface import Family

EXPERT_FORMS = ("per-expert", "fused")


@dataclass(frozen=True)
class HfOptions:
    """How HF names are written: ``fused_experts``, MoE experts as transformers v5's fused tensors (export-hf's
    ``hf_experts="fused"``) instead of one tensor per expert."""

    fused_experts: bool = False


class Hf(Family):
    name = "hf"
    rank = 0
    description = "Hugging Face's, as in a model folder; a checkpoint's layout kept"
    hub = True
    takes: ClassVar[tuple[str, ...]] = ("hf_experts",)
    experts_apart = True
    rope_halves = True
    predictions_after_main = True
    may_omit_tied_output = True

    def options(self, mesh: dict, dtype: str | None, hf_experts: str | None = None) -> HfOptions:
        if hf_experts not in (None, *EXPERT_FORMS):
            raise UsageError(f"{option('hf_experts', hf_experts)}: choose {' or '.join(EXPERT_FORMS)}")
        return HfOptions(fused_experts=hf_experts == "fused")

    def fused_experts(self, options) -> bool:
        return isinstance(options, HfOptions) and options.fused_experts


FAMILY = Hf()
