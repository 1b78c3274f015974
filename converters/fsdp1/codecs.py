"""The values of FSDP1's files as torch pickles them: ``ShardedTensor``, ``DTensor`` and ``DeviceMesh``.

Decoding (``local_chunks``) turns one rank's pickled value, as the restricted unpickler gives it,
into the chunks of the global tensor it holds; encoding (``sharded_tensor``, ``dtensor``,
``device_mesh``) builds the pickles a rank of FSDP1 (or FSDP2) saves, as torch 2.13 writes them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dcptool import dtypes
from dcptool.engine.chunks import Chunk
from dcptool.errors import CheckpointError, printable, shape_problem, with_article
from dcptool.safe_pickle import SubclassRef, TensorRef
from dcptool.torch_archive import Archive, Global, Reduced, TensorOut, new_object, row_major, torch_size

DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]*")  # a torch device type of a DTensor's mesh: cuda, cpu, npu
# verl's create_device_mesh: init_device_mesh(device, (world_size,), mesh_dim_names=["fsdp"])
VERL_MESH_DIM_NAMES = ("fsdp",)

# ---------------------------------------------------------------------------------------------
# Decoding

_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def is_dtensor(value: Any) -> bool:
    """Whether a pickled value is a DTensor (a tensor of that subclass, or the object it reduces to)."""
    if isinstance(value, TensorRef):
        return bool(value.subclass and value.subclass.endswith("DTensor"))
    return isinstance(value, SubclassRef) and value.qualname.endswith("DTensor")


def local_chunks(archive: Archive, key: str, value: Any):
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


def mesh_facts(value) -> dict | None:
    """What a written DTensor's mesh copies from a source DTensor's: its device type and dim names, when
    it is a 1-D mesh (FSDP1's of the whole world); None otherwise."""
    state = _slots_state(value.subclass_state if isinstance(value, TensorRef) else value.state)
    mesh = getattr(state.get("_spec"), "mesh", None)
    device, names = getattr(mesh, "_device_type", None), getattr(mesh, "_mesh_dim_names", None)
    sizes = _mesh_sizes(mesh)
    if not (sizes is not None and len(sizes) == 1 and isinstance(device, str) and DEVICE_TYPE.fullmatch(device)
            and (names is None or (isinstance(names, (tuple, list)) and len(names) == 1
                                   and isinstance(names[0], str) and names[0].isprintable()))):
        return None
    return {"device_type": device, "dim_names": list(names) if names else None}


def _torch_chunk_piece(length: int, count: int, index: int) -> tuple[int, int]:
    """``(start, size)`` of piece ``index`` of ``torch.chunk(length, count)`` (empty past the last piece)."""
    step = -(-length // count)
    start = min(index * step, length)
    return start, min(step, length - start)


def torch_chunk(length: int, count: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the pieces ``torch.chunk(length, count)`` makes (fewer than ``count`` when uneven)."""
    if length == 0:
        return [(0, 0)] * count
    step = math.ceil(length / count)
    return [(start, min(step, length - start)) for start in range(0, length, step)]


# ---------------------------------------------------------------------------------------------
# Encoding

_ST_API = "torch.distributed._shard.sharded_tensor.api"
_ST_META = "torch.distributed._shard.sharded_tensor.metadata"
_SHARD_META = "torch.distributed._shard.metadata"
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
    for index, (start, rows) in enumerate(torch_chunk(shape[0], world_size)):
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
