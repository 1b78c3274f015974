"""A restricted unpickler for the pickles inside checkpoints, which never imports torch or runs their code.

Checkpoints come from other people's jobs, and ``pickle.load`` runs whatever a pickle names
(pytorch/pytorch#189308). This unpickler resolves only the globals in ``ALLOWED`` and maps each
to a small stand-in defined here: DCP metadata classes become ``Record`` objects with the same
attribute names, dtypes become their names, tensors inside ``torch.save`` archives become
``TensorRef`` descriptions of where their bytes are. Any other global is refused with
``UnsafePickleError`` before anything is called.

>>> load_bytes(pickle.dumps({"a": 1}), "x.pkl")
{'a': 1}
>>> load_bytes(pickle.dumps(print), "x.pkl")
Traceback (most recent call last):
dcptool.errors.UnsafePickleError: x.pkl: refuses to unpickle builtins.print, which is not a checkpoint type (nothing was executed)
"""

from __future__ import annotations

import collections
import io
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

from dcptool.dtypes import BY_STORAGE_CLASS, DType, dtype
from dcptool.errors import CheckpointError, UnsafePickleError


class Record:
    """Stand-in for an allowed class: its pickled state becomes attributes (or ``.state`` when not a dict)."""

    qualname = "Record"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and state[0] in (None, {}):
            state = state[1]  # (dict_state, slots_state) from classes with __slots__
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{self.qualname.rsplit('.', 1)[-1]}({fields})"


def _record_class(qualname: str) -> type[Record]:
    def new(cls, *args, **kwargs):  # NEWOBJ passes the constructor's positional args for some classes
        obj = object.__new__(cls)
        if args:
            obj.args = args
        return obj

    return type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname, "__new__": new})


@dataclass(frozen=True)
class StorageRef:
    """A storage of a ``torch.save`` archive: the zip entry ``data/{key}`` holding ``numel`` elements."""

    dtype: DType
    key: str
    numel: int


@dataclass
class TensorRef:
    """A tensor inside a ``torch.save`` archive: a strided view into one storage."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    # Set for tensor subclasses (DTensor, ShardedTensor): the subclass name and its pickled state.
    subclass: str | None = None
    subclass_state: Any = None

    @property
    def dtype(self) -> DType:
        return self.storage.dtype


@dataclass
class SubclassRef:
    """A tensor subclass rebuilt without its class: ``ShardedTensor`` and similar wrappers of local tensors."""

    qualname: str
    args: tuple = ()
    state: Any = field(default=None)

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # torch pickles tensor subclasses (DTensor, Parameter subclasses) as "rebuild base, then set type and state".
    base = func(*args)
    if isinstance(base, TensorRef):
        base.subclass = getattr(new_type, "qualname", str(new_type))
        base.subclass_state = state
        return base
    if isinstance(base, SubclassRef):
        base.state = state
        return base
    raise CheckpointError(f"unexpected tensor subclass payload {type(base).__name__}")


class _Name(str):
    """A torch object that pickles by name (a dtype, a layout, a memory format): kept as its name."""


def _path(*parts: str) -> str:
    return "/".join(p.strip("/") if i else p.rstrip("/") or "/" for i, p in enumerate(parts))


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    # torch pickles ShardedTensor and DTensor as an empty wrapper shell whose state comes afterwards.
    qualname = "torch.distributed._shard.sharded_tensor.api.ShardedTensor" if cls is SubclassRef else getattr(cls, "qualname", None)
    if qualname is None:
        raise CheckpointError(f"unexpected tensor subclass {cls!r:.80}")
    return SubclassRef(qualname, args=(dtype, tuple(size), tuple(stride), storage_offset))


def _getattr(owner, name):
    # Protocol 2 names a nested class as getattr(outer, name); only ShardedTensor.ProcessGroupState is allowed.
    if owner is SubclassRef and name == "ProcessGroupState":
        return ALLOWED["torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"]
    raise UnsafePickleError(f"refuses getattr({owner!r:.60}, {name!r:.60}) (nothing was executed)")


_RECORDS = [
    # DCP metadata
    "torch.distributed.checkpoint.metadata.Metadata",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties",
    "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.planner.WriteItemType",
    # DTensor state (verl's FSDP1 files, DTensor values pickled with torch.save)
    "torch.distributed.tensor._dtensor_spec.DTensorSpec",
    "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor._dtensor_spec.ShardOrderEntry",
    "torch.distributed.tensor.placement_types.Shard",
    "torch.distributed.tensor.placement_types.Replicate",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed.tensor.placement_types.Partial",
    "torch.distributed.device_mesh.DeviceMesh",
    # ShardedTensor state (FSDP1 SHARDED_STATE_DICT saved per rank)
    "torch.distributed._shard.sharded_tensor.shard.Shard",
    "torch.distributed._shard.metadata.ShardMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
    "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
    "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
    "torch.distributed.remote_device._remote_device",
    "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState",
    "torch.distributed._mesh_layout._MeshLayout",  # DeviceMesh state since torch 2.9
    "torch.distributed._mesh_layout._FlatLayout",
]

def _latin1_bytes(text: Any, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles store ``bytes`` (``_codecs.encode(text, "latin1")``, e.g. torchtitan's
    pickled dataloader state); any other use of ``_codecs.encode`` is refused."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not bytes as pickled by torch")
    return text.encode("latin1")


ALLOWED: dict[str, Any] = {name: _record_class(name) for name in _RECORDS}
ALLOWED.update(
    {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.slice": slice,
        "builtins.complex": complex,
        "_codecs.encode": _latin1_bytes,
        "torch.Size": tuple,
        "torch.device": lambda *args: _Name(":".join(str(a) for a in args)),
        "torch.serialization._get_layout": _Name,
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": lambda value: value,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": _rebuild_from_type_v2,
        "torch._utils._rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
        "__builtin__.getattr": _getattr,
        "builtins.getattr": _getattr,
        "torch.distributed._shard.sharded_tensor.api.ShardedTensor": SubclassRef,
        "pathlib.PosixPath": _path,
        "pathlib.WindowsPath": _path,
        "pathlib.PurePosixPath": _path,
        "pathlib.Path": _path,
        "torch.distributed.tensor.DTensor": _record_class("torch.distributed.tensor.DTensor"),
        "torch.distributed.tensor._api.DTensor": _record_class("torch.distributed.tensor.DTensor"),
    }
)
for _d in BY_STORAGE_CLASS.values():
    ALLOWED[f"torch.{_d.storage_class}"] = _d
    ALLOWED[f"torch.{_d.name}"] = _Name(_d.name)
for _alias in ("float", "double", "half", "long", "int", "short", "strided", "sparse_coo", "contiguous_format",
               "channels_last", "preserve_format"):
    ALLOWED[f"torch.{_alias}"] = _Name(_alias)
ALLOWED["torch.storage.UntypedStorage"] = dtype("uint8")
ALLOWED["torch.UntypedStorage"] = dtype("uint8")


class SafeUnpickler(pickle.Unpickler):
    """Unpickles only what ``ALLOWED`` names; storages become ``StorageRef`` (no bytes are read)."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        try:
            return ALLOWED[qualname]
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refuses to unpickle {qualname}, which is not a checkpoint type "
                "(nothing was executed)"
            ) from None

    def persistent_load(self, pid: Any) -> StorageRef:
        # torch.save: ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], DType)):
            raise CheckpointError(f"{self.source}: unexpected persistent id {pid!r:.80}")
        _, storage_dtype, key, _location, numel = pid
        return StorageRef(storage_dtype, str(key), int(numel))


def load_bytes(data: bytes, source: str) -> Any:
    """Unpickle ``data`` with the allowlist; ``source`` names the file in error messages."""
    try:
        return SafeUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except Exception as exc:  # a truncated or malformed pickle
        raise CheckpointError(f"{source}: unreadable pickle ({type(exc).__name__}: {exc})") from exc


def walk(obj: Any, visit: Callable[[Any], None]) -> None:
    """Call ``visit`` on ``obj`` and everything nested in its dicts, lists and tuples."""
    visit(obj)
    if isinstance(obj, dict):
        for value in obj.values():
            walk(value, visit)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            walk(value, visit)
