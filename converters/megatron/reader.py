"""Reading Megatron-Core checkpoints offline: a ``torch_dist`` folder (DCP underneath, read by the dcp format's
reader) with its common state as data, or the legacy per-rank ``mp_rank_*`` files (``legacy``); a ``zarr``
folder is refused, saying how to convert it."""

from __future__ import annotations

import dataclasses

from dcptool.converters.dcp import METADATA
from dcptool.converters.dcp import read as read_dcp
from dcptool.converters.megatron import legacy
from dcptool.converters.megatron.common import run_info
from dcptool.converters.megatron.names import BACKEND, COMMON_PT, COMMON_STATE, CONFIG, NAME, REMOVED_BACKENDS
from dcptool.engine.core import Checkpoint
from dcptool.errors import CheckpointError, printable
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive

CONFIG_LIMIT = 1 << 16  # metadata.json is a line of JSON


def detect(files: CheckpointFiles) -> bool:
    """A folder with Megatron's ``metadata.json`` (torch_dist, or a zarr one to refuse) or legacy per-rank files."""
    return files.is_dir() and (files.is_file(CONFIG) or legacy.detect(files))


def read(files: CheckpointFiles) -> Checkpoint:
    if not files.is_file(CONFIG):
        return legacy.read(files)
    config = files.read_json_object(CONFIG, CONFIG_LIMIT, "Megatron-Core's checkpoint config")
    backend = config.get("sharded_backend")
    where = files.path(CONFIG)
    if backend in REMOVED_BACKENDS:
        raise CheckpointError(
            f"{where}: a {backend} checkpoint, which Megatron-Core removed in {REMOVED_BACKENDS[backend]} and dcptool "
            f"does not read; convert it: load it with megatron-core < {REMOVED_BACKENDS[backend]} "
            f"(dist_checkpointing.load) and save it with backend torch_dist (dist_checkpointing.save)")
    if backend != BACKEND:
        raise CheckpointError(f"{where}: sharded_backend {printable(repr(backend), 40)}: dcptool reads {BACKEND} "
                              "checkpoints of Megatron-Core")
    if not files.is_file(METADATA):
        raise CheckpointError(f"{files.path(METADATA)}: missing (a torch_dist checkpoint is a DCP folder)")
    checkpoint = read_dcp(files)
    info = {"sharded_backend": BACKEND, **checkpoint.info, **_common_info(files, checkpoint)}
    return dataclasses.replace(checkpoint, format=NAME, info=info)


def _common_info(files: CheckpointFiles, checkpoint: Checkpoint) -> dict:
    """The run's facts from its common state: ``common.pt`` (before core 0.19, and first, as Megatron's loader
    looks) or the ``common_state`` object in the DCP; nothing when there is neither."""
    if files.is_file(COMMON_PT):
        return run_info(Archive(files, COMMON_PT).load(), str(files.path(COMMON_PT)))
    common = checkpoint.objects.get(COMMON_STATE)
    if common is None:
        return {}
    value = checkpoint.object_archive(common).load()
    where = f"{files.path(METADATA)}: {COMMON_STATE}"
    if isinstance(value, list) and len(value) == 1:  # a ShardedObject is saved as a one-element list
        value = value[0]
    return run_info(value, where)
