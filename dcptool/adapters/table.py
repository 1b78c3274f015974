"""A row of a naming table: one parameter under each family's name, and how its layout differs."""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = ("hf", "archon", "torchtitan")


@dataclass(frozen=True, eq=False)
class Row:
    """One parameter in every family; ``None`` where a family has no such tensor (dropped with a note).

    ``{L}`` stands for the layer and, in HF names, ``{E}`` for the expert. ``experts``: the
    torchtitan-style names hold every expert in one grouped ``[E, out, in]`` tensor, HF one tensor
    per expert; ``fused``: transformers v5's fused HF tensor and this row's part of it (dim 1).
    ``rope_heads``: the config field with the head count of a weight whose rows torchtitan
    interleaves for its RoPE (Llama's q and k). ``tied_to``: the row it equals when the config ties
    embeddings. ``mtp``: a multi-token-prediction layer, which torchtitan numbers apart
    (``mtp_layers.{L}``) and HF after the main layers (``model.layers.{num_hidden_layers + L}``).
    """

    hf: str | None
    archon: str | None
    torchtitan: str | None
    experts: bool = False
    fused: tuple[str, int] | None = None
    rope_heads: str | None = None
    tied_to: Row | None = None
    mtp: bool = False

    def name(self, family: str) -> str | None:
        return getattr(self, family)

