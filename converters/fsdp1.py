"""verl's FSDP1 checkpoint folder: one ``torch.save`` file per rank of FSDP1 ``SHARDED_STATE_DICT`` values.

A folder holds ``model_world_size_{W}_rank_{r}.pt`` for every rank ``r`` of ``W``, optionally
``optim_world_size_{W}_rank_{r}.pt``, ``extra_state_world_size_{W}_rank_{r}.pt``,
``fsdp_config.json`` (``{"FSDP_version": 1, "world_size": W}``) and ``huggingface/`` (config,
tokenizer). Each model file is a flat state dict whose parameters are

* ``ShardedTensor`` (FSDP1 without a device mesh): the rank's local shard plus the global
  ``ShardedTensorMetadata`` listing every shard's offsets and sizes;
* ``DTensor`` (FSDP1 given a device mesh): the local tensor plus a ``DTensorSpec`` with the
  placements, the mesh and the rank's coordinate in it, and the global shape;
* plain tensors for what FSDP1 does not shard (buffers), repeated in every rank's file.

FSDP1 shards the unflattened parameters row-wise on dim 0, ``torch.chunk`` style: rank ``r``
holds rows ``[r*ceil(n/W), (r+1)*ceil(n/W))``, so trailing ranks may hold fewer rows or none.

Reading needs neither torch nor a process group: the files go through dcptool's restricted
unpickler, and chunks are placed by the global offsets the files record, never by rank order.
The model files give the model at the top level; the optimizer files give
``optimizer.state.<param>.<moment>`` (laid out like the parameter) and ``optimizer.param_groups``;
the extra-state files give ``extra_state.lr_scheduler.*`` and, per saving rank,
``extra_state.rank_<r>.*`` (its RNG state). The optimizer files are read in any of the forms
``OPTIMIZER_FORMS`` names: ``FSDP.optim_state_dict`` keyed by name (``named``), and verl's plain
``optimizer.state_dict()`` of FSDP1 with ``use_orig_params=False`` (``flat``: one entry per FSDP
unit, each moment the rank's shard of the unit's flat parameter, laid out by ``flat_parameters``)
or ``use_orig_params=True`` (``orig``: the rank's 1-D piece of each parameter), or of FSDP2
(``fsdp2``: verl's folder of ``fully_shard``, ``FSDP_version: 2``, keyed by parameter position, the
moments DTensors like the model values). ``info`` records the forms read (``optimizer_form``,
``model_values``, the DTensors' ``mesh``). What cannot be read (flat state of another layout than
the one computed, an extra state the restricted unpickler refuses) is left out with a line in
``info["not_read"]``.

The writer produces, without importing torch, files that a real ``W``-process FSDP1 job loads with
verl's own ``load_checkpoint`` calls (each rank's files ``torch.load``ed, then under
``SHARDED_STATE_DICT`` ``model.load_state_dict`` and ``optimizer.load_state_dict`` of them as they
are): model values as the ShardedTensor of FSDP1 without a device mesh, or the DTensor of FSDP1
given verl's 1-D device mesh of the world; the optimizer in the form that job saves (``flat``
for verl's default ``use_orig_params=False``, ``orig`` for True), or ``named`` for a job that
loads through ``FSDP.optim_state_dict_to_load``; or an FSDP2 folder (``fsdp2``: DTensor values and
moments on verl's mesh, also on one rank, ``FSDP_version: 2``) that a real ``W``-process FSDP2 job
loads with verl's calls (``fully_shard``, then ``model.load_state_dict`` and
``optimizer.load_state_dict`` of the files as they are). ``output_forms`` picks the forms (the
source's by default); ``entries`` chooses what goes out of any checkpoint (model, optimizer,
scheduler; per-rank state on request). The pickles, the DeviceMesh state and the flat-parameter
layout are torch 2.13's, checked against real gloo jobs of torch 2.13 (tests/test_verl.py,
tests/test_fsdp1.py). Not laid out in ``flat``, ``orig`` and ``fsdp2``: tied parameters (FSDP keeps
a shared parameter once among the optimizer's parameters), refused when the config says
``tie_word_embeddings`` or the input and output embeddings hold the same values.
``orig`` aligns each parameter to 16 bytes of the dtype FSDP1 computes in, which a MixedPrecision
``param_dtype`` changes: the alignment is taken from a ``use_orig_params=True`` source of 2+ ranks
(the pieces its ranks saved tell it), else assumed from the parameters' dtype, as the output line says.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcptool import dtypes, selection
from dcptool.core import Checkpoint, Chunk, ObjectInfo, OutObject, OutTensor, Piece, TensorInfo, join_path
from dcptool.errors import (CheckpointError, UsageError, json_kind, printable, shape_problem,
                            with_article)
from dcptool.safe_pickle import SubclassRef, TensorRef
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.transfer import crc32, crc32_combine
from dcptool.torch_archive import (Archive, ArchiveLayout, Global, Reduced, StorageOut, TensorOut, dumps, new_object,
                                   row_major, torch_size)
from dcptool.converters.hf import copy_config
from dcptool.converters.torch_save import flatten, nest

NAME = "fsdp1"
WRITES_FOLDER = True
HOLDS = "the model, its optimizer state and the lr scheduler"  # what entries() carries
CONFIG = "fsdp_config.json"
COMPLETES = [CONFIG]  # uploaded last to remote storage
HF_DIR = "huggingface"
MAX_CONFIG = 2**20  # fsdp_config.json holds two numbers
_RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_(\d+)_rank_(\d+)\.pt$")

_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"
_DEVICE = re.compile(r"[a-z][a-z0-9_]*")  # a torch device type of a DTensor's mesh: cuda, cpu, npu


def file_name(kind: str, world_size: int, rank: int) -> str:
    """verl's per-rank file name: ``model_world_size_2_rank_0.pt``."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def detect(files: CheckpointFiles) -> bool:
    return files.is_dir() and bool(files.names("model_world_size_*_rank_*.pt"))


# ---------------------------------------------------------------------------------------------
# Reading


def read(files: CheckpointFiles) -> Checkpoint:
    if not files.is_dir():
        raise CheckpointError(f"{files.location}: not a folder (an FSDP1 checkpoint is a folder of per-rank files)")
    ranks: dict[str, dict[int, set[int]]] = {"model": {}, "optim": {}, "extra_state": {}}
    for name in files.names("*.pt"):
        match = _RANK_FILE.match(name)
        if match:
            ranks[match.group(1)].setdefault(int(match.group(2)), set()).add(int(match.group(3)))
    world_size, from_config = _world_size(files, ranks["model"])
    # Checked against the files present before anything is sized by it (a world size of 10**9 is one line).
    found = ranks["model"].get(world_size, set())
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

    tensors: dict[str, _Gathered] = {}
    objects: dict[str, ObjectInfo] = {}
    kinds: dict[str, Any] = {}
    model_order = _read_part(files, "model", (), world_size, tensors, objects, kinds)
    model_values = {"DTensor": "dtensor", "ShardedTensor": "sharded-tensor"}
    values = next((name for kind, name in model_values.items() if kind in kinds), None)
    mesh = _mesh_facts(kinds["DTensor"]) if "DTensor" in kinds else None
    notes, optimizer_form, alignment = [], None, None
    if ranks["optim"].get(world_size):
        notes, optimizer_form, alignment = _read_optimizer(files, world_size, ranks["optim"][world_size], model_order,
                                                           tensors, objects, kinds)
    if ranks["extra_state"].get(world_size):
        notes += _read_extra_state(files, world_size, ranks["extra_state"][world_size], tensors, objects)

    info: dict[str, Any] = {
        "world_size": world_size,
        "optimizer_files": len(ranks["optim"].get(world_size, ())),
        "extra_state_files": len(ranks["extra_state"].get(world_size, ())),
        "values": ", ".join(sorted(kinds)) or None,
        # The forms a conversion to fsdp1 writes unless told otherwise (output_forms).
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


def _read_part(files: CheckpointFiles, kind: str, prefix: tuple, world_size: int, tensors: dict, objects: dict,
               kinds: dict, roots: list[dict] | None = None, same_keys: bool = True) -> list[tuple[str, str]]:
    """Gather every rank's ``{kind}_world_size_W_rank_r.pt`` into ``tensors`` and ``objects``, under ``prefix``.

    ``roots``: the ranks' state dicts to gather, when the caller loaded (and rewrote) them.
    ``same_keys``: every rank must hold the same tensors. Returns rank 0's tensor keys in file order,
    each with the kind of its value (``ShardedTensor``, ``DTensor``, ``plain tensor``).
    """
    keys_of_rank0: list[tuple[str, str]] | None = None
    for rank in range(world_size):
        relative = file_name(kind, world_size, rank)
        archive = Archive(files, relative)
        root = archive.load() if roots is None else roots[rank]
        if not isinstance(root, dict):
            raise CheckpointError(f"{archive.where}: holds a {type(root).__name__}, not a state dict")
        found = _gather(archive, root, prefix, tensors, objects, kinds)
        if keys_of_rank0 is None:
            keys_of_rank0 = found
        elif same_keys and sorted(key for key, _ in found) != sorted(key for key, _ in keys_of_rank0):
            differ = sorted({key for key, _ in found} ^ {key for key, _ in keys_of_rank0})
            raise CheckpointError(
                f"{archive.where}: holds different tensors than {file_name(kind, world_size, 0)} "
                f"(e.g. {printable(differ[0])})"
            )
    return keys_of_rank0 or []


def _gather(archive: Archive, root: dict, prefix: tuple, tensors: dict, objects: dict,
            kinds: dict) -> list[tuple[str, str]]:
    """Add one rank's entries: tensor chunks to ``tensors``; objects as the first file holding them has them.
    ``kinds`` gets the first value of each kind found (``DTensor``: its mesh is what output_forms copies)."""
    found, seen = [], set()
    for nested, value in flatten(root, where=archive.where):
        path = prefix + nested
        key = join_path(path)
        if key in seen:
            raise CheckpointError(f"{archive.where}: two entries flatten to the key {printable(key)}")
        seen.add(key)
        local = _local_chunks(archive, key, value)
        if local is None:
            if key in tensors:
                raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor in other ranks' files, not here")
            objects.setdefault(key, ObjectInfo(path, value=value))
            continue
        if key in objects:
            raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor here but not in other ranks' files")
        kind, dtype, shape, chunks = local
        kinds.setdefault(kind, value)
        found.append((key, kind))
        gathered = tensors.get(key)
        if gathered is None:
            gathered = tensors[key] = _Gathered(path, dtype, shape, archive.where)
        elif (gathered.dtype, gathered.shape) != (dtype, shape):
            raise CheckpointError(
                f"{archive.where}: {printable(key)} is {dtype}{list(shape)}, but {gathered.first_file} says "
                f"{gathered.dtype}{list(gathered.shape)}"
            )
        gathered.add(chunks)
    return found


OPTIMIZER = "optimizer"  # the optimizer's entries are read under this root: optimizer.state.<param>.exp_avg
EXTRA_STATE = "extra_state"  # extra_state.lr_scheduler.*, and extra_state.rank_<r>.rng.* of each saving rank


def _read_optimizer(files: CheckpointFiles, world_size: int, present: set[int], model_keys: list[tuple[str, str]],
                    tensors: dict, objects: dict, kinds: dict) -> tuple[list[str], str | None]:
    """The optimizer files, as ``optimizer.state.<param>.<moment>`` laid out like the parameter: lines for
    what is not read, and the form read (one of ``OPTIMIZER_FORMS``).

    ``FSDP.optim_state_dict`` under SHARDED_STATE_DICT (``named``) keys the state by parameter name,
    each moment sharded like its parameter. The plain ``optimizer.state_dict()`` that verl's checkpoint
    manager saves keys it by position: under FSDP2 by the parameter's position among the model's
    parameters (the model file's sharded entries, in order), with DTensor moments; under FSDP1 with
    ``use_orig_params=False`` (``flat``) by the position of the FSDP unit, each moment the rank's
    shard of the unit's flat parameter (``flat_parameters``); with ``use_orig_params=True``
    (``orig``) by the parameter's position, with the rank's 1-D piece of it (a rank holding none of
    it has no entry; one rank holds whole moments).
    """
    missing = [r for r in range(world_size) if r not in present]
    if missing:
        return [f"{files.path(file_name('optim', world_size, missing[0]))}: missing ({len(missing)} of {world_size} "
                "ranks' optimizer files): the optimizer state is not read"], None, None
    params = [key for key, kind in model_keys if kind in ("ShardedTensor", "DTensor")]
    if world_size == 1 and not params:  # one rank saves its parameters as plain tensors, in the model's order
        params = [key for key, kind in model_keys if kind == "plain tensor"]
    shapes = {key: tensors[key].shape for key in params}
    archives = [Archive(files, file_name("optim", world_size, rank)) for rank in range(world_size)]
    roots = []
    for archive in archives:
        root = archive.load()
        if not isinstance(root, dict) or not isinstance(root.get("state"), dict) \
                or not isinstance(root.get("param_groups"), list):
            return [f"{archive.where}: holds no optimizer state dict (state and param_groups): the optimizer "
                    "state is not read"], None, None
        roots.append(root)
    gathered_tensors: dict[str, _Gathered] = {}
    gathered_objects: dict[str, ObjectInfo] = {}
    by_position = [key for root in roots for key in root["state"] if type(key) is not str]
    if by_position and not all(type(key) is int for key in by_position):
        raise CheckpointError(f"{archives[0].where}: optimizer state keyed by something other than names and numbers")
    dtensor_moments = any(_is_dtensor(v) for root in roots for entry in root["state"].values()
                          if isinstance(entry, dict) for v in entry.values())
    form = "named" if not by_position else "fsdp2" if dtensor_moments else "orig"
    owners = [(key,) for key in params]  # the parameters whose state each position holds
    units = flat_parameters(params, {key: math.prod(shape) for key, shape in shapes.items()})
    try:
        if form == "orig" and len(units) < len(params) and all(0 <= i < len(units) for i in by_position):
            form, owners = "flat", [unit.params for unit in units]
            gathered_tensors = _unit_moments(archives, roots, units, shapes)
        if by_position:
            roots = [_by_name(root, archive.where, owners) for root, archive in zip(roots, archives)]
        alignment = None
        if form == "orig" and not (world_size == 1 and _whole_moments(roots[0], shapes)):
            gathered_tensors = _flat_pieces(archives, roots, shapes)
            alignment = _orig_alignment(roots, params, shapes)
        if gathered_tensors:  # the moments are read: the state dicts keep the rest (step)
            roots = [{**root, "state": {name: {k: v for k, v in entry.items() if k not in _moments(root, name)}
                                         for name, entry in root["state"].items()}} for root in roots]
    except _NotRead as exc:
        return [str(exc)], None, None
    _read_part(files, "optim", (OPTIMIZER,), world_size, gathered_tensors, gathered_objects, kinds, roots,
               same_keys=form != "orig")
    for key, gathered in gathered_tensors.items():
        if not (len(gathered.path) == 4 and gathered.path[1] == "state"):
            raise CheckpointError(f"{archives[0].where}: {printable(key)} is not state.<parameter>.<name>")
    tensors.update(gathered_tensors)
    objects.update(gathered_objects)
    return [], form, alignment


# FSDP1 aligns use_orig_params parameters to 16 bytes of the dtype it computes in (_get_aligned_numel):
# float32, a MixedPrecision param_dtype of 2 bytes (verl's bf16), or of 1 byte.
_ALIGNMENTS = (4, 8, 16)


def _orig_alignment(roots: list[dict], params: list[str], shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The alignment (in elements) the saving job's use_orig_params flat parameters had: the one whose layout
    gives every rank exactly the pieces it saved (a MixedPrecision param_dtype changes it), or None."""
    observed = {}
    for rank, root in enumerate(roots):
        for name, entry in root["state"].items():
            lengths = [v.shape[0] for v in entry.values() if isinstance(v, TensorRef) and len(v.shape) == 1] \
                if isinstance(entry, dict) else []
            if lengths:
                observed[(name, rank)] = lengths[0]
    numels = {key: math.prod(shape) for key, shape in shapes.items()}
    for aligned in _ALIGNMENTS:
        units = flat_parameters(params, numels, lambda unit: aligned)
        expected = {(unit.params[index], rank): stop - first for unit in units for rank in range(len(roots))
                    for index, first, stop, _ in unit.on_rank(rank, len(roots))}
        if expected == observed:
            return aligned
    return None


def _whole_moments(root: dict, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether one rank's state holds moments shaped like their parameters (FSDP1 on one rank shards
    nothing: with use_orig_params=True they are whole)."""
    return all(v.shape == shapes[name] for name, entry in root["state"].items() if isinstance(entry, dict)
               for v in entry.values() if isinstance(v, TensorRef) and v.shape)


def _by_name(root: dict, where: str, owners: list[tuple[str, ...]]) -> dict:
    """An optimizer state dict keyed by position, keyed by parameter name instead: position ``i`` holds the
    state of the parameters ``owners[i]`` (one, or the several of an FSDP unit's flat parameter)."""
    named = {}
    for index, entry in root["state"].items():
        if not 0 <= index < len(owners):
            raise _NotRead(f"{where}: holds optimizer state of parameter {index}, but the model files hold "
                           f"{len(owners)} parameters: the optimizer state is not read")
        named.update(dict.fromkeys(owners[index], entry))
    groups = []
    for group in root["param_groups"]:
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < len(owners) for i in ids):
            raise CheckpointError(f"{where}: a param group without the positions of its parameters")
        groups.append({**group, "params": [name for i in ids for name in owners[i]]})
    return {**root, "state": named, "param_groups": groups}


_NOT_PIECES = ("it does not hold FSDP1's use_orig_params=True state (1-D pieces of each parameter): the optimizer "
               "state is not read")


def _unit_moments(archives: list[Archive], roots: list[dict], units: list[FlatParameter],
                  shapes: dict[str, tuple[int, ...]]) -> dict:
    """The moments of FSDP1's flat parameters (``use_orig_params=False``) as chunks of each parameter:
    position ``u`` of rank ``r`` holds the rank's shard of unit ``u``'s flat parameter. Shards of other
    sizes than ``flat_parameters`` computes leave the state unread (never a wrong mapping)."""
    world_size = len(archives)
    positions = sorted(roots[0]["state"])
    gathered: dict[str, _Gathered] = {}
    for rank, (archive, root) in enumerate(zip(archives, roots)):
        if sorted(root["state"]) != positions:
            raise _NotRead(f"{archive.where}: holds the state of other FSDP units than "
                           f"{file_name('optim', world_size, 0)}: the optimizer state is not read")
        for position in positions:
            unit = units[position]
            size = unit.shard_numel(world_size)
            for moment in sorted(_moments(root, position)):
                piece, at_key = root["state"][position][moment], f"state.{position}.{moment}"
                if piece.subclass or piece.shape != (size,) or (size > 1 and piece.stride != (1,)):
                    raise _NotRead(
                        f"{archive.where}: {at_key} is {piece.dtype.name}{list(piece.shape)}, but the flat parameter "
                        f"of FSDP unit {position} ({unit.describe()}) holds {size:,} elements on each of {world_size} "
                        "ranks (use_orig_params=False, each decoder layer a unit of its own, no tied parameters): "
                        "the optimizer state is not read")
                raw = archive.raw_bytes(piece)
                for index, first, stop, at in unit.on_rank(rank, world_size):
                    name = unit.params[index]
                    path = (OPTIMIZER, "state", name, moment)
                    moments = gathered.setdefault(join_path(path), _Gathered(path, piece.dtype.name, shapes[name],
                                                                             archive.where))
                    if moments.dtype != piece.dtype.name:
                        raise CheckpointError(f"{archive.where}: {at_key} is {piece.dtype.name}, other ranks' are "
                                              f"{moments.dtype}")
                    moments.add([Chunk(offsets, sizes, raw.file, raw.offset + (at + element - first) * raw.itemsize,
                                       math.prod(sizes) * raw.itemsize, "raw")
                                 for offsets, sizes, element in _flat_boxes(first, stop, shapes[name])])
    return gathered


def _moments(root: dict, name: str) -> set[str]:
    """The names of a parameter's state entries that are pieces of a tensor (all but scalars such as ``step``)."""
    entry = root["state"][name]
    return {k for k, v in entry.items() if isinstance(v, TensorRef) and v.shape} if isinstance(entry, dict) else set()


def _flat_pieces(archives: list[Archive], roots: list[dict], shapes: dict[str, tuple[int, ...]]) -> dict:
    """Moments saved as 1-D pieces of the flattened parameter, one per rank in rank order, as chunks of the
    parameter's shape: each piece is a run of elements, cut into the boxes it covers."""
    gathered: dict[str, _Gathered] = {}
    for name, shape in shapes.items():
        moment_names = sorted({m for root in roots if name in root["state"] for m in _moments(root, name)})
        for moment in moment_names:
            path = (OPTIMIZER, "state", name, moment)
            start, dtype = 0, None
            chunks = []
            for archive, root in zip(archives, roots):
                piece = root["state"].get(name, {}).get(moment)
                if piece is None:
                    continue
                if piece.subclass or len(piece.shape) != 1 or (piece.shape[0] > 1 and piece.stride != (1,)):
                    raise _NotRead(f"{archive.where}: {join_path(path)} is not a run of elements: {_NOT_PIECES}")
                if dtype not in (None, piece.dtype.name):
                    raise CheckpointError(f"{archive.where}: {join_path(path)} is {piece.dtype.name}, other ranks' "
                                          f"are {dtype}")
                dtype, raw = piece.dtype.name, archive.raw_bytes(piece)
                stop = start + piece.shape[0]
                if stop > math.prod(shape):
                    raise _NotRead(f"{archive.where}: {join_path(path)} holds more elements than its parameter "
                                   f"{list(shape)}: {_NOT_PIECES}")
                for offsets, sizes, first in _flat_boxes(start, stop, shape):
                    where = raw.offset + (first - start) * raw.itemsize
                    chunks.append(Chunk(offsets, sizes, raw.file, where, math.prod(sizes) * raw.itemsize, "raw"))
                start = stop
            if start != math.prod(shape):
                raise _NotRead(f"{archives[0].where}: the ranks' pieces of {join_path(path)} hold {start} of the "
                               f"{math.prod(shape)} elements of its parameter: {_NOT_PIECES}")
            gathered[join_path(path)] = _Gathered(path, dtype, shape, archives[0].where)
            gathered[join_path(path)].add(chunks)
    return gathered


def _flat_boxes(start: int, stop: int, shape: tuple[int, ...]):
    """The boxes ``(offsets, sizes, first element)`` that elements ``[start, stop)`` of a row-major
    ``shape`` fill, each a contiguous run: a partial first row, whole rows, a partial last row (recursively)."""
    if start >= stop:
        return
    if len(shape) <= 1:
        yield (start,) * len(shape), (stop - start,) * len(shape), start
        return
    inner = math.prod(shape[1:])
    row, column = divmod(start, inner)
    last_row, last_column = divmod(stop, inner)
    if row == last_row:
        for offsets, sizes, first in _flat_boxes(column, last_column, shape[1:]):
            yield (row,) + offsets, (1,) + sizes, row * inner + first
        return
    if column:
        for offsets, sizes, first in _flat_boxes(column, inner, shape[1:]):
            yield (row,) + offsets, (1,) + sizes, row * inner + first
        row += 1
    if last_row > row:
        yield (row,) + (0,) * (len(shape) - 1), (last_row - row,) + tuple(shape[1:]), row * inner
    if last_column:
        for offsets, sizes, first in _flat_boxes(0, last_column, shape[1:]):
            yield (last_row,) + offsets, (1,) + sizes, last_row * inner + first


class _NotRead(Exception):
    """A part of the folder that is left out of the checkpoint, with the line that says why."""


def _is_dtensor(value: Any) -> bool:
    if isinstance(value, TensorRef):
        return bool(value.subclass and value.subclass.endswith("DTensor"))
    return isinstance(value, SubclassRef) and value.qualname.endswith("DTensor")


def _read_extra_state(files: CheckpointFiles, world_size: int, present: set[int], tensors: dict,
                      objects: dict) -> list[str]:
    """verl's ``{"lr_scheduler": ..., "rng": ...}``: the scheduler once (rank 0's), the rest under each rank.

    The RNG state belongs to one rank of the saving job: it is read as ``extra_state.rank_<r>.rng``,
    which a new world size drops unless asked to keep it (numpy's RNG state is read as numpy data).
    A file the restricted unpickler refuses is left out with a line.
    """
    gathered_tensors: dict[str, _Gathered] = {}
    gathered_objects: dict[str, ObjectInfo] = {}
    try:
        for rank in sorted(present):
            if rank >= world_size:
                continue
            archive = Archive(files, file_name("extra_state", world_size, rank))
            root = archive.load()
            if not isinstance(root, dict):
                raise _NotRead(f"{archive.where}: holds a {type(root).__name__}, not a dict: extra state not read")
            shared = {k: v for k, v in root.items() if k == "lr_scheduler" and rank == 0}
            own = {k: v for k, v in root.items() if k != "lr_scheduler"}
            for part, prefix in ((shared, (EXTRA_STATE,)), (own, (EXTRA_STATE, f"rank_{rank}"))):
                if part:
                    _gather(archive, part, prefix, gathered_tensors, gathered_objects, {})
    except _NotRead as exc:
        return [str(exc)]
    except CheckpointError as exc:  # a file the restricted unpickler refuses
        return [f"{exc}: the extra state is not read"]
    if len(present) < world_size:
        return [f"{files.path(file_name('extra_state', world_size, min(set(range(world_size)) - present)))}: missing "
                "(the extra state of every rank is needed): the extra state is not read"]
    tensors.update(gathered_tensors)
    objects.update(gathered_objects)
    return []


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


class _Gathered:
    """One tensor's chunks as they come in from the ranks; a replicated copy of a chunk is kept once."""

    def __init__(self, path, dtype, shape, first_file):
        self.path, self.dtype, self.shape, self.first_file = path, dtype, shape, first_file
        self.chunks: list[Chunk] = []
        self._boxes: set = set()

    def add(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            box = (chunk.offsets, chunk.sizes)
            if chunk.numel == 0 or box in self._boxes:
                continue
            self._boxes.add(box)
            self.chunks.append(chunk)


def _local_chunks(archive: Archive, key: str, value: Any):
    """``(kind, dtype, global shape, chunks)`` of one rank's value, or None when it is not a tensor."""
    at = f"{archive.where}: {printable(key)}"
    if isinstance(value, SubclassRef):
        if value.qualname == _SHARDED_TENSOR or _is_sharded_tensor_state(value.state):
            return _sharded_tensor(archive, at, value)
        if value.qualname.endswith("DTensor"):
            return _dtensor(archive, at, value, _slots_state(value.state))
        raise CheckpointError(f"{at} is a {printable(value.qualname)}, not an FSDP1 value")
    if isinstance(value, TensorRef):
        if value.subclass:
            if not value.subclass.endswith("DTensor"):
                raise CheckpointError(f"{at} is a {printable(value.subclass)}, not an FSDP1 value")
            return _dtensor(archive, at, value, _slots_state(value.subclass_state))
        return "plain tensor", value.dtype.name, value.shape, [_chunk(archive, value, (0,) * len(value.shape))]
    return None


def _slots_state(state: Any) -> dict:
    """A subclass's pickled state as one dict: ``(dict_state, slots_state)`` pairs are merged."""
    if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
        return {**(state[0] or {}), **(state[1] or {})}
    return state if isinstance(state, dict) else {}


def _is_sharded_tensor_state(state: Any) -> bool:
    return isinstance(state, tuple) and len(state) == 5 and isinstance(state[0], list)


def _chunk(archive: Archive, ref: TensorRef, offsets: tuple[int, ...]) -> Chunk:
    raw = archive.raw_bytes(ref)
    return Chunk(offsets, raw.shape, raw.file, raw.offset, raw.span, "raw", raw.strides)


def _dims(at: str, what: str, value: Any, itemsize: int = 1) -> tuple[int, ...]:
    """A shape, size or offsets from a pickled state: a list or tuple of integers torch can hold."""
    problem = shape_problem(value, itemsize) if isinstance(value, (tuple, list)) else \
        f"is {with_article(type(value).__name__)}, not a list of integers"
    if problem:
        raise CheckpointError(f"{at}: {what} {problem}")
    return tuple(value)


def _dtype_name(at: str, name: Any) -> str:
    if isinstance(name, str):
        try:
            return dtypes.dtype(name).name
        except CheckpointError:
            pass
    shown = printable(repr(name), 40) if isinstance(name, str) else with_article(type(name).__name__)
    raise CheckpointError(f"{at}: dtype {shown} is not one dcptool reads")


def _sharded_tensor(archive: Archive, at: str, value: SubclassRef):
    """ShardedTensor state: ``(local_shards, ShardedTensorMetadata, pg_state, sharding_spec, init_rrefs)``."""
    if not _is_sharded_tensor_state(value.state):
        raise CheckpointError(f"{at}: ShardedTensor with an unexpected pickled state")
    local_shards, metadata = value.state[0], value.state[1]
    dtype = _property_dtype(metadata)
    chunks = []
    for shard in local_shards:
        tensor, meta = getattr(shard, "tensor", None), getattr(shard, "metadata", None)
        offsets, sizes = getattr(meta, "shard_offsets", None), getattr(meta, "shard_sizes", None)
        if not isinstance(tensor, TensorRef) or tensor.subclass or offsets is None or sizes is None:
            raise CheckpointError(f"{at}: local shard without a tensor and its ShardMetadata")
        if dtype is None:
            dtype = tensor.dtype.name
        offsets, sizes = _dims(at, "shard offsets", offsets), _dims(at, "shard sizes", sizes)
        if tensor.shape != sizes:
            raise CheckpointError(f"{at}: local shard holds {list(tensor.shape)}, but its metadata says {list(sizes)} "
                                  f"at {list(offsets)}")
        chunks.append(_chunk(archive, tensor, offsets))
    if dtype is None and value.args and isinstance(value.args[0], str):
        dtype = value.args[0]
    if dtype is None:
        raise CheckpointError(f"{at}: ShardedTensor without a dtype")
    dtype = _dtype_name(at, dtype)
    shape = _dims(at, "ShardedTensor metadata size", getattr(metadata, "size", None), dtypes.dtype(dtype).itemsize)
    for chunk in chunks:
        if len(chunk.offsets) != len(shape):
            raise CheckpointError(f"{at}: local shard at {list(chunk.offsets)} does not have the {len(shape)} "
                                  f"dimensions of the tensor's size {list(shape)}")
    for shard in local_shards:
        if shard.tensor.dtype.name != dtype:
            raise CheckpointError(f"{at}: local shard is {shard.tensor.dtype.name}, the tensor's properties say {dtype}")
    return "ShardedTensor", dtype, shape, chunks


def _property_dtype(metadata) -> str | None:
    properties = getattr(metadata, "tensor_properties", None)
    state = getattr(properties, "state", None)
    if isinstance(state, tuple) and state and isinstance(state[0], str):  # (dtype, layout, requires_grad, ...)
        return str(state[0])
    value = getattr(properties, "dtype", None)
    return str(value) if isinstance(value, str) else None


def _dtensor(archive: Archive, at: str, value, state: dict):
    """DTensor state: ``_local_tensor`` and ``_spec`` (mesh, placements, tensor_meta with the global shape)."""
    local = state.get("_local_tensor", value if isinstance(value, TensorRef) else None)
    spec = state.get("_spec")
    if not isinstance(local, TensorRef) or local.subclass or spec is None:
        raise CheckpointError(f"{at}: DTensor without its local tensor and spec")
    meta = getattr(spec, "tensor_meta", None)
    shape = getattr(meta, "shape", None)
    args = getattr(meta, "args", None)
    if shape is None and isinstance(args, tuple) and args:
        shape = args[0]
    if not isinstance(shape, (tuple, list)):
        raise CheckpointError(f"{at}: DTensor spec without the global shape (tensor_meta)")
    shape = _dims(at, "DTensor global shape", shape, local.dtype.itemsize)
    placements = getattr(spec, "placements", None) or ()
    if not isinstance(placements, (tuple, list)):
        raise CheckpointError(f"{at}: DTensor placements are {with_article(type(placements).__name__)}, not a list")
    offsets, sizes = _dtensor_box(at, shape, tuple(placements), getattr(spec, "mesh", None))
    if local.shape != sizes:
        raise CheckpointError(
            f"{at}: local tensor is {list(local.shape)}, but placements {_names(placements)} give {list(sizes)}"
        )
    return "DTensor", local.dtype.name, shape, [_chunk(archive, local, offsets)]


def _names(placements) -> list[str]:
    return [type(p).__name__ for p in placements[:8]] + (["..."] if len(placements) > 8 else [])


def _dtensor_box(at: str, shape: tuple, placements: tuple, mesh) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global region a rank's local tensor covers: ``Shard(d)`` splits dim ``d`` torch.chunk style per mesh dim."""
    coordinate = getattr(mesh, "_coordinate_on_dim", None)
    mesh_sizes = _mesh_sizes(mesh)
    if not (isinstance(coordinate, (list, tuple)) and mesh_sizes is not None
            and len(coordinate) == len(mesh_sizes) == len(placements)
            and all(type(i) is int and 0 <= i < n for i, n in zip(coordinate, mesh_sizes))):
        raise CheckpointError(f"{at}: DTensor mesh does not say this rank's coordinate in it")
    offsets, sizes = [0] * len(shape), list(shape)
    for placement, count, index in zip(placements, mesh_sizes, coordinate):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        dim = getattr(placement, "dim", None)
        if kind != "Shard" or type(dim) is not int or not 0 <= dim < len(shape):
            raise CheckpointError(f"{at}: placement {kind} is not supported (placements {_names(placements)})")
        start, length = _torch_chunk_piece(sizes[dim], count, index)
        offsets[dim] += start
        sizes[dim] = length
    return tuple(offsets), tuple(sizes)


def _mesh_sizes(mesh) -> tuple[int, ...] | None:
    """The size of each mesh dim, or None when the pickled mesh does not say (or says nonsense)."""
    layout = getattr(mesh, "_layout", None)
    axes = getattr(layout, "axes", None)
    if isinstance(axes, tuple):  # torch >= 2.9: a _MeshLayout of _FlatLayout axes
        shapes = [getattr(axis, "shape", None) for axis in axes]
        if not all(isinstance(s, (tuple, list)) and shape_problem(s) is None for s in shapes):
            return None
        sizes = tuple(math.prod(s) for s in shapes)
    else:
        tensor = getattr(mesh, "mesh", None)
        if not isinstance(tensor, TensorRef):  # older torch: the mesh tensor itself
            return None
        sizes = tensor.shape
    return sizes if all(n > 0 for n in sizes) else None


def _mesh_facts(value) -> dict | None:
    """What a written DTensor's mesh copies from a source DTensor's: its device type and dim names, when
    it is a 1-D mesh (FSDP1's of the whole world); None otherwise."""
    state = _slots_state(value.subclass_state if isinstance(value, TensorRef) else value.state)
    mesh = getattr(state.get("_spec"), "mesh", None)
    device, names = getattr(mesh, "_device_type", None), getattr(mesh, "_mesh_dim_names", None)
    sizes = _mesh_sizes(mesh)
    if not (sizes is not None and len(sizes) == 1 and isinstance(device, str) and _DEVICE.fullmatch(device)
            and (names is None or (isinstance(names, (tuple, list)) and len(names) == 1
                                   and isinstance(names[0], str) and names[0].isprintable()))):
        return None
    return {"device_type": device, "dim_names": list(names) if names else None}


def _torch_chunk_piece(length: int, count: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of piece ``index`` of ``torch.chunk(length, count)`` (empty past the last piece)."""
    step = -(-length // count)
    start = min(index * step, length)
    return start, min(step, length - start)


def _torch_chunk(length: int, count: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the pieces ``torch.chunk(length, count)`` makes (fewer than ``count`` when uneven)."""
    if length == 0:
        return [(0, 0)] * count
    step = math.ceil(length / count)
    return [(start, min(step, length - start)) for start in range(0, length, step)]


# ---------------------------------------------------------------------------------------------
# FSDP1's flat parameters: the layout of its plain optimizer.state_dict() (checked on torch 2.13)

# verl wraps each decoder layer in an FSDP unit of its own (transformer_auto_wrap_policy over the model's
# decoder-layer class); the root unit holds every other parameter. A parameter belongs to the unit of the
# outermost of these layers its key passes through.
WRAPPED_LAYERS = (
    r"layers\.\d+",  # Llama, Qwen, Mistral, Gemma, DeepSeek: model.layers.N
    r"h\.\d+",  # GPT-2, BLOOM, Falcon: transformer.h.N
    r"blocks\.\d+",  # vision towers: visual.blocks.N
    r"layer\.\d+",  # BERT-style encoders: encoder.layer.N
)
_WRAPPED_LAYER = re.compile(r"(?:.*?\.)?(?:" + "|".join(WRAPPED_LAYERS) + r")\.")


@dataclass(frozen=True)
class FlatParameter:
    """One FSDP unit's flat parameter: its parameters in order, where each starts, and its length.

    As ``FlatParamHandle._init_flat_param_and_metadata`` (torch/distributed/fsdp/_flat_param.py)
    builds it: the unit's parameters flattened and concatenated in module order (the model file's
    order). With ``use_orig_params=True`` each parameter starts at a multiple of ``aligned_numel``
    (``_get_aligned_numel``: 16 bytes of the dtype FSDP1 computes in), the gaps zero padding.
    Sharding pads it with zeros to ``world_size`` equal shards: rank ``r`` holds elements
    ``[r*s, (r+1)*s)``, ``s = ceil(numel / world_size)`` (``_get_shard``); on one rank it is whole.
    """

    params: tuple[str, ...]
    starts: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int  # with the alignment padding, without the padding of the last shard

    @staticmethod
    def of(params: tuple[str, ...], numels: list[int], aligned_numel: int = 0) -> FlatParameter:
        starts, total = [], 0
        for numel in numels:
            if aligned_numel:
                total += -total % aligned_numel
            starts.append(total)
            total += numel
        return FlatParameter(tuple(params), tuple(starts), tuple(numels), total)

    def shard_numel(self, world_size: int) -> int:
        return -(-self.numel // world_size)

    def on_rank(self, rank: int, world_size: int):
        """``(index, first, stop, at)`` for each parameter rank ``rank`` holds elements of: its elements
        ``[first, stop)`` lie at element ``at`` of the rank's shard."""
        size = self.shard_numel(world_size)
        low, high = rank * size, (rank + 1) * size
        for index, (start, numel) in enumerate(zip(self.starts, self.numels)):
            first, stop = max(low, start), min(high, start + numel)
            if first < stop:
                yield index, first - start, stop - start, first - low

    def describe(self) -> str:
        more = f" and {len(self.params) - 1} more parameters" if len(self.params) > 1 else ""
        return f"{self.params[0]}{more}"


def flat_parameters(params: list[str], numels: dict[str, int], aligned_numel=lambda unit: 0) -> list[FlatParameter]:
    """The flat parameters of FSDP1 wrapped as verl wraps it, in the optimizer's order: the root unit's
    (parameters under no ``WRAPPED_LAYERS``) first, then each layer's, as the model lists them.
    ``aligned_numel(unit parameters)``: the alignment of a unit (0: ``use_orig_params=False``)."""
    units: dict[str, list[str]] = {"": []}
    for key in params:
        layer = _WRAPPED_LAYER.match(key)
        units.setdefault(layer.group(0) if layer else "", []).append(key)
    return [FlatParameter.of(tuple(keys), [numels[k] for k in keys], aligned_numel(keys))
            for keys in units.values() if keys]


# ---------------------------------------------------------------------------------------------
# Writing

_ST_API = "torch.distributed._shard.sharded_tensor.api"
_ST_META = "torch.distributed._shard.sharded_tensor.metadata"
_SHARD_META = "torch.distributed._shard.metadata"


_OPTIMIZER_ROOT = re.compile(r"(^|\.)(optim|optimizer)\.")
_PARAM_GROUPS = re.compile(r"(^|\.)(optim|optimizer)\.param_groups(\.(\d+)\.(.+))?$")
# torchtitan and AReaL flatten the optimizer state dict: param_groups.<param>.<setting>, one entry per parameter.
_FLAT_PARAM_GROUP = re.compile(r"(^|\.)(optim|optimizer)\.param_groups\.(?P<param>.+)\.(?P<setting>[^.]+)$")
_SCHEDULER_ROOTS = ("lr_scheduler", "lr_schedulers", "scheduler")
_FILE_OF = {OPTIMIZER: "optim", EXTRA_STATE: "extra_state"}  # the per-rank file each root of entries() goes to
_RANK_ENTRY = re.compile(r"rank_(\d+)$")


def entries(checkpoint: Checkpoint, world_size: int | None = None, dtype: str | None = None,
            include: str | None = None, exclude: str | None = None,
            keep_rank_state: bool = False) -> tuple[list[OutTensor], list[OutObject], dict[str, str]]:
    """What a verl folder of ``world_size`` ranks holds of ``checkpoint``: output tensors and objects, and
    why each entry it leaves out is left out (key -> reason; the summary line groups them).

    The model part goes under its parameter names; optimizer state (``<optim>.state.<param>.<name>``
    of any format: FSDP1, DCP of accelerate, torchtitan or AReaL) under ``optimizer.state``, its
    ``param_groups`` under ``optimizer.param_groups``; the lr scheduler under
    ``extra_state.lr_scheduler``. State of one source rank (``extra_state.rank_<r>``, e.g. its RNG
    state) is left out unless ``keep_rank_state`` (then rank ``r`` of the output gets it, if there is
    one: ``world_size`` None keeps every rank's). ``include`` / ``exclude`` select model weights by name.

    >>> tensors, objects, reasons = entries(open_checkpoint("global_step_10/actor"), 16)   # doctest: +SKIP
    >>> [t.key for t in tensors][-1], reasons                                             # doctest: +SKIP
    ('optimizer.state.lm_head.weight.exp_avg_sq', {'extra_state.rank_0.rng': 'state of single ranks of the source job ...'})
    """

    model = selection.select(selection.model_part(checkpoint), include, exclude)
    if not model:
        raise UsageError(f"{checkpoint.root}: no model weight matches the --include/--exclude filters")
    tensors = selection.out_tensors(model, dtype, keep_paths=False)
    model_objects = selection.model_part(checkpoint, entries=checkpoint.objects)
    objects = [OutObject(k, o.path if o.key == k else (k,), o, checkpoint)
               for k, o in selection.select(model_objects, include, exclude).items()]
    everything = selection.model_part(checkpoint)  # parameters left out by --include/--exclude keep their state out
    used = {id(entry) for entry in [*everything.values(), *model_objects.values()]}
    left_out: dict[str, list[str]] = {}
    flat_groups: dict[str, dict[str, Any]] = {}  # parameter -> its settings, from a flattened state dict
    merged: list[ObjectInfo] = []
    for key, entry in [*checkpoint.tensors.items(), *checkpoint.objects.items()]:
        if id(entry) in used:
            continue
        shape = entry.shape if isinstance(entry, TensorInfo) else None
        flat = _FLAT_PARAM_GROUP.search(key) if shape is None else None
        parameter = selection.WRAPPER_PREFIXES.sub(r"\1", flat.group("param")) if flat else None
        if parameter in everything:
            if parameter in model:
                flat_groups.setdefault(parameter, {})[flat.group("setting")] = checkpoint.object_value(entry)
                merged.append(entry)
            continue
        path, problem = _training_path(key, entry.path, everything, model, shape, selection.WRAPPER_PREFIXES)
        own = _RANK_ENTRY.match(str(path[1])) if path and path[0] == EXTRA_STATE else None
        if own and not keep_rank_state:
            path, problem = None, "state of single ranks of the source job; --keep-rank-state keeps it"
        elif own and world_size is not None and int(own.group(1)) >= world_size:
            path, problem = None, f"state of source ranks that a world size of {world_size} does not have"
        if path is None:
            left_out.setdefault(problem, []).append(key)
        elif shape is None:
            objects.append(OutObject(join_path(path), path, entry, checkpoint))
        else:
            target = dtype if dtype and path[0] == OPTIMIZER and entry.dtype in dtypes.CASTABLE and shape else None
            tensors.append(OutTensor(join_path(path), path, target or entry.dtype, shape, entry))
    if flat_groups:
        groups = _param_groups(flat_groups)
        objects.append(MergedObject(f"{OPTIMIZER}.param_groups", (OPTIMIZER, "param_groups"),
                                    ObjectInfo((OPTIMIZER, "param_groups"), value=groups), checkpoint, merged))
    if not any(obj.path[:2] == (OPTIMIZER, "param_groups") for obj in objects):
        state = [t for t in tensors if t.path[0] == OPTIMIZER]
        if state:
            tensors = [t for t in tensors if t.path[0] != OPTIMIZER]
            left_out.setdefault("optimizer state without its param_groups, which loading it needs", []).extend(
                t.source.key for t in state)
    return tensors, objects, {key: why for why, keys in left_out.items() for key in keys}


@dataclass
class MergedObject(OutObject):
    """An output object made of several entries of the source (``merged``), all of them carried by it."""

    merged: list[ObjectInfo] = field(default_factory=list)


def _param_groups(settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``FSDP.optim_state_dict``'s param_groups from per-parameter settings: parameters with equal
    settings form one group, in the order they come."""
    groups: list[dict[str, Any]] = []
    for parameter, values in settings.items():
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == values), None)
        if group is None:
            group = {**values, "params": []}
            groups.append(group)
        group["params"].append(parameter)
    return groups


def _training_path(key: str, path: tuple, everything: dict, chosen: dict, shape,
                   wrappers: re.Pattern) -> tuple[tuple | None, str]:
    """Where a non-model entry goes in verl's files (a nested path under ``optimizer`` or ``extra_state``),
    or None and why it has no place there. ``wrappers``: the prefixes model names lose (``_orig_mod.``)."""
    if path[0] == EXTRA_STATE and len(path) > 1 and (path[1] == "lr_scheduler" or _RANK_ENTRY.match(str(path[1]))):
        return path, ""
    if path[0] in _SCHEDULER_ROOTS:
        return (EXTRA_STATE, "lr_scheduler") + path[1:], ""
    root = _OPTIMIZER_ROOT.search(key)
    if root is None:
        return None, "verl's files hold the model, the optimizer and the lr scheduler only"
    groups = _PARAM_GROUPS.fullmatch(key, root.start())
    if groups:
        rest = (int(groups.group(4)), groups.group(5)) if groups.group(3) else ()
        return (OPTIMIZER, "param_groups") + rest, ""
    state = key[root.end():]
    if shape is not None and state.startswith("state."):
        parameter, _, name = state[len("state."):].rpartition(".")
        parameter = wrappers.sub(r"\1", parameter)
        if parameter in everything and parameter not in chosen:
            return None, "its parameter is left out"
        if parameter in everything and shape in ((), everything[parameter].shape):
            return (OPTIMIZER, "state", parameter, name), ""
        if parameter in everything:
            return None, f"shape {list(shape)} is neither its parameter's {list(everything[parameter].shape)} nor a scalar"
    return None, "optimizer state verl's files cannot hold (only state.<parameter>.<name> and param_groups)"


@dataclass(frozen=True)
class RankPiece(Piece):
    """A piece of one rank's file: replicated tensors give every rank an equal region, told apart by ``rank``."""

    rank: int
    file: str


OPTIMIZER_FORMS = {  # --optim-form: how the optimizer files hold the state
    "named": "FSDP.optim_state_dict under SHARDED_STATE_DICT, keyed by parameter name (FSDP.optim_state_dict_to_load "
             "loads it)",
    "flat": "optimizer.state_dict() of FSDP1 with use_orig_params=False (verl's default), a flat parameter per "
            "FSDP unit",
    "orig": "optimizer.state_dict() of FSDP1 with use_orig_params=True, a 1-D piece of each parameter per rank",
    "fsdp2": "optimizer.state_dict() of FSDP2 (fully_shard), each moment a DTensor laid out like its parameter",
}
# verl's create_device_mesh: init_device_mesh(device, (world_size,), mesh_dim_names=["fsdp"])
VERL_MESH_DIM_NAMES = ("fsdp",)


def output_forms(checkpoint: Checkpoint, optim_form: str | None = None,
                 model_values: str | None = None) -> tuple[dict[str, Any], str]:
    """The ``Writer`` options that ``--optim-form`` and ``--model-values`` choose, and a line saying what they give.

    Each left out is the source's when the source is a verl folder (its reader records its forms in
    ``info``), else ``named`` and ``sharded-tensor``. ``model_values`` is ``sharded-tensor`` (FSDP1
    built without a device mesh) or ``dtensor[:DEVICE]`` (FSDP1 given verl's 1-D device mesh of the
    world). ``fsdp2`` writes an FSDP2 folder, whose model values are always DTensors (the default
    with it). FSDP loads a DTensor only on a mesh equal to its own (device type, dim names): the mesh
    is on DEVICE, else on the source mesh's device type, else ``cuda``; its dim names are the source
    mesh's, else verl's ``("fsdp",)``.
    """
    source = checkpoint.info if checkpoint.format == NAME else {}
    form = optim_form or source.get("optimizer_form") or "named"
    if form not in OPTIMIZER_FORMS:
        raise UsageError(f"--optim-form {form}: choose {', '.join(OPTIMIZER_FORMS)}")
    values = model_values or ("dtensor" if form == "fsdp2" else source.get("model_values") or "sharded-tensor")
    kind, _, device = values.partition(":")
    if values != "sharded-tensor" and not (kind == "dtensor" and (not device or _DEVICE.fullmatch(device))):
        raise UsageError(f"--model-values {printable(values, 40)}: choose sharded-tensor, dtensor or dtensor:DEVICE "
                         "(e.g. dtensor:cuda)")
    if form == "fsdp2" and kind != "dtensor":
        raise UsageError(f"--model-values {values}: FSDP2's model files hold DTensors, which --optim-form fsdp2 "
                         "needs (--model-values dtensor[:DEVICE])")
    config_dir = checkpoint.info.get("hf_config_dir")
    if form != "named":

        tied = selection.read_config(config_dir).get("tie_word_embeddings") if config_dir else None
        untied = tied is False
        tied_pair = None if untied else _looks_tied(checkpoint)
        if tied is True or tied_pair:
            said = f"{config_dir}/config.json: tie_word_embeddings" if tied is True else \
                f"{checkpoint.root}: {tied_pair[0]} and {tied_pair[1]} hold the same values (tied embeddings)"
            raise UsageError(f"{said}: FSDP holds a tied parameter once among the optimizer's parameters, which "
                             f"--optim-form {form} does not lay out (--optim-form named does)")
    options: dict[str, Any] = {"optim_form": form}
    optimizer = OPTIMIZER_FORMS[form]
    if form == "orig":
        options["orig_alignment"] = source.get("orig_alignment")
        optimizer += (f", parameters aligned to {options['orig_alignment']} elements as in the source"
                      if options["orig_alignment"] else
                      ", parameters aligned for their own dtype (a MixedPrecision param_dtype would move them: resume "
                      "from a use_orig_params=True save of 2+ ranks to take the alignment from it)")
    said = "ShardedTensor"
    if kind == "dtensor":
        mesh = source.get("mesh")
        names = (tuple(mesh["dim_names"]) if mesh["dim_names"] else None) if mesh else VERL_MESH_DIM_NAMES
        options.update(mesh_device=device or (mesh or {}).get("device_type") or "cuda", mesh_dim_names=names)
        said = f"DTensor on a 1-D {options['mesh_device']} mesh named {names}"
    return options, f"model values: {said}; optimizer: {optimizer}"


_INPUT_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|wte|tok_embeddings|word_embeddings)\.weight$")
_OUTPUT_EMBEDDING = re.compile(r"(^|\.)(lm_head|output|embed_out)\.weight$")


def _looks_tied(checkpoint: Checkpoint) -> tuple[str, str] | None:
    """The input and output embeddings when they hold the same first MiB of values, as tied ones do (the
    files do not record a tie: a tied model saves the one tensor under both names); else None."""

    params = selection.model_part(checkpoint)
    inputs = [k for k in params if _INPUT_EMBEDDING.search(k)]
    outputs = [k for k in params if _OUTPUT_EMBEDDING.search(k)]
    for a in inputs:
        for b in outputs:
            first, second = params[a], params[b]
            if first.shape != second.shape or first.dtype != second.dtype or not first.shape:
                continue
            row = math.prod(first.shape[1:]) * dtypes.dtype(first.dtype).itemsize
            sizes = (max(1, min(first.shape[0], 2**20 // max(row, 1))),) + tuple(first.shape[1:])
            nbytes = math.prod(sizes) * dtypes.dtype(first.dtype).itemsize
            scratch = memoryview(bytearray(max(nbytes, 2**16)))
            values = [checkpoint.region_in(t, (0,) * len(sizes), sizes, bytearray(nbytes), scratch).tobytes()
                      for t in (first, second)]
            if values[0] == values[1]:
                return a, b
    return None


class Writer:
    """Writes verl's per-rank files for every rank, then ``fsdp_config.json`` and ``huggingface/``.

    ``model_world_size_{W}_rank_{r}.pt``: every tensor split on dim 0 as FSDP1's ``SHARDED_STATE_DICT``
    splits it (``torch.chunk`` over ``world_size``) and stored as the ``ShardedTensor`` rank ``r``
    pickles, or with ``mesh_device`` the ``DTensor`` of FSDP1 given a 1-D device mesh of that device
    type named ``mesh_dim_names``; tensors of shape ``()`` and those whose key matches ``replicate``
    (a regular expression, for buffers FSDP does not shard) go into every rank's file as plain
    tensors. Objects go into every file unchanged, nested again under their paths as the reader
    flattened them. On one rank (NO_SHARD) every tensor is plain, as FSDP1 saves it there; FSDP2
    (``optim_form`` ``fsdp2``) keeps DTensors on a mesh of one rank.

    ``optim_world_size_{W}_rank_{r}.pt`` (entries under ``optimizer``), as ``optim_form`` says:
    ``named``: what ``FSDP.optim_state_dict`` gives under SHARDED_STATE_DICT, ``{"state": {param:
    {"step": t, "exp_avg": <sharded like the parameter>, ...}}, "param_groups": [...]}``, which
    ``FSDP.optim_state_dict_to_load`` takes; ``flat`` and ``orig``: the plain ``optimizer.state_dict()``
    of FSDP1 with ``use_orig_params`` False or True, ``fsdp2``: that of FSDP2 (``PlainOptimizer``), which
    verl's ``optimizer.load_state_dict`` takes as it is. ``extra_state_world_size_{W}_rank_{r}.pt``
    (entries under ``extra_state``): ``{"lr_scheduler": ...}`` in every file, plus what source rank
    ``r`` saved of its own (``extra_state.rank_<r>``, e.g. its RNG state) where ``entries`` kept it.
    ``hf_config_dir`` is copied to ``huggingface/``.

    Each file is its pickle first and its storages streamed after it; the files are independent.
    """

    NEEDS_CRC = True

    def __init__(self, folder: Path, world_size: int = 1, replicate: str | None = None,
                 hf_config_dir: str | Path | None = None, optim_form: str = "named", mesh_device: str | None = None,
                 mesh_dim_names: tuple[str, ...] | None = VERL_MESH_DIM_NAMES, orig_alignment: int | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"fsdp1 world_size must be a positive integer, not {world_size!r}")
        if optim_form not in OPTIMIZER_FORMS:
            raise UsageError(f"fsdp1 optim_form {optim_form!r}: choose {', '.join(OPTIMIZER_FORMS)}")
        if optim_form == "fsdp2" and mesh_device is None:
            raise UsageError("fsdp1 optim_form 'fsdp2' needs a mesh_device: FSDP2's model values are DTensors")
        self.folder, self.world_size, self.optim_form = Path(folder), world_size, optim_form
        self.fsdp_version = 2 if optim_form == "fsdp2" else 1  # fsdp_config.json's FSDP_version, as verl writes it
        self.mesh_device, self.mesh_dim_names = mesh_device, mesh_dim_names
        self.orig_alignment = orig_alignment
        self.out = OutputFiles(folder)
        self.replicate = re.compile(replicate) if replicate else None
        self.hf_config_dir = hf_config_dir
        self._pieces: list[RankPiece] = []
        self._storages: dict[str, list[StorageOut]] = {}  # file -> its storages, in order
        # (file, storage key) -> its pieces at byte offsets; its bytes known when planning (a mesh's rank map)
        self._parts: dict[tuple[str, str], list[tuple[int, RankPiece]]] = {}
        self._fixed: dict[tuple[str, str], bytes] = {}
        self._at: dict[RankPiece, tuple[str, int]] = {}  # piece -> (its storage, byte offset in it)
        self._meshes: dict[str, Reduced] = {}  # file -> the one device mesh its DTensors share
        self._archives: dict[str, ArchiveLayout] = {}
        self._start_of: dict[tuple[str, str], int] = {}  # (file, storage key) -> where its bytes start

    def _replicated(self, tensor) -> bool:
        # FSDP1 on one rank runs NO_SHARD, whose SHARDED_STATE_DICT holds plain tensors; FSDP2 keeps DTensors.
        return (self.world_size == 1 and self.fsdp_version == 1) or not tensor.shape \
            or bool(self.replicate and self.replicate.search(tensor.key))

    def _part(self, entry, rank: int) -> tuple[str, tuple] | None:
        """``(file kind, path inside the file)`` of an entry in rank ``rank``'s files; None if that rank has none of it."""
        path = tuple(entry.path)
        if path[0] == OPTIMIZER:
            return _FILE_OF[OPTIMIZER], path[1:]
        if path[0] == EXTRA_STATE:
            own = _RANK_ENTRY.match(str(path[1]))
            if own is None:
                return "extra_state", path[1:]
            if int(own.group(1)) >= self.world_size:
                raise UsageError(f"{entry.key}: state of source rank {own.group(1)}, which a world size of "
                                 f"{self.world_size} does not have (fsdp1.entries leaves it out)")
            return ("extra_state", path[2:]) if int(own.group(1)) == rank else None
        return "model", (entry.key,) if isinstance(entry, OutTensor) else path

    def plan(self, tensors, objects):
        plain = None
        if self.optim_form != "named" and any(e.path[0] == OPTIMIZER for e in [*tensors, *objects]):
            parameters = [t for t in tensors if t.path[0] not in _FILE_OF and t.shape
                          and not (self.replicate and self.replicate.search(t.key))]
            plain = PlainOptimizer(self.optim_form, parameters, tensors, objects, self.world_size, self.orig_alignment)
        kinds = ["model"] + sorted({_FILE_OF[e.path[0]] for e in [*tensors, *objects] if e.path[0] in _FILE_OF})
        for rank in range(self.world_size):
            entries: dict[str, dict[tuple, Any]] = {kind: {} for kind in kinds}
            for entry in [*tensors, *objects]:
                part = self._part(entry, rank)
                if part is None or (plain and entry.path[0] == OPTIMIZER):
                    continue
                kind, inside = part
                if inside in entries[kind]:
                    raise UsageError(f"{entry.key}: two entries have this key")
                name = file_name(kind, self.world_size, rank)
                if not isinstance(entry, OutTensor):
                    entries[kind][inside] = entry.value()
                elif self._replicated(entry) or kind == "extra_state":
                    entries[kind][inside] = self.whole(entry, rank, name)
                else:
                    entries[kind][inside] = self.sharded(entry, rank, name)
            extra = entries.get("extra_state")
            if extra is not None and not any(path[0] == "lr_scheduler" for path in extra):
                extra[("lr_scheduler",)] = None  # verl's load_checkpoint reads extra_state["lr_scheduler"]
            trees = {kind: nest(nested) for kind, nested in entries.items()}
            if plain:  # keyed by numbers, which nest() would make a list
                trees["optim"] = plain.state_dict(self, rank, file_name("optim", self.world_size, rank))
            for kind, tree in trees.items():
                name = file_name(kind, self.world_size, rank)
                archive = ArchiveLayout(dumps(tree), name[: -len(".pt")])
                for storage in self._storages.get(name, []):
                    start = archive.add_storage(storage.key, storage.numel * dtypes.dtype(storage.dtype).itemsize)
                    self._start_of[(name, storage.key)] = start
                archive.close()
                self._archives[name] = archive
        return self._pieces

    def stored(self, file: str, dtype: str, shape, parts: list[tuple[RankPiece, int]]) -> TensorOut:
        """A contiguous tensor of ``file`` made of ``parts`` (a piece and the element it starts at); zeros elsewhere."""
        storage = self._storage(file, dtype, math.prod(shape))
        itemsize = dtypes.dtype(dtype).itemsize
        placed = [(at * itemsize, piece) for piece, at in parts if piece.nbytes]
        self._parts[(file, storage.key)] = placed
        for offset, piece in placed:
            self._at[piece] = (storage.key, offset)
            self._pieces.append(piece)
        return TensorOut(storage, tuple(shape))

    def whole(self, tensor: OutTensor, rank: int, file: str) -> TensorOut:
        """All of ``tensor`` as a plain tensor of ``file``."""
        piece = RankPiece(tensor, (0,) * len(tensor.shape), tuple(tensor.shape), rank, file)
        return self.stored(file, tensor.dtype, tensor.shape, [(piece, 0)])

    def sharded(self, tensor: OutTensor, rank: int, file: str) -> Reduced:
        """Rank ``rank``'s rows of ``tensor`` (``torch.chunk`` on dim 0) as the ShardedTensor or DTensor FSDP1 saves."""
        shards = _torch_chunk(tensor.shape[0], self.world_size)
        start, rows = shards[rank] if rank < len(shards) else (tensor.shape[0], 0)
        sizes = (rows,) + tuple(tensor.shape[1:])
        piece = RankPiece(tensor, (start,) + (0,) * (len(tensor.shape) - 1), sizes, rank, file)
        if self.mesh_device is None:  # a rank past the last chunk holds no local shard
            local = self.stored(file, tensor.dtype, sizes, [(piece, 0)]) if rank < len(shards) else None
            return sharded_tensor(tensor.dtype, tensor.shape, rank, self.world_size, local)
        local = self.stored(file, tensor.dtype, sizes, [(piece, 0)])  # a DTensor's may hold no rows
        return dtensor(tensor.dtype, tensor.shape, self._mesh(file, rank), local)

    def _mesh(self, file: str, rank: int) -> Reduced:
        mesh = self._meshes.get(file)
        if mesh is None:
            rank_map = self._storage(file, "int32", self.world_size)
            self._fixed[(file, rank_map.key)] = struct.pack(f"<{self.world_size}i", *range(self.world_size))
            mesh = self._meshes[file] = device_mesh(self.world_size, rank, self.mesh_device, self.mesh_dim_names,
                                                    TensorOut(rank_map, (self.world_size,)))
        return mesh

    def place(self, piece: RankPiece) -> tuple[str, int]:
        storage, offset = self._at[piece]
        return piece.file, self._start_of[(piece.file, storage)] + offset

    def files(self) -> dict[str, int]:
        """Every rank's files with the tensor bytes planned for them."""
        sizes = dict.fromkeys(self._archives, 0)
        for piece in self._pieces:
            sizes[piece.file] += piece.nbytes
        return sizes

    def _storage(self, name: str, dtype: str, numel: int) -> StorageOut:
        storages = self._storages.setdefault(name, [])
        storage = StorageOut(str(len(storages)), dtype, numel)
        storages.append(storage)
        return storage

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Write everything but the pieces' bytes into ``files``; nothing to report."""
        for name, archive in self._archives.items():
            if name in files:
                by_storage = {storage.key: self._fill(name, storage, crcs) for storage in self._storages.get(name, [])}
                for offset, data in archive.segments(by_storage):
                    self.out.write_at(name, offset, data)
        return {}

    def _fill(self, name: str, storage: StorageOut, crcs) -> int:
        """Write the bytes of a storage that no piece brings (a rank map; the zeros that pad a flat parameter)
        and return the CRC-32 of all its bytes."""
        start = self._start_of[(name, storage.key)]
        fixed = self._fixed.get((name, storage.key))
        if fixed is not None:
            self.out.write_at(name, start, fixed)
            return crc32(fixed)
        crc, done = 0, 0
        end = storage.numel * dtypes.dtype(storage.dtype).itemsize
        for offset, piece in sorted(self._parts[(name, storage.key)], key=lambda part: part[0]) + [(end, None)]:
            if offset > done:
                zeros = bytes(offset - done)
                self.out.write_at(name, start + done, zeros)
                crc = crc32_combine(crc, crc32(zeros), len(zeros)) if done else crc32(zeros)
                done = offset
            if piece is not None:
                crc = crc32_combine(crc, crcs[piece], piece.nbytes) if offset else crcs[piece]
                done = offset + piece.nbytes
        return crc

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """``fsdp_config.json`` with the new world size and the copied ``huggingface/``; nothing is left out here."""
        if self.hf_config_dir is not None:
            (self.folder / HF_DIR).mkdir()
            copy_config(self.hf_config_dir, self.folder / HF_DIR)
        config = {"FSDP_version": self.fsdp_version, "world_size": self.world_size}
        (self.folder / CONFIG).write_text(json.dumps(config) + "\n")
        return []


class PlainOptimizer:
    """The optimizer entries as FSDP's plain ``optimizer.state_dict()`` holds them on each rank, keyed by
    position among the optimizer's parameters (param group after param group, each in the model's order).

    ``flat`` (``use_orig_params=False``): a position per FSDP unit (``flat_parameters``), each moment
    the rank's shard of the unit's flat parameter, zeros where FSDP1 pads it; the unit's scalars
    (``step``) are its first parameter's, as FSDP1 keeps one per flat parameter. ``orig``
    (``use_orig_params=True``): a position per parameter, with an entry on each rank whose shard holds
    some of it, each moment that 1-D piece, the flat parameter aligned for the parameters' own dtype
    (FSDP1 without a MixedPrecision param_dtype); on one rank the moments are whole. ``fsdp2``
    (``fully_shard``): a position per parameter as with ``orig``, on every rank, each moment the DTensor
    of its parameter's rows (``Writer.sharded``), scalars as saved. ``param_groups`` keep the source's
    settings, their ``params`` numbered so.
    """

    def __init__(self, form: str, parameters: list[OutTensor], tensors, objects, world_size: int,
                 orig_alignment: int | None = None):

        self.form, self.world_size = form, world_size
        dtype_of = {t.key: t.dtype for t in parameters}
        aligned = (lambda unit: 0) if form != "orig" else (lambda unit: orig_alignment) if orig_alignment else \
            (lambda unit: 16 // dtypes.dtype(dtype_of[unit[0]]).itemsize)
        units = flat_parameters([t.key for t in parameters], {t.key: math.prod(t.shape) for t in parameters}, aligned)
        self.state: dict[str, dict[str, OutTensor | OutObject]] = {}
        for entry in [*tensors, *objects]:
            if entry.path[:2] == (OPTIMIZER, "state") and len(entry.path) == 4:
                self.state.setdefault(entry.path[2], {})[entry.path[3]] = entry
        groups = _param_groups_of(objects)
        group_of: dict[str, int] = {}
        for index, group in enumerate(groups):
            for name in group["params"]:
                group_of.setdefault(selection.WRAPPER_PREFIXES.sub(r"\1", name), index)
        # What each position holds, in the order of model.parameters(): flat parameters unit by unit (the
        # root's first); with use_orig_params=True the parameters themselves, as the model lists them.
        model_order = {t.key: number for number, t in enumerate(parameters)}
        members = [(unit, None) for unit in units] if form == "flat" else sorted(
            ((unit, index) for unit in units for index in range(len(unit.params))),
            key=lambda member: model_order[member[0].params[member[1]]])
        ordered = []
        for unit, index in members:
            names = unit.params if index is None else (unit.params[index],)
            found = {group_of.get(name) for name in names}
            if len(found) > 1:
                raise UsageError(f"optimizer.param_groups: the parameters of the FSDP unit of {unit.describe()} are "
                                 "in several param groups, which one flat parameter cannot be (--optim-form orig or "
                                 "named)")
            if found == {None}:
                stateful = next((name for name in names if name in self.state), None)
                if stateful:
                    raise UsageError(f"optimizer.state.{stateful}: its parameter is in no param group")
                continue  # not a parameter of the optimizer (frozen)
            if index is None:
                self._check_unit(unit)
            ordered.append((found.pop(), unit, index))
        ordered.sort(key=lambda member: member[0])  # stable: the model's order within a group
        self.positions = [(unit, index) for _, unit, index in ordered]
        self.groups = [{**{k: v for k, v in group.items() if k != "params"},
                        "params": [p for p, (g, _, _) in enumerate(ordered) if g == number]}
                       for number, group in enumerate(groups)]

    def _check_unit(self, unit: FlatParameter) -> None:
        """A flat parameter's moments: the same names and dtypes for each of its parameters, or none at all."""
        def moments(name):
            return {k: v.dtype for k, v in self.state.get(name, {}).items() if isinstance(v, OutTensor) and v.shape}

        first = moments(unit.params[0])
        for name in unit.params[1:]:
            if moments(name) != first:
                raise UsageError(f"optimizer.state.{name}: FSDP1 keeps one state per flat parameter, but the "
                                 f"parameters of the FSDP unit of {unit.describe()} have different state "
                                 f"({sorted(moments(name).items())} and {sorted(first.items())})")

    def state_dict(self, writer: Writer, rank: int, file: str) -> dict:
        """Rank ``rank``'s ``optimizer.state_dict()``; its tensors planned into ``file`` by ``writer``."""
        state = {}
        for position, (unit, index) in enumerate(self.positions):
            first = self.state.get(unit.params[0 if index is None else index])
            if self.form == "fsdp2":  # every rank holds every parameter's state, DTensors like the parameter
                if first:
                    state[position] = {name: value.value() if isinstance(value, OutObject) else
                                       writer.sharded(value, rank, file) if value.shape else
                                       writer.whole(value, rank, file) for name, value in first.items()}
                continue
            runs = [run for run in unit.on_rank(rank, self.world_size) if index is None or run[0] == index]
            if not first or (index is not None and not runs):  # a flat shard of padding only still has its state
                continue
            length = unit.shard_numel(self.world_size) if index is None else runs[0][2] - runs[0][1]
            base = 0 if index is None else runs[0][3]  # where the stored run starts in the rank's shard
            entry = {}
            for name, value in first.items():
                if isinstance(value, OutObject):
                    entry[name] = value.value()
                elif not value.shape or (index is not None and self.world_size == 1):  # scalars; orig on one rank
                    entry[name] = writer.whole(value, rank, file)
                else:
                    parts = []
                    for i, begin, stop, at in runs:
                        moment = self.state[unit.params[i]][name]
                        parts += [(RankPiece(moment, offsets, sizes, rank, file), at - base + element - begin)
                                  for offsets, sizes, element in _flat_boxes(begin, stop, moment.shape)]
                    entry[name] = writer.stored(file, value.dtype, (length,), parts)
            state[position] = entry
        return {"state": state, "param_groups": self.groups}


def _param_groups_of(objects: list[OutObject]) -> list[dict]:
    """The optimizer's param_groups, each naming its parameters, from the objects under ``optimizer.param_groups``."""
    found = {obj.path[1:]: obj.value() for obj in objects if obj.path[:2] == (OPTIMIZER, "param_groups")}
    groups = nest(found)["param_groups"] if found else []
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                             and all(isinstance(n, str) for n in g["params"]) for g in groups)):
        raise UsageError("optimizer.param_groups: not a list of param groups naming their parameters, which the plain "
                         "optimizer.state_dict() of --optim-form flat and orig numbers")
    return groups


_WRAPPER_SUBCLASS = (Global("torch._tensor", "_rebuild_from_type_v2"),
                     Global("torch._utils", "_rebuild_wrapper_subclass"))


def _wrapper_subclass(cls: Global, dtype: str, shape: tuple[int, ...], state: Any) -> Reduced:
    """How torch pickles a wrapper tensor subclass of ``shape`` on the CPU: ``_rebuild_from_type_v2(
    _rebuild_wrapper_subclass, cls, (cls, dtype, size, stride, 0, strided, cpu, False), state)``."""
    device = Reduced(Global("torch", "device"), ("cpu",))
    layout = Reduced(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    args = (cls, Global("torch", dtype), shape, row_major(shape), 0, layout, device, False)
    return Reduced(_WRAPPER_SUBCLASS[0], (_WRAPPER_SUBCLASS[1], cls, args, state))


def sharded_tensor(dtype: str, shape, rank: int, world_size: int, local: TensorOut | None) -> Reduced:
    """The pickle of the ``ShardedTensor`` FSDP1 builds on ``rank`` (``_create_chunk_sharded_tensor``): its
    state is ``ShardedTensor.__getstate__()``, ``(local_shards, ShardedTensorMetadata, ProcessGroupState,
    ChunkShardingSpec, False)``.
    """
    shape = tuple(int(n) for n in shape)
    device = Reduced(Global("torch", "device"), ("cpu",))
    layout = Reduced(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    torch_dtype = Global("torch", dtype)
    placements, shard_metadata = [], []
    for index, (start, rows) in enumerate(_torch_chunk(shape[0], world_size)):
        placement = new_object("torch.distributed.remote_device", "_remote_device",
                               {"_worker_name": None, "_rank": index, "_device": device})
        placements.append(placement)
        shard_metadata.append(new_object(_SHARD_META, "ShardMetadata", (None, {
            "shard_offsets": [start] + [0] * (len(shape) - 1),
            "shard_sizes": [rows] + list(shape[1:]),
            "placement": placement,
        })))
    properties = new_object(_ST_META, "TensorProperties", (
        torch_dtype, layout, False, Reduced(Global(_ST_META, "MEM_FORMAT_ENCODING"), (0,)), False))
    metadata = new_object(_ST_META, "ShardedTensorMetadata", {
        "shards_metadata": shard_metadata, "size": torch_size(shape), "tensor_properties": properties})
    local_shards = []
    if local is not None:
        local_shards.append(new_object("torch.distributed._shard.sharded_tensor.shard", "Shard",
                                       (None, {"tensor": local, "metadata": shard_metadata[rank]})))
    process_group = Reduced(Global("copyreg", "__newobj__"), (
        Reduced(Global("__builtin__", "getattr"), (Global(_ST_API, "ShardedTensor"), "ProcessGroupState")),
    ), {"local_rank": rank, "global_rank": rank, "local_world_size": world_size, "global_world_size": world_size})
    spec = new_object("torch.distributed._shard.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec",
                      {"dim": 0, "placements": placements})
    return _wrapper_subclass(Global(_ST_API, "ShardedTensor"), dtype, shape,
                             (local_shards, metadata, process_group, spec, False))


_DTENSOR_SPEC = "torch.distributed.tensor._dtensor_spec"
_MESH_LAYOUT = "torch.distributed._mesh_layout"


def dtensor(dtype: str, shape, mesh: Reduced, local: TensorOut) -> Reduced:
    """The pickle of the ``DTensor`` that FSDP1 given a 1-D device mesh saves (``_create_chunk_dtensor``):
    the rank's rows (``Shard(0)``, ``torch.chunk`` style; none past the last chunk) on ``mesh``
    (``device_mesh``). Its state is ``(None, {"_local_tensor", "_spec"})``; the ``DTensorSpec`` is
    torch 2.13's, its cached ``_hash`` left unset (torch computes it when first needed).
    """
    shape = tuple(int(n) for n in shape)
    newobj = Global("copyreg", "__newobj__")
    spec = new_object(_DTENSOR_SPEC, "DTensorSpec", {
        "mesh": mesh,
        "placements": (new_object("torch.distributed.tensor.placement_types", "Shard", {"dim": 0}),),
        "tensor_meta": Reduced(newobj, (Global(_DTENSOR_SPEC, "TensorMeta"), torch_size(shape), row_major(shape),
                                        Global("torch", dtype))),
        "shard_order": (Reduced(newobj, (Global(_DTENSOR_SPEC, "ShardOrderEntry"), 0, (0,))),),
        "use_strided_shard_as_shard_order": False,
        "_hash": None,
    })
    return _wrapper_subclass(Global("torch.distributed.tensor", "DTensor"), dtype, shape,
                             (None, {"_local_tensor": local, "_spec": spec}))


def device_mesh(world_size: int, rank: int, device_type: str, dim_names: tuple[str, ...] | None,
                rank_map: TensorOut) -> Reduced:
    """The pickle of a 1-D ``DeviceMesh`` of the whole world on ``rank``, as verl makes it for FSDP1
    (``init_device_mesh(device_type, (world_size,), mesh_dim_names=dim_names)``): torch 2.13's
    ``DeviceMesh.__getstate__()``. ``rank_map`` holds ``0..world_size-1`` (int32). Such a mesh's one
    process group is the default group, named ``"0"``; ``_hash`` is left unset as in a mesh never
    hashed (a saved one is the saving process's hash of names, which differs between processes).
    """
    # _FlatLayout keeps a canonical form without dims of size 1: a mesh of one rank has an empty axis.
    axis = {"shape": (world_size,), "stride": (1,)} if world_size > 1 else {"shape": (), "stride": ()}
    layout = new_object(_MESH_LAYOUT, "_MeshLayout", {"axes": (new_object(_MESH_LAYOUT, "_FlatLayout", axis),)})
    return new_object("torch.distributed.device_mesh", "DeviceMesh", {
        "_device_type": device_type,
        "_layout": layout,
        "_rank_map": rank_map,
        "_mesh_dim_names": tuple(dim_names) if dim_names else None,
        "_root_mesh": None,
        "_flatten_rank_map": tuple(range(world_size)),
        "_thread_id": None,
        "_flatten_mapping": {},
        "_dim_group_names": ["0"],
        "_rank": rank,
        "_coordinate_on_dim": (rank,),
        "_hash": None,
    })
