"""torchtitan 0.3 and later: grouped experts, RoPE-interleaved q/k rows, and its CheckpointManager's layout, the
model's keys at the top level beside ``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``
(torchtitan/components/checkpoint.py, ``_flattened_model_states_sd``)."""

from __future__ import annotations

from dcptool.family_interface import Family, EngineState


class Torchtitan(Family):
    name = "torchtitan"
    rank = 2
    description = "torchtitan 0.3 and later: the model at the top level, optimizer.*, grouped experts"
    engine_state = EngineState("torchtitan", (), ("optimizer",), ("lr_scheduler", "dataloader", "train_state"),
                         "start from it with checkpoint.initial_load_model_only, or list them in "
                         "checkpoint.exclude_from_loading")


FAMILY = Torchtitan()
