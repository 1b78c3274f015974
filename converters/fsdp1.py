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
``extra_state.rank_<r>.*`` (its RNG state). What cannot be read (FSDP1's flat-parameter
``optimizer.state_dict()``, an extra state the restricted unpickler refuses) is left out with a
line in ``info["not_read"]``.

The writer produces files that a real ``W``-process FSDP1 job loads under
``StateDictType.SHARDED_STATE_DICT`` (its own files, unpickled in full inside the job as verl
does, then ``model.load_state_dict`` and ``optimizer.load_state_dict(FSDP.optim_state_dict_to_load(...))``):
every parameter and moment as the ``ShardedTensor`` that rank ``r`` of ``W`` would have pickled,
written without importing torch. verl's own ``load_checkpoint`` hands the optimizer file to
``optimizer.load_state_dict`` as it is, which for FSDP1 takes only the flat-parameter state of
the same world size and wrapping: a resume at another size loads the optimizer through
``FSDP.optim_state_dict_to_load``. ``entries`` chooses what
goes out of any checkpoint (model, optimizer, scheduler; per-rank state on request).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcptool import dtypes
from dcptool.core import Checkpoint, Chunk, ObjectInfo, OutObject, OutTensor, Piece, TensorInfo, join_path
from dcptool.errors import (CheckpointError, UsageError, json_kind, printable, shape_problem,
                            with_article)
from dcptool.safe_pickle import SubclassRef, TensorRef
from dcptool.storage import CheckpointFiles, OutputFiles
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
    kinds: set[str] = set()
    model_order = _read_part(files, "model", (), world_size, tensors, objects, kinds)
    notes = []
    if ranks["optim"].get(world_size):
        notes += _read_optimizer(files, world_size, ranks["optim"][world_size], model_order, tensors, objects, kinds)
    if ranks["extra_state"].get(world_size):
        notes += _read_extra_state(files, world_size, ranks["extra_state"][world_size], tensors, objects)

    info: dict[str, Any] = {
        "world_size": world_size,
        "optimizer_files": len(ranks["optim"].get(world_size, ())),
        "extra_state_files": len(ranks["extra_state"].get(world_size, ())),
        "values": ", ".join(sorted(kinds)) or None,
        "not_read": notes or None,  # parts of the folder no conversion carries, one line each
    }
    if files.is_file(f"{HF_DIR}/config.json"):  # verl saves the model's config and tokenizer there
        info["hf_config_dir"] = files.path(HF_DIR)
    infos = {key: TensorInfo(g.path, g.dtype, g.shape, g.chunks) for key, g in tensors.items()}
    checkpoint = Checkpoint(NAME, files.location, files, infos, objects, info)
    checkpoint.validate()
    return checkpoint


def _read_part(files: CheckpointFiles, kind: str, prefix: tuple, world_size: int, tensors: dict, objects: dict,
               kinds: set, roots: list[dict] | None = None, same_keys: bool = True) -> list[tuple[str, str]]:
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
            kinds: set) -> list[tuple[str, str]]:
    """Add one rank's entries: tensor chunks to ``tensors``; objects as the first file holding them has them."""
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
        kinds.add(kind)
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
                    tensors: dict, objects: dict, kinds: set) -> list[str]:
    """The optimizer files, as ``optimizer.state.<param>.<moment>`` laid out like the parameter; lines for what is not read.

    Three forms are read. ``FSDP.optim_state_dict`` under SHARDED_STATE_DICT keys the state by
    parameter name, each moment sharded like its parameter. The plain ``optimizer.state_dict()``
    that verl's checkpoint manager saves keys it by the parameter's position among the model's
    parameters (the model file's sharded entries, in order): under FSDP2 with DTensor moments;
    under FSDP1 with ``use_orig_params=True`` with 1-D pieces, rank by rank, of each flattened
    parameter (a rank holding none of it has no entry). FSDP1's flat parameters
    (``use_orig_params=False``) record no parameter names or shapes: left out with a line.
    """
    missing = [r for r in range(world_size) if r not in present]
    if missing:
        return [f"{files.path(file_name('optim', world_size, missing[0]))}: missing ({len(missing)} of {world_size} "
                "ranks' optimizer files): the optimizer state is not read"]
    params = [key for key, kind in model_keys if kind in ("ShardedTensor", "DTensor")]
    if world_size == 1 and not params:  # one rank saves its parameters as plain tensors, in the model's order
        params = [key for key, kind in model_keys if kind == "plain tensor"]
    archives = [Archive(files, file_name("optim", world_size, rank)) for rank in range(world_size)]
    roots = []
    for archive in archives:
        root = archive.load()
        if not isinstance(root, dict) or not isinstance(root.get("state"), dict) \
                or not isinstance(root.get("param_groups"), list):
            return [f"{archive.where}: holds no optimizer state dict (state and param_groups): the optimizer "
                    "state is not read"]
        roots.append(root)
    gathered_tensors: dict[str, _Gathered] = {}
    gathered_objects: dict[str, ObjectInfo] = {}
    by_position = [key for root in roots for key in root["state"] if type(key) is not str]
    if by_position and not all(type(key) is int for key in by_position):
        raise CheckpointError(f"{archives[0].where}: optimizer state keyed by something other than names and numbers")
    pieces = by_position and not any(_is_dtensor(v) for root in roots for entry in root["state"].values()
                                     if isinstance(entry, dict) for v in entry.values())
    if pieces and world_size == 1:  # one rank shards nothing: its moments may be whole, shaped like their parameters
        pieces = not all(0 <= i < len(params) and all(v.shape == tensors[params[i]].shape for v in entry.values()
                                                      if isinstance(v, TensorRef) and v.shape)
                         for i, entry in roots[0]["state"].items() if isinstance(entry, dict))
    try:
        if by_position:
            roots = [_by_name(root, archive.where, params) for root, archive in zip(roots, archives)]
        if pieces:
            gathered_tensors = _flat_pieces(archives, roots, {key: tensors[key].shape for key in params})
            roots = [{**root, "state": {name: {k: v for k, v in entry.items() if k not in _moments(root, name)}
                                         for name, entry in root["state"].items()}} for root in roots]
    except _NotRead as exc:
        return [str(exc)]
    _read_part(files, "optim", (OPTIMIZER,), world_size, gathered_tensors, gathered_objects, kinds, roots,
               same_keys=not pieces)
    for key, gathered in gathered_tensors.items():
        if not (len(gathered.path) == 4 and gathered.path[1] == "state"):
            raise CheckpointError(f"{archives[0].where}: {printable(key)} is not state.<parameter>.<name>")
    tensors.update(gathered_tensors)
    objects.update(gathered_objects)
    return []


def _by_name(root: dict, where: str, params: list[str]) -> dict:
    """An optimizer state dict keyed by parameter position, keyed by parameter name instead."""
    named = {}
    for index, entry in root["state"].items():
        if not 0 <= index < len(params):
            raise _NotRead(f"{where}: holds optimizer state of parameter {index}, but the model files hold "
                           f"{len(params)} parameters: {_FLAT_PARAMETERS}")
        named[params[index]] = entry
    groups = []
    for group in root["param_groups"]:
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < len(params) for i in ids):
            raise CheckpointError(f"{where}: a param group without the positions of its parameters")
        groups.append({**group, "params": [params[i] for i in ids]})
    return {**root, "state": named, "param_groups": groups}


_FLAT_PARAMETERS = ("it holds optimizer.state_dict() of FSDP1 flat parameters (use_orig_params=False), which records "
                    "no parameter names or shapes: the optimizer state is not read (save it with "
                    "FSDP.optim_state_dict(model, optimizer) under SHARDED_STATE_DICT)")


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
                    raise _NotRead(f"{archive.where}: {join_path(path)} is not a run of elements: {_FLAT_PARAMETERS}")
                if dtype not in (None, piece.dtype.name):
                    raise CheckpointError(f"{archive.where}: {join_path(path)} is {piece.dtype.name}, other ranks' "
                                          f"are {dtype}")
                dtype, raw = piece.dtype.name, archive.raw_bytes(piece)
                stop = start + piece.shape[0]
                if stop > math.prod(shape):
                    raise _NotRead(f"{archive.where}: {join_path(path)} holds more elements than its parameter "
                                   f"{list(shape)}: {_FLAT_PARAMETERS}")
                for offsets, sizes, first in _flat_boxes(start, stop, shape):
                    where = raw.offset + (first - start) * raw.itemsize
                    chunks.append(Chunk(offsets, sizes, raw.file, where, math.prod(sizes) * raw.itemsize, "raw"))
                start = stop
            if start != math.prod(shape):
                raise _NotRead(f"{archives[0].where}: the ranks' pieces of {join_path(path)} hold {start} of the "
                               f"{math.prod(shape)} elements of its parameter: {_FLAT_PARAMETERS}")
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
                    _gather(archive, part, prefix, gathered_tensors, gathered_objects, set())
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
    from dcptool import conversion  # conversion imports the registry of formats, which imports this module

    model = conversion.select(conversion.model_part(checkpoint), include, exclude)
    if not model:
        raise UsageError(f"{checkpoint.root}: no model weight matches the --include/--exclude filters")
    tensors = conversion.out_tensors(model, dtype, keep_paths=False)
    model_objects = conversion.model_part(checkpoint, entries=checkpoint.objects)
    objects = [OutObject(k, o.path if o.key == k else (k,), o, checkpoint)
               for k, o in conversion.select(model_objects, include, exclude).items()]
    everything = conversion.model_part(checkpoint)  # parameters left out by --include/--exclude keep their state out
    used = {id(entry) for entry in [*everything.values(), *model_objects.values()]}
    left_out: dict[str, list[str]] = {}
    flat_groups: dict[str, dict[str, Any]] = {}  # parameter -> its settings, from a flattened state dict
    merged: list[ObjectInfo] = []
    for key, entry in [*checkpoint.tensors.items(), *checkpoint.objects.items()]:
        if id(entry) in used:
            continue
        shape = entry.shape if isinstance(entry, TensorInfo) else None
        flat = _FLAT_PARAM_GROUP.search(key) if shape is None else None
        parameter = conversion.WRAPPER_PREFIXES.sub(r"\1", flat.group("param")) if flat else None
        if parameter in everything:
            if parameter in model:
                flat_groups.setdefault(parameter, {})[flat.group("setting")] = checkpoint.object_value(entry)
                merged.append(entry)
            continue
        path, problem = _training_path(key, entry.path, everything, model, shape, conversion.WRAPPER_PREFIXES)
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


class Writer:
    """Writes verl's per-rank files for every rank, then ``fsdp_config.json`` and ``huggingface/``.

    ``model_world_size_{W}_rank_{r}.pt``: every tensor split on dim 0 as FSDP1's ``SHARDED_STATE_DICT``
    splits it (``torch.chunk`` over ``world_size``) and stored as the ``ShardedTensor`` rank ``r``
    pickles; tensors of shape ``()`` and those whose key matches ``replicate`` (a regular expression,
    for buffers FSDP1 does not shard) go into every rank's file as plain tensors. Objects go into
    every file unchanged, nested again under their paths as the reader flattened them.

    On one rank (NO_SHARD) every tensor is plain, as FSDP1 saves it there.

    ``optim_world_size_{W}_rank_{r}.pt`` (entries under ``optimizer``): what ``FSDP.optim_state_dict``
    gives under SHARDED_STATE_DICT, ``{"state": {param: {"step": t, "exp_avg": ShardedTensor, ...}},
    "param_groups": [...]}``, each moment split like its parameter; ``FSDP.optim_state_dict_to_load``
    takes it. ``extra_state_world_size_{W}_rank_{r}.pt`` (entries under ``extra_state``):
    ``{"lr_scheduler": ...}`` in every file, plus what source rank ``r`` saved of its own
    (``extra_state.rank_<r>``, e.g. its RNG state) where ``entries`` kept it. ``hf_config_dir`` is
    copied to ``huggingface/``.

    Each file is its pickle first and its storages streamed after it; the files are independent.
    """

    NEEDS_CRC = True

    def __init__(self, folder: Path, world_size: int = 1, replicate: str | None = None,
                 hf_config_dir: str | Path | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"fsdp1 world_size must be a positive integer, not {world_size!r}")
        self.folder, self.world_size = Path(folder), world_size
        self.out = OutputFiles(folder)
        self.replicate = re.compile(replicate) if replicate else None
        self.hf_config_dir = hf_config_dir
        self._storage_of: dict[RankPiece, StorageOut] = {}
        self._storages: dict[str, list[StorageOut]] = {}
        self._archives: dict[str, ArchiveLayout] = {}
        self._start_of: dict[tuple[str, str], int] = {}  # (file, storage key) -> where its bytes start

    def _replicated(self, tensor) -> bool:
        # FSDP1 on one rank runs NO_SHARD, whose SHARDED_STATE_DICT holds plain tensors.
        return self.world_size == 1 or not tensor.shape or bool(self.replicate and self.replicate.search(tensor.key))

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
        kinds = ["model"] + sorted({_FILE_OF[e.path[0]] for e in [*tensors, *objects] if e.path[0] in _FILE_OF})
        pieces = []
        for rank in range(self.world_size):
            entries: dict[str, dict[tuple, Any]] = {kind: {} for kind in kinds}
            for tensor in tensors:
                part = self._part(tensor, rank)
                if part is None:
                    continue
                kind, inside = part
                name = file_name(kind, self.world_size, rank)
                if inside in entries[kind]:
                    raise UsageError(f"{tensor.key}: two entries have this key")
                if self._replicated(tensor) or kind == "extra_state":
                    piece = RankPiece(tensor, (0,) * len(tensor.shape), tuple(tensor.shape), rank, name)
                    storage = self._storage(name, tensor.dtype, piece.sizes)
                    entries[kind][inside] = TensorOut(storage, piece.sizes)
                else:
                    shards = _torch_chunk(tensor.shape[0], self.world_size)
                    piece = storage = None
                    if rank < len(shards):
                        start, rows = shards[rank]
                        offsets = (start,) + (0,) * (len(tensor.shape) - 1)
                        piece = RankPiece(tensor, offsets, (rows,) + tuple(tensor.shape[1:]), rank, name)
                        storage = self._storage(name, tensor.dtype, piece.sizes)
                    local = TensorOut(storage, piece.sizes) if piece else None
                    entries[kind][inside] = sharded_tensor(tensor.dtype, tensor.shape, rank, self.world_size, local)
                if piece is not None:
                    pieces.append(piece)
                    self._storage_of[piece] = storage
            for obj in objects:
                part = self._part(obj, rank)
                if part is not None:
                    if part[1] in entries[part[0]]:
                        raise UsageError(f"{obj.key}: two entries have this key")
                    entries[part[0]][part[1]] = obj.value()
            extra = entries.get("extra_state")
            if extra is not None and not any(path[0] == "lr_scheduler" for path in extra):
                extra[("lr_scheduler",)] = None  # verl's load_checkpoint reads extra_state["lr_scheduler"]
            for kind, nested in entries.items():
                name = file_name(kind, self.world_size, rank)
                archive = ArchiveLayout(dumps(nest(nested)), name[: -len(".pt")])
                for storage in self._storages.get(name, []):
                    start = archive.add_storage(storage.key, storage.numel * dtypes.dtype(storage.dtype).itemsize)
                    self._start_of[(name, storage.key)] = start
                archive.close()
                self._archives[name] = archive
        return pieces

    def place(self, piece: RankPiece) -> tuple[str, int]:
        return piece.file, self._start_of[(piece.file, self._storage_of[piece].key)]

    def files(self) -> dict[str, int]:
        """Every rank's files with the tensor bytes planned for them."""
        sizes = dict.fromkeys(self._archives, 0)
        for piece in self._storage_of:
            sizes[piece.file] += piece.nbytes
        return sizes

    def _storage(self, name: str, dtype: str, sizes) -> StorageOut:
        storages = self._storages.setdefault(name, [])
        storage = StorageOut(str(len(storages)), dtype, math.prod(sizes))
        storages.append(storage)
        return storage

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Write everything but the storage bytes into ``files``; nothing to report."""
        for name, archive in self._archives.items():
            if name in files:
                by_storage = {self._storage_of[p].key: crc for p, crc in crcs.items() if p.file == name}
                for offset, data in archive.segments(by_storage):
                    self.out.write_at(name, offset, data)
        return {}

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """``fsdp_config.json`` with the new world size and the copied ``huggingface/``; nothing is left out here."""
        if self.hf_config_dir is not None:
            (self.folder / HF_DIR).mkdir()
            copy_config(self.hf_config_dir, self.folder / HF_DIR)
        config = {"FSDP_version": 1, "world_size": self.world_size}
        (self.folder / CONFIG).write_text(json.dumps(config) + "\n")
        return []


def sharded_tensor(dtype: str, shape, rank: int, world_size: int, local: TensorOut | None) -> Reduced:
    """The pickle of the ``ShardedTensor`` FSDP1 builds on ``rank`` (``_create_chunk_sharded_tensor``).

    ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, (cls, dtype, size, stride,
    0, strided, cpu, False), state)`` where ``state`` is ``ShardedTensor.__getstate__()``:
    ``(local_shards, ShardedTensorMetadata, ProcessGroupState, ChunkShardingSpec, False)``.
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
    cls = Global(_ST_API, "ShardedTensor")
    args = (cls, torch_dtype, shape, row_major(shape), 0, layout, device, False)
    return Reduced(Global("torch._tensor", "_rebuild_from_type_v2"), (
        Global("torch._utils", "_rebuild_wrapper_subclass"), cls, args,
        (local_shards, metadata, process_group, spec, False)))

