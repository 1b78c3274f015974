"""Reading a verl folder: which world size it was saved for, and every rank's files gathered into one checkpoint.

Reading needs neither torch nor a process group: the files go through dcptool's restricted
unpickler, and chunks are placed by the global offsets the files record, never by rank order.
The model files give the model at the top level; the optimizer files give
``optimizer.state.<param>.<moment>`` (laid out like the parameter) and ``optimizer.param_groups``
(in any form of ``optimizer.OPTIMIZER_FORMS``); the extra-state files give
``extra_state.lr_scheduler.*`` and, per saving rank, ``extra_state.rank_<r>.*`` (its RNG state);
what dcptool carried there for the source (``dcptool_carried``: torchtitan's ``train_state.*``) comes
back under its own keys.
A folder dcptool wrote from a source that keeps these otherwise (param_groups flattened per parameter,
the scheduler at the top level) gives them back as the source had them (``_as_in_source``).
``info`` records the forms read (``optimizer_form``, ``model_values``, the DTensors' ``mesh``).
What cannot be read (flat state of another layout than the one computed, an extra state the
restricted unpickler refuses) is left out with a line in ``info["not_read"]``.
"""

from __future__ import annotations

import json
from typing import Any

from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo, join_path
from dcptool.errors import CheckpointError, json_kind, printable
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive
from dcptool.converters.fsdp1.codecs import mesh_facts
from dcptool.converters.fsdp1.folder import (CARRIED, CONFIG, EXTRA_STATE, HF_DIR, NAME, NO_SCHEDULER, OPTIMIZER,
                                             RANK_FILE, SCHEDULER_ROOTS, SOURCE_LAYOUT, file_name)
from dcptool.converters.fsdp1.gathering import Gathered, NotRead, gather_rank, read_part
from dcptool.converters.fsdp1.optimizer import read_optimizer


MAX_CONFIG = 2**20  # fsdp_config.json holds two numbers


def detect(files: CheckpointFiles) -> bool:
    """Whether ``files`` is a folder with verl's per-rank model files."""
    return files.is_dir() and bool(files.names("model_world_size_*_rank_*.pt"))


def read(files: CheckpointFiles) -> Checkpoint:
    """The checkpoint a verl folder holds: the model files of its world size, and its optimizer and extra-state
    files where every rank's are there and readable (else a line in ``info["not_read"]``)."""
    if not files.is_dir():
        raise CheckpointError(f"{files.location}: not a folder (an FSDP1 checkpoint is a folder of per-rank files)")
    ranks: dict[str, dict[int, set[int]]] = {"model": {}, "optim": {}, "extra_state": {}}
    for name in files.names("*.pt"):
        match = RANK_FILE.match(name)
        if match:
            ranks[match.group(1)].setdefault(int(match.group(2)), set()).add(int(match.group(3)))
    world_size, from_config = _world_size(files, ranks["model"])
    _check_model_files(files, world_size, ranks["model"].get(world_size, set()), from_config)
    tensors: dict[str, Gathered] = {}
    objects: dict[str, ObjectInfo] = {}
    kinds: dict[str, Any] = {}
    model_order = read_part(files, "model", (), world_size, tensors, objects, kinds)
    model_values = {"DTensor": "dtensor", "ShardedTensor": "sharded-tensor"}
    values = next((name for kind, name in model_values.items() if kind in kinds), None)
    mesh = mesh_facts(kinds["DTensor"]) if "DTensor" in kinds else None
    notes, optimizer_form, alignment = [], None, None
    if ranks["optim"].get(world_size):
        notes, optimizer_form, alignment = read_optimizer(files, world_size, ranks["optim"][world_size], model_order,
                                                          tensors, objects, kinds)
    if ranks["extra_state"].get(world_size):
        notes += _read_extra_state(files, world_size, ranks["extra_state"][world_size], tensors, objects)
    if from_config:
        objects = _as_in_source(files, tensors, objects)

    info: dict[str, Any] = {
        "world_size": world_size,
        "optimizer_files": len(ranks["optim"].get(world_size, ())),
        "extra_state_files": len(ranks["extra_state"].get(world_size, ())),
        "values": ", ".join(sorted(kinds)) or None,
        # The forms a conversion to fsdp1 writes unless told otherwise (planning.output_forms).
        "optimizer_form": optimizer_form,
        "orig_alignment": alignment,  # elements between use_orig_params parameters, where the pieces tell
        "model_values": values,
        "mesh": mesh,
        "not_read": notes or None,  # parts of the folder no conversion carries, one line each
    }
    if files.is_file(f"{HF_DIR}/config.json"):  # verl saves the model's config and tokenizer there
        info["hf_config_dir"] = files.path(HF_DIR)
    infos = {key: TensorInfo(g.path, g.dtype, g.shape, g.chunks) for key, g in tensors.items()}
    checkpoint = Checkpoint(NAME, files.location, files, infos, objects, info)
    checkpoint.validate()
    return checkpoint


def _check_model_files(files: CheckpointFiles, world_size: int, found: set[int], from_config: bool) -> None:
    """Refuse a world size that the model files present do not match, before anything is sized by it (a
    world size of 10**9 is one line). ``found``: the ranks of the model files of that world size."""
    missing = next(r for r in range(len(found) + 1) if r not in found)
    if missing < world_size:
        count = world_size - sum(1 for r in found if r < world_size)
        shown = [file_name("model", world_size, r) for r in range(missing, min(world_size, missing + 3)) if r not in found]
        said = f"{CONFIG} says world size {world_size}" if from_config else f"a world size {world_size} FSDP1 checkpoint"
        raise CheckpointError(
            f"{files.path(file_name('model', world_size, missing))}: missing ({said}, which needs one model file "
            f"per rank; {count:,} missing: {', '.join(shown)}{' ...' if count > len(shown) else ''})"
        )
    extra = sorted(r for r in found if r >= world_size)
    if extra:
        raise CheckpointError(
            f"{files.path(file_name('model', world_size, extra[0]))}: rank {extra[0]} is outside world size {world_size}"
        )


def _read_extra_state(files: CheckpointFiles, world_size: int, present: set[int], tensors: dict,
                      objects: dict) -> list[str]:
    """verl's ``{"lr_scheduler": ..., "rng": ...}``: the scheduler once (rank 0's), the rest under each rank,
    but for what dcptool carried under ``dcptool_carried`` (``planning._carried``), given back under the
    source's own keys: every rank's together (rank 0's holds all but one data-parallel rank's state).

    The RNG state belongs to one rank of the saving job: it is read as ``extra_state.rank_<r>.rng``,
    which a new world size drops unless asked to keep it (numpy's RNG state is read as numpy data).
    A file the restricted unpickler refuses is left out with a line.
    """
    gathered_tensors: dict[str, Gathered] = {}
    gathered_objects: dict[str, ObjectInfo] = {}
    try:
        for rank in sorted(present):
            if rank >= world_size:
                continue
            archive = Archive(files, file_name("extra_state", world_size, rank))
            root = archive.load()
            if not isinstance(root, dict):
                raise NotRead(f"{archive.where}: holds a {type(root).__name__}, not a dict: extra state not read")
            carried = root.get(CARRIED, {})
            if not isinstance(carried, dict):
                raise NotRead(f"{archive.where}: {CARRIED} holds a {type(carried).__name__}, not a dict: "
                              "extra state not read")
            shared = {k: v for k, v in root.items() if k == "lr_scheduler" and rank == 0}
            own = {k: v for k, v in root.items() if k not in ("lr_scheduler", CARRIED)}
            for part, prefix in ((carried, ()), (shared, (EXTRA_STATE,)), (own, (EXTRA_STATE, f"rank_{rank}"))):
                if part:
                    gather_rank(archive, part, prefix, gathered_tensors, gathered_objects, {})
    except NotRead as exc:
        return [str(exc)]
    except CheckpointError as exc:  # a file the restricted unpickler refuses
        return [f"{exc}: the extra state is not read"]
    if len(present) < world_size:
        return [f"{files.path(file_name('extra_state', world_size, min(set(range(world_size)) - present)))}: missing "
                "(the extra state of every rank is needed): the extra state is not read"]
    clash = sorted((gathered_tensors.keys() | gathered_objects.keys()) & (tensors.keys() | objects.keys()))
    if clash:  # a carried entry never stands in for one of the model or optimizer files
        return [f"{files.location}: {CARRIED} of the extra-state files holds {printable(clash[0])}, which the model "
                "or optimizer files hold too: the extra state is not read"]
    tensors.update(gathered_tensors)
    objects.update(gathered_objects)
    return []


def _as_in_source(files: CheckpointFiles, tensors: dict[str, Gathered],
                  objects: dict[str, ObjectInfo]) -> dict[str, ObjectInfo]:
    """The optimizer and scheduler entries as the source of a dcptool conversion had them, where
    ``fsdp_config.json`` records how they were restructured for verl (``planning.source_layout``):
    param_groups flattened per parameter again (``optimizer.param_groups.<param>.<setting>``, as torch's
    ``get_state_dict`` flattens them), the state's moments one entry each under the optimizer (their keys
    do not change, their nesting does), the lr scheduler back at its root (``lr_scheduler.last_epoch``), and
    no scheduler where the source had none (the ``None`` verl's loader needs is the writer's placeholder)."""
    layout = files.read_json_object(CONFIG, MAX_CONFIG, "an FSDP config").get(SOURCE_LAYOUT)
    if not isinstance(layout, dict):
        return objects
    if layout.get("state") == "per_parameter":
        for gathered in tensors.values():
            if len(gathered.path) == 4 and gathered.path[:2] == (OPTIMIZER, "state"):
                gathered.path = (OPTIMIZER, join_path(gathered.path[1:]))
    scheduler_root = layout.get("lr_scheduler")
    restored = {}
    for entry in objects.values():
        path = entry.path
        if path == (OPTIMIZER, "param_groups") and layout.get("param_groups") == "per_parameter" \
                and isinstance(entry.value, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                                          and all(isinstance(p, str) for p in g["params"])
                                                          for g in entry.value):
            for group in entry.value:
                for parameter in group["params"]:
                    for setting, value in group.items():
                        if setting != "params":
                            flat = ObjectInfo((OPTIMIZER, f"param_groups.{parameter}.{setting}"), value=value)
                            restored[flat.key] = flat
            continue
        if path == (EXTRA_STATE, "lr_scheduler") and scheduler_root == NO_SCHEDULER and entry.value is None:
            continue  # the placeholder the writer put where the source had no scheduler
        if path[:2] == (EXTRA_STATE, "lr_scheduler") and scheduler_root in SCHEDULER_ROOTS:
            entry = ObjectInfo((scheduler_root, *path[2:]), value=entry.value)
        restored[entry.key] = entry
    return restored


def _world_size(files: CheckpointFiles, model_ranks: dict[int, set[int]]) -> tuple[int, bool]:
    """The world size, and whether fsdp_config.json gave it (else the file names did)."""
    config = files.path(CONFIG)
    if files.is_file(CONFIG):
        settings = files.read_json_object(CONFIG, MAX_CONFIG, "an FSDP config")
        value = settings.get("world_size")
        if type(value) is not int or value <= 0:
            shown = json.dumps(value) if value is None or isinstance(value, (str, int, float)) else json_kind(value)
            raise CheckpointError(f"{config}: world_size is {printable(shown, 40)}, not a positive integer")
        return value, True
    if not model_ranks:
        raise CheckpointError(f"{files.location}: no model_world_size_*_rank_*.pt files")
    if len(model_ranks) > 1:
        sizes = ", ".join(str(w) for w in sorted(model_ranks))
        raise CheckpointError(f"{files.location}: model files of several world sizes ({sizes}); keep one set")
    return next(iter(model_ranks)), False
