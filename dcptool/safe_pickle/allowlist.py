"""What a pickle may name: the allowlist of globals, and the stand-ins they become.

Each allowed global maps to something defined here, never to the class or function it names: torch's
record classes (DCP metadata, DTensor and ShardedTensor state) become ``Record`` subclasses with the
same attribute names, dtypes become their names, storages and tensors of ``torch.save`` archives
become ``StorageRef`` / ``TensorRef`` descriptions of where their bytes are, and the few functions
a checkpoint calls (tensor rebuilds, ``torch.device``, ``pathlib.Path``...) are replaced by checked
ones. A global the machine implements itself (it needs the machine) is a ``Method``.

The list names torch's classes and Python's; a format whose pickles hold classes of their own (an engine's
enums and configs) declares them (``SafeGlobals``) and the format registry adds them (``add_safe_globals``),
as torch's ``add_safe_globals`` lets ``torch.load`` take them: the unpickler names no format.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcptool.dtypes import BY_NAME, BY_STORAGE_CLASS, DType, dtype
from dcptool.errors import SIZE_LIMIT, CheckpointError, printable, shape_problem


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

    def __repr__(self) -> str:  # shallow: a record may share (or nest) other records
        fields = ", ".join(f"{printable(k, 40)}={brief(v)}" for k, v in list(self.__dict__.items())[:12])
        return f"{type(self).qualname.rsplit('.', 1)[-1]}({fields})"


def brief(value: Any) -> str:
    """A short description of a value that never walks into it (for messages and reprs)."""
    if value is None or isinstance(value, (bool, int, float)):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 256 else "<large int>"
        return text
    if isinstance(value, (str, bytes)):
        return printable(repr(value), 60)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"


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


class Bad(Exception):
    """What is wrong with a pickle, without the file's name (``load_bytes`` adds it)."""


class Name(str):
    """A torch object that pickles by name (a dtype, a layout, a memory format): kept as its name."""


SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def checked_count(what: str, value: Any, high: int = SIZE_LIMIT) -> int:
    """A size, offset or stride read from a pickle: an int in ``[0, high)``."""
    if type(value) is not int or not 0 <= value < high:
        raise Bad(f"{what} is {brief(value)}, not an integer in [0, {high})")
    return value


def checked_dims(what: str, value: Any) -> tuple[int, ...]:
    """A size or stride read from a pickle: a list of integers torch can hold, as a tuple."""
    if not isinstance(value, (tuple, list)):
        raise Bad(f"{what} is {brief(value)}, not a list of integers")
    problem = shape_problem(value)
    if problem:
        raise Bad(f"{what} {problem}")
    return tuple(value)


def rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """``torch._utils._rebuild_tensor_v2``: a ``TensorRef`` into a storage, its size and stride checked."""
    if not isinstance(storage, StorageRef):
        raise Bad(f"tensor rebuilt from a {brief(storage)}, not a storage")
    shape, strides = checked_dims("tensor size", size), checked_dims("tensor stride", stride)
    if len(shape) != len(strides):
        raise Bad(f"tensor size has {len(shape)} dimensions but its stride {len(strides)}")
    problem = shape_problem(shape, storage.dtype.itemsize)
    if problem:
        raise Bad(f"tensor size {problem}")
    return TensorRef(storage, checked_count("storage offset", storage_offset), shape, strides)


def rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, dtype_name=None,
                      metadata=None):
    # Dtypes with no legacy storage class (float8, uint16...): bytes of an UntypedStorage, the dtype beside them.
    if not isinstance(dtype_name, Name) or dtype_name not in BY_NAME:
        raise Bad(f"tensor of dtype {brief(dtype_name)}")
    element = BY_NAME[dtype_name]
    if not isinstance(storage, StorageRef) or storage.dtype.name != "uint8" or storage.numel % element.itemsize:
        raise Bad(f"{element.name} tensor rebuilt from {brief(storage)}, not an untyped storage of whole elements")
    typed = StorageRef(element, storage.key, storage.numel // element.itemsize)
    return rebuild_tensor(typed, storage_offset, size, stride)


def rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    """``torch._utils._rebuild_parameter``: the tensor it wraps."""
    return data


def pathlib_path(*parts: str) -> str:
    """``pathlib.Path(*parts)`` (a path some trainers keep in their state): its text."""
    if not all(isinstance(p, str) for p in parts):
        raise Bad("a path made of something other than strings")
    return "/".join(p.strip("/") if i else p.rstrip("/") or "/" for i, p in enumerate(parts))


def latin1_bytes(text: Any, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles store ``bytes`` (``_codecs.encode(text, "latin1")``, e.g. torchtitan's
    pickled dataloader state); any other use of ``_codecs.encode`` is refused."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError(f"_codecs.encode({type(text).__name__}, {brief(encoding)}) is not bytes as pickled by torch")
    return text.encode("latin1")


def torch_device(*args) -> Name:
    """``torch.device(name[, index])``: ``"cuda:0"``."""
    if not 1 <= len(args) <= 2 or not all(type(a) is str and len(a) < 256 or type(a) is int for a in args):
        raise Bad("torch.device with arguments other than a name and an index")
    return Name(":".join(str(a) for a in args))


def torch_layout(name) -> Name:
    """``torch.serialization._get_layout(name)``: the layout's name."""
    if type(name) is not str:
        raise Bad(f"layout {brief(name)} is not a name")
    return Name(name)


def same(value):
    """Functions that give back their argument (``_MEM_FORMAT_ENCODING(0)``: an enum by its value)."""
    return value


# numpy values (the RNG state verl's extra state and HF Trainer's rng_state_*.pth hold): rebuilt here as
# data from checked bytes; no numpy function named by the pickle is called.
NUMPY_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
NDARRAY = Name("numpy.ndarray")  # the class argument of numpy's _reconstruct


class NumpyDtype:
    """``numpy.dtype(code)`` of a numeric code, waiting for its byte order (BUILD gives it)."""

    __slots__ = ("code", "order")

    def __init__(self, code: str):
        self.code, self.order = code, None

    def resolve(self) -> np.dtype:
        if self.order is None:
            raise Bad(f"numpy dtype {self.code} used before its state")
        return np.dtype(self.order + self.code)


class ArrayShell:
    """The empty array numpy's ``_reconstruct`` makes; BUILD replaces it (on the stack and in the memo) by the array."""

    __slots__ = ("memo_from",)

    def __init__(self, memo_from: int):
        self.memo_from = memo_from  # memo slots from here on may hold it


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
    # save plans: some writers keep them in .metadata (Metadata.all_local_plans)
    "torch.distributed.checkpoint.planner.SavePlan",
    "torch.distributed.checkpoint.planner.WriteItem",
    "torch.distributed.checkpoint.planner.TensorWriteData",
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
    # A training run's arguments and the signals it handles, learned here as data: a Namespace's attributes, an
    # enum as its value (``.args``)
    "argparse.Namespace",
    "types.SimpleNamespace",
    "signal.Signals",
]
# Of the records, the ones a writer may pickle back as what they were read as (dcptool.torch_archive's pickler): an
# enum from its value, a namespace (or a dataclass) from its attributes. They are plain data: their classes run
# nothing of the file's. Formats add theirs (``add_safe_globals``).
ENUM_RECORDS = {"signal.Signals"}
NAMESPACE_RECORDS = {"argparse.Namespace", "types.SimpleNamespace"}  # and dataclasses, pickled alike

_DTENSOR = _record_class("torch.distributed.tensor.DTensor")
# The plain classes FSDP1 on one rank names in _rebuild_from_type_v2 (a tensor that FSDP flagged as cloned).
PLAIN_TENSOR_TYPES = (Name("torch.Tensor"), Name("torch.nn.parameter.Parameter"))
PLAIN_TENSOR_STATE_KEYS = frozenset({"_has_been_cloned"})  # FSDP's flag attribute, a bool

ALLOWED: dict[str, Any] = {name: _record_class(name) for name in _RECORDS}
ALLOWED.update(
    {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.slice": slice,
        "builtins.complex": complex,
        "builtins.bytes": bytes,  # protocol 2 pickles b"" as bytes() (an empty numpy array's data)
        "_codecs.encode": latin1_bytes,
        "torch.Size": tuple,
        "torch.device": torch_device,
        "torch.serialization._get_layout": torch_layout,
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": same,
        "torch._utils._rebuild_tensor_v2": rebuild_tensor,
        "torch._utils._rebuild_tensor_v3": rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": "rebuild_from_type",  # methods of the machine (calls.Calls)
        "torch._utils._rebuild_wrapper_subclass": "rebuild_wrapper_subclass",
        "builtins.getattr": "getattr",
        "torch.distributed._shard.sharded_tensor.api.ShardedTensor": SubclassRef,
        "pathlib.PosixPath": pathlib_path,
        "pathlib.WindowsPath": pathlib_path,
        "pathlib.PurePosixPath": pathlib_path,
        "pathlib.Path": pathlib_path,
        "torch.distributed.tensor.DTensor": _DTENSOR,
        "torch.distributed.tensor._api.DTensor": _DTENSOR,
        "torch.Tensor": PLAIN_TENSOR_TYPES[0],
        "torch.nn.parameter.Parameter": PLAIN_TENSOR_TYPES[1],
        "numpy.dtype": "numpy_dtype",
        "numpy.ndarray": NDARRAY,
        "numpy._core.multiarray._reconstruct": "numpy_array",
        "numpy.core.multiarray._reconstruct": "numpy_array",
        "numpy._core.multiarray.scalar": "numpy_scalar",
        "numpy.core.multiarray.scalar": "numpy_scalar",
    }
)
for _d in BY_STORAGE_CLASS.values():
    ALLOWED[f"torch.{_d.storage_class}"] = _d
for _d in BY_NAME.values():
    ALLOWED[f"torch.{_d.name}"] = Name(_d.name)
for _alias in ("float", "double", "half", "long", "int", "short", "strided", "sparse_coo", "contiguous_format",
               "channels_last", "preserve_format"):
    ALLOWED[f"torch.{_alias}"] = Name(_alias)
ALLOWED["torch.storage.UntypedStorage"] = dtype("uint8")
ALLOWED["torch.UntypedStorage"] = dtype("uint8")


class Method(str):
    """A global that the machine itself implements (it needs the machine: calls of other callables, budgets)."""


for _name, _value in list(ALLOWED.items()):
    if type(_value) is str:
        ALLOWED[_name] = Method(_value)

# Callables a pickle may call (REDUCE, NEWOBJ, OBJ), by identity; Record classes are callable too.
FUNCTIONS = {id(f) for f in (latin1_bytes, torch_device, torch_layout, same, rebuild_tensor, rebuild_tensor_v3,
                             rebuild_parameter, pathlib_path)}
RECORD_TYPES = {value for value in ALLOWED.values() if isinstance(value, type) and issubclass(value, Record)}
# What ``check`` walks into: everything else is a leaf (strings, numbers, dtypes, storages, classes).
CONTAINERS = {list, tuple, dict, set, frozenset, collections.OrderedDict, SubclassRef, TensorRef, *RECORD_TYPES}


@dataclass(frozen=True)
class SafeGlobals:
    """Classes a format's pickles may hold beyond torch's and Python's, each read as data: ``records`` as a record
    of its state, ``enums`` as an enum member (its value), ``namespaces`` as a namespace or dataclass (its
    attributes), both also pickled back as what they were; ``read_as``: subclasses read as the allowed class
    they subclass (``{subclass: allowed class}``)."""

    records: tuple[str, ...] = ()
    enums: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    read_as: tuple[tuple[str, str], ...] = ()


def add_safe_globals(declared: SafeGlobals) -> None:
    """Let pickles name the classes ``declared`` (as torch's ``add_safe_globals`` lets ``torch.load`` take them);
    the format registry adds those of every format it loads."""
    for name in (*declared.records, *declared.enums, *declared.namespaces):
        if name not in ALLOWED:
            ALLOWED[name] = _record_class(name)
            RECORD_TYPES.add(ALLOWED[name])
            CONTAINERS.add(ALLOWED[name])
    ENUM_RECORDS.update(declared.enums)
    NAMESPACE_RECORDS.update(declared.namespaces)
    for name, allowed in declared.read_as:
        ALLOWED[name] = ALLOWED[allowed]


def record(qualname: str, state: dict) -> Record:
    """The stand-in of an allowed record class ``qualname`` with ``state`` as its attributes, as unpickling
    one gives (for code that makes records from columns).

    >>> record("torch.distributed.checkpoint.metadata.ChunkStorageMetadata", {"offsets": (0,), "sizes": (4,)})
    ChunkStorageMetadata(offsets=<tuple of 1>, sizes=<tuple of 1>)
    """
    made = object.__new__(ALLOWED[qualname])
    made.__dict__.update(state)
    return made
