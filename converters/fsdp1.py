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
Only the model files are read. **Optimizer state (``optim_*``) and ``extra_state_*`` files are
not converted**; ``info`` counts them.

The writer produces files that a real ``W``-process FSDP1 job loads as verl does (its own
files, unpickled in full inside the job, then ``model.load_state_dict``) under
``StateDictType.SHARDED_STATE_DICT``: every parameter as the ``ShardedTensor`` that rank ``r``
of ``W`` would have pickled, written without importing torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcptool import dtypes
from dcptool.core import Checkpoint, Chunk, ObjectInfo, Piece, TensorInfo, join_path
from dcptool.errors import (CheckpointError, UsageError, json_kind, printable, shape_problem,
                            with_article)
from dcptool.safe_pickle import SubclassRef, TensorRef
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.torch_archive import (Archive, ArchiveLayout, Global, Reduced, StorageOut, TensorOut, dumps, new_object,
                                   row_major, torch_size)
from dcptool.converters.torch_save import flatten, nest

NAME = "fsdp1"
WRITES_FOLDER = True
MODEL_ONLY = True  # optimizer state is not converted to per-rank FSDP1 files
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
    keys_of_rank0: list[str] | None = None
    for rank in range(world_size):
        relative = file_name("model", world_size, rank)
        archive = Archive(files, relative)
        root = archive.load()
        if not isinstance(root, dict):
            raise CheckpointError(f"{archive.where}: holds a {type(root).__name__}, not a state dict")
        tensor_keys, seen = [], set()
        for nested, value in flatten(root, where=archive.where):
            key = join_path(nested)
            if key in seen:
                raise CheckpointError(f"{archive.where}: two entries flatten to the key {printable(key)}")
            seen.add(key)
            local = _local_chunks(archive, key, value)
            if local is None:
                if key in tensors:
                    raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor in other ranks' files, not here")
                objects.setdefault(key, ObjectInfo(nested, value=value))
                continue
            if key in objects:
                raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor here but not in other ranks' files")
            kind, dtype, shape, chunks = local
            kinds.add(kind)
            tensor_keys.append(key)
            gathered = tensors.get(key)
            if gathered is None:
                gathered = tensors[key] = _Gathered(nested, dtype, shape, relative)
            elif (gathered.dtype, gathered.shape) != (dtype, shape):
                raise CheckpointError(
                    f"{archive.where}: {printable(key)} is {dtype}{list(shape)}, but {gathered.first_file} says "
                    f"{gathered.dtype}{list(gathered.shape)}"
                )
            gathered.add(chunks)
        if keys_of_rank0 is None:
            keys_of_rank0 = tensor_keys
        elif sorted(tensor_keys) != sorted(keys_of_rank0):
            differ = sorted(set(tensor_keys) ^ set(keys_of_rank0))
            raise CheckpointError(
                f"{archive.where}: holds different tensors than {file_name('model', world_size, 0)} "
                f"(e.g. {printable(differ[0])})"
            )

    info: dict[str, Any] = {
        "world_size": world_size,
        "optimizer_files": len(ranks["optim"].get(world_size, ())),
        "extra_state_files": len(ranks["extra_state"].get(world_size, ())),
        "values": ", ".join(sorted(kinds)) or None,
    }
    if files.is_file(f"{HF_DIR}/config.json"):  # verl saves the model's config and tokenizer there
        info["hf_config_dir"] = files.path(HF_DIR)
    infos = {key: TensorInfo(g.path, g.dtype, g.shape, g.chunks) for key, g in tensors.items()}
    checkpoint = Checkpoint(NAME, files.location, files, infos, objects, info)
    checkpoint.validate()
    return checkpoint


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


@dataclass(frozen=True)
class RankPiece(Piece):
    """A piece of one rank's file: replicated tensors give every rank an equal region, told apart by ``rank``."""

    rank: int


class Writer:
    """Writes ``model_world_size_{W}_rank_{r}.pt`` for every rank, then ``fsdp_config.json``.

    Every tensor is split on dim 0 as FSDP1's ``SHARDED_STATE_DICT`` splits it (``torch.chunk``
    over ``world_size``) and stored as the ``ShardedTensor`` rank ``r`` pickles; tensors of shape
    ``()`` and those whose key matches ``replicate`` (a regular expression, for buffers FSDP1 does
    not shard) go into every rank's file as plain tensors. Objects go into every file unchanged,
    nested again under their paths as the reader flattened them (``note.step`` -> ``{"note": {"step": ..}}``).
    Each file is its pickle first and its storages streamed after it; the files are independent.
    """

    NEEDS_CRC = True

    def __init__(self, folder: Path, world_size: int = 1, replicate: str | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"fsdp1 world_size must be a positive integer, not {world_size!r}")
        self.folder, self.world_size = Path(folder), world_size
        self.out = OutputFiles(folder)
        self.replicate = re.compile(replicate) if replicate else None
        self._storage_of: dict[RankPiece, StorageOut] = {}
        self._storages: list[list] = []
        self._archives: list[ArchiveLayout] = []
        self._start: dict[RankPiece, int] = {}

    def _replicated(self, tensor) -> bool:
        return not tensor.shape or bool(self.replicate and self.replicate.search(tensor.key))

    def plan(self, tensors, objects):
        pieces = []
        for rank in range(self.world_size):
            entries: dict[str, Any] = {}
            rank_pieces = []
            for tensor in tensors:
                if tensor.key in entries:
                    raise UsageError(f"{tensor.key}: two entries have this key")
                if self._replicated(tensor):
                    piece = RankPiece(tensor, (0,) * len(tensor.shape), tuple(tensor.shape), rank)
                    storage = self._storage(rank, tensor.dtype, piece.sizes)
                    entries[tensor.key] = TensorOut(storage, piece.sizes)
                else:
                    shards = _torch_chunk(tensor.shape[0], self.world_size)
                    piece = storage = None
                    if rank < len(shards):
                        start, rows = shards[rank]
                        offsets = (start,) + (0,) * (len(tensor.shape) - 1)
                        piece = RankPiece(tensor, offsets, (rows,) + tuple(tensor.shape[1:]), rank)
                        storage = self._storage(rank, tensor.dtype, piece.sizes)
                    local = TensorOut(storage, piece.sizes) if piece else None
                    entries[tensor.key] = sharded_tensor(tensor.dtype, tensor.shape, rank, self.world_size, local)
                if piece is not None:
                    rank_pieces.append(piece)
                    self._storage_of[piece] = storage
            # Tensors stay under their flat state-dict keys; objects go back under their nested paths.
            nested = {(key,): value for key, value in entries.items()}
            nested |= {obj.path: obj.value() for obj in objects}
            archive = ArchiveLayout(dumps(nest(nested)), file_name("model", self.world_size, rank)[: -len(".pt")])
            for piece in rank_pieces:
                self._start[piece] = archive.add_storage(self._storage_of[piece].key, piece.nbytes)
            archive.close()
            self._archives.append(archive)
            pieces += rank_pieces
        return pieces

    def place(self, piece: RankPiece) -> tuple[str, int]:
        return file_name("model", self.world_size, piece.rank), self._start[piece]

    def files(self) -> dict[str, int]:
        """Every rank's model file with the tensor bytes planned for it."""
        sizes = {file_name("model", self.world_size, rank): 0 for rank in range(self.world_size)}
        for piece in self._storage_of:
            sizes[file_name("model", self.world_size, piece.rank)] += piece.nbytes
        return sizes

    def _storage(self, rank: int, dtype: str, sizes) -> StorageOut:
        while len(self._storages) <= rank:
            self._storages.append([])
        storage = StorageOut(str(len(self._storages[rank])), dtype, math.prod(sizes))
        self._storages[rank].append(storage)
        return storage

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Write everything but the storage bytes into ``files``; nothing to report."""
        for rank, archive in enumerate(self._archives):
            name = file_name("model", self.world_size, rank)
            if name in files:
                by_storage = {self._storage_of[p].key: crc for p, crc in crcs.items() if p.rank == rank}
                for offset, data in archive.segments(by_storage):
                    self.out.write_at(name, offset, data)
        return {}

    def finish_index(self, objects, records: list[dict]) -> list[str]:
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

