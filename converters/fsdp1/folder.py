"""What a verl folder is made of: its files' names, the roots its entries go under, a piece of one rank's file.

The leaf of the fsdp1 package: the reader, the planning and the writer all name the same files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dcptool.engine.core import Piece

NAME = "fsdp1"
CONFIG = "fsdp_config.json"  # {"FSDP_version": 1, "world_size": W}
# fsdp_config.json's record of the source's layout of the non-tensor entries dcptool restructured (planning.source_layout)
SOURCE_LAYOUT = "dcptool_source_layout"
HF_DIR = "huggingface"  # the model's config and tokenizer, as verl saves them
RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")

OPTIMIZER = "optimizer"  # the optimizer's entries are read under this root: optimizer.state.<param>.exp_avg
EXTRA_STATE = "extra_state"  # extra_state.lr_scheduler.*, and extra_state.rank_<r>.rng.* of each saving rank
SCHEDULER_ROOTS = ("lr_scheduler", "lr_schedulers", "scheduler")  # where sources keep the lr scheduler
NO_SCHEDULER = "none"  # SOURCE_LAYOUT's lr_scheduler where the source had none: the extra state's None is a placeholder
RANK_ENTRY = re.compile(r"rank_(\d+)$")  # extra_state.rank_<r>: what source rank r saved of its own
# The key of verl's extra-state dict under which dcptool carries the source's entries verl has no place for
# (torchtitan's train_state.*, dataloader.*), nested as the source had them; verl reads only lr_scheduler and rng.
CARRIED = "dcptool_carried"
DP_RANK = re.compile(r"dp_rank_(\d+)$")  # torchtitan's dataloader.dp_rank_<r>: one data-parallel rank's state


def file_name(kind: str, world_size: int, rank: int) -> str:
    """verl's per-rank file name: ``model_world_size_2_rank_0.pt``."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


@dataclass(frozen=True)
class RankPiece(Piece):
    """A piece of one rank's file: replicated tensors give every rank an equal region, told apart by ``rank``."""

    rank: int
    file: str
