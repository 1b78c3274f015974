"""AReaL's Archon engine (torchtitan's names before 0.3): grouped experts, RoPE-interleaved q/k rows, and the state
saved as ``{"dcp": DCPState}`` whose state dict is ``{"model": ..., "optim": ...}``
(areal/experimental/engine/archon_checkpoint.py, ``save_to_dcp`` / ``load_from_dcp``)."""

from __future__ import annotations

from dcptool.family_interface import Family, EngineState


class Archon(Family):
    name = "archon"
    rank = 1
    description = "AReaL Archon's: dcp.model.*, dcp.optim.*, wq/wk/wv/wo and w1/w2/w3, grouped experts"
    engine_state = EngineState("AReaL's Archon engine", ("dcp", "model"), ("dcp", "optim"))
    detect_priority = 1  # names that torchtitan before 0.3 and Archon share read as Archon's


FAMILY = Archon()
