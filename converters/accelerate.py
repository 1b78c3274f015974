"""HF Trainer / accelerate FSDP checkpoint folders (``checkpoint-500/``), read as one checkpoint of several parts.

accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` (``accelerate/utils/fsdp_utils.py``) write,
with ``SHARDED_STATE_DICT``, ``pytorch_model_fsdp_0/`` (``dcp.save({"model": model.state_dict()})``)
and ``optimizer_0/`` (``dcp.save({"optimizer": FSDP.optim_state_dict(model, optimizer)})``); with
``FULL_STATE_DICT`` they write ``pytorch_model_fsdp.bin`` (the full model state dict) and
``optimizer.bin``. ``Trainer._save_checkpoint`` adds ``scheduler.pt``, ``rng_state_{rank}.pth`` (or
``rng_state.pth``), ``trainer_state.json`` and the model's ``config.json``.

The parts become one checkpoint: model weights under ``model.`` (as in accelerate's DCP; a full
state dict is nested there too), optimizer state under ``optimizer.`` (``optimizer.state.<param>.exp_avg``),
and objects ``scheduler``, ``rng_state.rank_<r>`` and ``trainer_state``. The scheduler and RNG
files are carried as the ``torch.save`` bytes they are and never unpickled unless a writer needs
their values (the ``torch`` writer stores torch's RNG state, a tensor inside the RNG dict, as a
tensor of its file: ``torch_save.split_object``). The ``config.json`` beside the weights (in the
folder, else in its parent, where ``Trainer`` keeps the run's output) is the model's config for
``export-hf``. ``pytorch_model_fsdp_0/`` alone is a
plain DCP checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo
from dcptool.errors import CheckpointError
from dcptool.format_interface import Format
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import TORCH_ARCHIVE
from dcptool.converters import dcp, torch_save

NAME = "accelerate"
MODEL_DCP = "pytorch_model_fsdp_0"
MODEL_FULL = "pytorch_model_fsdp.bin"
OPTIMIZER_DCP = "optimizer_0"
OPTIMIZER_FULL = "optimizer.bin"
SCHEDULER = "scheduler.pt"
TRAINER_STATE = "trainer_state.json"
MAX_TRAINER_STATE = 64 * 2**20  # a long run's log history; the file is parsed whole
_RNG_FILE = re.compile(r"rng_state(?:_(\d+))?\.pth$")


def detect(files: CheckpointFiles) -> bool:
    return files.is_dir() and (files.is_file(f"{MODEL_DCP}/{dcp.METADATA}") or files.is_file(MODEL_FULL))


def read(files: CheckpointFiles) -> Checkpoint:
    if not files.is_dir():
        raise CheckpointError(f"{files.location}: not a folder (a Trainer checkpoint is a checkpoint-N folder)")
    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    parts: list[str] = []
    info: dict[str, Any] = {}
    for root, folder, single in (("model", MODEL_DCP, MODEL_FULL), ("optimizer", OPTIMIZER_DCP, OPTIMIZER_FULL)):
        if files.is_file(f"{folder}/{dcp.METADATA}"):
            part = _dcp_part(files, folder)
            info.setdefault("world_size", part.info.get("world_size"))
            parts.append(f"{root}: {folder}/ (DCP)")
        elif files.is_file(single):
            part = _full_part(files, single, root)
            parts.append(f"{root}: {single} (full state dict)")
        else:
            continue
        for key, entry in [*part.tensors.items(), *part.objects.items()]:
            if entry.path[0] != root:
                raise CheckpointError(f"{part.root}: {key} is not under {root!r}, where accelerate saves the {root}")
            (tensors if isinstance(entry, TensorInfo) else objects)[key] = entry
    if files.is_file(SCHEDULER):
        objects["scheduler"] = ObjectInfo(("scheduler",), blob=(SCHEDULER, 0, files.size(SCHEDULER)))
        parts.append(f"scheduler: {SCHEDULER}")
    rng_files = [name for name in files.names("rng_state*.pth") if _RNG_FILE.match(name)]
    for name in rng_files:
        rank = _RNG_FILE.match(name).group(1) or "0"  # rng_state.pth: a one-process run
        objects[f"rng_state.rank_{rank}"] = ObjectInfo(("rng_state", f"rank_{rank}"), blob=(name, 0, files.size(name)))
    if rng_files:
        parts.append(f"rng: {len(rng_files)} rng_state files (one per rank)")
    if files.is_file(TRAINER_STATE):
        state = files.read_json_object(TRAINER_STATE, MAX_TRAINER_STATE, "a Trainer state")
        objects["trainer_state"] = ObjectInfo(("trainer_state",), value=state)
        parts.append(f"trainer state: {TRAINER_STATE}")
    info["parts"] = "; ".join(parts)
    config_dir = _config_dir(files)
    if config_dir is not None:
        info["hf_config_dir"] = config_dir
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects, info)
    checkpoint.validate()
    return checkpoint


def _dcp_part(files: CheckpointFiles, folder: str) -> Checkpoint:
    """A DCP subfolder, its chunks and blobs named from the Trainer folder (so one ``CheckpointFiles`` reads them)."""
    part = dcp.read(CheckpointFiles(files.path(folder)))
    if any(chunk.encoding != TORCH_ARCHIVE for tensor in part.tensors.values() for chunk in tensor.chunks):
        raise CheckpointError(f"{part.root}: compressed DCP chunks in a Trainer folder are not read yet; "
                              f"point dcptool at {part.root} itself")
    for tensor in part.tensors.values():
        tensor.chunks = [dataclasses.replace(chunk, file=f"{folder}/{chunk.file}") for chunk in tensor.chunks]
    for obj in part.objects.values():
        file, offset, length = obj.blob
        obj.blob = (f"{folder}/{file}", offset, length)
    return part


def _full_part(files: CheckpointFiles, name: str, root: str) -> Checkpoint:
    """A full state dict file (FULL_STATE_DICT), its entries nested under ``root`` as accelerate's DCP has them."""
    part = torch_save.read(CheckpointFiles(files.path(name)))  # its chunks name the file from the same folder
    for entry in [*part.tensors.values(), *part.objects.values()]:
        entry.path = (root,) + tuple(entry.path)
    part.tensors = {tensor.key: tensor for tensor in part.tensors.values()}
    part.objects = {obj.key: obj for obj in part.objects.values()}
    return part


def _config_dir(files: CheckpointFiles):
    """The folder with the model's config.json: the checkpoint folder, else its parent (the Trainer's output_dir)."""
    if files.is_file("config.json"):
        return files.location
    if files.local_folder is not None:
        parent = CheckpointFiles(files.local_folder.parent)
        if parent.is_file("config.json"):
            return parent.location
    return None


class AccelerateFolder(Format):
    """A checkpoint folder of HF Trainer / accelerate with FSDP (read only)."""

    name = NAME
    title = "HF Trainer / accelerate FSDP folders"

    detect = staticmethod(detect)
    read = staticmethod(read)


FORMAT = AccelerateFolder()
