"""Hugging Face's names (transformers' modules, as in a model folder): the hub every other family maps to and from.

One tensor per routed expert (or, on request, transformers v5's fused ``gate_up_proj`` / ``down_proj``), q/k
rows in rotate-half order, prediction layers numbered after the main ones, and an output weight tied to the
embedding left out of a folder. HF names are saved by many engines in their own layouts: a checkpoint keeps
the layout it has.
"""

from __future__ import annotations

from dataclasses import dataclass

from dcptool.errors import UsageError, option
from dcptool.family_interface import Family, FamilyOptions

EXPERT_FORMS = ("per-expert", "fused")


@dataclass(frozen=True, kw_only=True)
class HfFamilyOptions(FamilyOptions):
    """A caller's choices for the HF names written: ``hf_experts``, MoE experts as ``"per-expert"`` tensors (as hub
    checkpoints hold them) or ``"fused"`` (transformers v5's ``gate_up_proj`` / ``down_proj``)."""

    hf_experts: str = "per-expert"


@dataclass(frozen=True)
class HfNaming:
    """How HF names are written: ``fused_experts``, MoE experts as transformers v5's fused tensors."""

    fused_experts: bool = False


class Hf(Family):
    name = "hf"
    rank = 0
    description = "Hugging Face's, as in a model folder; a checkpoint's layout kept"
    hub = True
    options_type = HfFamilyOptions
    experts_apart = True
    rope_halves = True
    predictions_after_main = True
    may_omit_tied_output = True

    def options(self, mesh: dict, dtype: str | None, given: HfFamilyOptions | None) -> HfNaming:
        experts = (given or HfFamilyOptions()).hf_experts
        if experts not in EXPERT_FORMS:
            raise UsageError(f"{option('hf_experts', experts)}: choose {' or '.join(EXPERT_FORMS)}")
        return HfNaming(fused_experts=experts == "fused")

    def fused_experts(self, options) -> bool:
        return isinstance(options, HfNaming) and options.fused_experts


FAMILY = Hf()
