"""A restricted unpickler for the pickles inside checkpoints, which never imports torch or runs their code.

Checkpoints come from other people's jobs, and ``pickle.load`` runs whatever a pickle names
(pytorch/pytorch#189308). This unpickler resolves only the globals in ``ALLOWED`` and maps each
to a small stand-in defined here: DCP metadata classes become ``Record`` objects with the same
attribute names, dtypes become their names, tensors inside ``torch.save`` archives become
``TensorRef`` descriptions of where their bytes are, numpy arrays and scalars of numeric dtypes
(RNG state) become numpy values made from their checked bytes. Any other global is refused with
``UnsafePickleError`` before anything is called.

It is its own small pickle machine (not ``pickle.Unpickler``), so that a pickle of N bytes costs
O(N) memory and time whatever it says: memo indices, string and byte lengths are checked against
the pickle's size before anything is allocated; the calls it allows, BUILD and hashing of keys are
charged to a work budget proportional to N; dict and set keys are hashed only when shallow, and
never more than ``MAX_SAME_HASH`` distinct keys with one hash go into one container (hash
flooding). The result is checked before it is returned: no cycles, at most ``MAX_LEVELS`` levels
of nesting, and at most a budget of objects when shared containers are counted at every place
they appear, so that code walking it (flattening, comparing, pickling it again) stays linear and
within Python's recursion limit too.

>>> load_bytes(pickle.dumps({"a": 1}), "x.pkl")
{'a': 1}
>>> load_bytes(pickle.dumps(print), "x.pkl")
Traceback (most recent call last):
dcptool.errors.UnsafePickleError: x.pkl: refuses to unpickle builtins.print, which is not a checkpoint type (nothing was executed)
"""

from __future__ import annotations

import array
import bisect
import codecs
import collections
import gc
import pickle  # noqa: F401 (the doctests)
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dcptool.dtypes import BY_NAME, BY_STORAGE_CLASS, DType, dtype
from dcptool.errors import SIZE_LIMIT, CheckpointError, UnsafePickleError, printable, shape_problem

MAX_DEPTH = 64  # dict and set keys nested deeper than this are refused (hashing them recurses in C)
MAX_LEVELS = 128  # levels of objects in a result (a record's attributes are one or two below it)
WORK_PER_BYTE = 16  # work units (items copied, hashed, set) a pickle may ask for, per byte of it
NODES_PER_BYTE = 16  # objects reachable from the result, shared containers counted where they appear
BASE_ALLOWANCE = 1 << 16  # added to both, so that small pickles with some sharing pass
MAX_INT_BYTES = 1024  # integers larger than 8192 bits are no checkpoint field
MAX_SAME_HASH = 32  # distinct non-string keys with one hash in one dict or set (more is hash flooding)
_LIMIT = SIZE_LIMIT  # sizes, offsets and strides: what torch and the formats can hold


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
        fields = ", ".join(f"{printable(k, 40)}={_brief(v)}" for k, v in list(self.__dict__.items())[:12])
        return f"{type(self).qualname.rsplit('.', 1)[-1]}({fields})"


def _brief(value: Any) -> str:
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


class _Bad(Exception):
    """What is wrong with a pickle, without the file's name (``load_bytes`` adds it)."""


class _Name(str):
    """A torch object that pickles by name (a dtype, a layout, a memory format): kept as its name."""


_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def _count(what: str, value: Any, high: int = _LIMIT) -> int:
    """A size, offset or stride read from a pickle: an int in ``[0, high)``."""
    if type(value) is not int or not 0 <= value < high:
        raise _Bad(f"{what} is {_brief(value)}, not an integer in [0, {high})")
    return value


def _dims(what: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise _Bad(f"{what} is {_brief(value)}, not a list of integers")
    problem = shape_problem(value)
    if problem:
        raise _Bad(f"{what} {problem}")
    return tuple(value)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise _Bad(f"tensor rebuilt from a {_brief(storage)}, not a storage")
    shape, strides = _dims("tensor size", size), _dims("tensor stride", stride)
    if len(shape) != len(strides):
        raise _Bad(f"tensor size has {len(shape)} dimensions but its stride {len(strides)}")
    problem = shape_problem(shape, storage.dtype.itemsize)
    if problem:
        raise _Bad(f"tensor size {problem}")
    return TensorRef(storage, _count("storage offset", storage_offset), shape, strides)


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, dtype_name=None,
                       metadata=None):
    # Dtypes with no legacy storage class (float8, uint16...): bytes of an UntypedStorage, the dtype beside them.
    if not isinstance(dtype_name, _Name) or dtype_name not in BY_NAME:
        raise _Bad(f"tensor of dtype {_brief(dtype_name)}")
    element = BY_NAME[dtype_name]
    if not isinstance(storage, StorageRef) or storage.dtype.name != "uint8" or storage.numel % element.itemsize:
        raise _Bad(f"{element.name} tensor rebuilt from {_brief(storage)}, not an untyped storage of whole elements")
    typed = StorageRef(element, storage.key, storage.numel // element.itemsize)
    return _rebuild_tensor(typed, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _path(*parts: str) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise _Bad("a path made of something other than strings")
    return "/".join(p.strip("/") if i else p.rstrip("/") or "/" for i, p in enumerate(parts))


def _latin1_bytes(text: Any, encoding: str = "latin1") -> bytes:
    """How protocol-2 pickles store ``bytes`` (``_codecs.encode(text, "latin1")``, e.g. torchtitan's
    pickled dataloader state); any other use of ``_codecs.encode`` is refused."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise CheckpointError(f"_codecs.encode({type(text).__name__}, {_brief(encoding)}) is not bytes as pickled by torch")
    return text.encode("latin1")


def _device(*args) -> _Name:
    if not 1 <= len(args) <= 2 or not all(type(a) is str and len(a) < 256 or type(a) is int for a in args):
        raise _Bad("torch.device with arguments other than a name and an index")
    return _Name(":".join(str(a) for a in args))


def _layout(name) -> _Name:
    if type(name) is not str:
        raise _Bad(f"layout {_brief(name)} is not a name")
    return _Name(name)


def _same(value):
    return value


# numpy values (the RNG state verl's extra state and HF Trainer's rng_state_*.pth hold): rebuilt here as
# data from checked bytes; no numpy function named by the pickle is called.
_NUMPY_CODES = frozenset({"b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"})
_NDARRAY = _Name("numpy.ndarray")  # the class argument of numpy's _reconstruct


class _NumpyDtype:
    """``numpy.dtype(code)`` of a numeric code, waiting for its byte order (BUILD gives it)."""

    __slots__ = ("code", "order")

    def __init__(self, code: str):
        self.code, self.order = code, None

    def resolve(self) -> np.dtype:
        if self.order is None:
            raise _Bad(f"numpy dtype {self.code} used before its state")
        return np.dtype(self.order + self.code)


class _ArrayShell:
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

_DTENSOR = _record_class("torch.distributed.tensor.DTensor")
# The plain classes FSDP1 on one rank names in _rebuild_from_type_v2 (a tensor that FSDP flagged as cloned).
_PLAIN_TENSOR_TYPES = (_Name("torch.Tensor"), _Name("torch.nn.parameter.Parameter"))
_PLAIN_TENSOR_STATE_KEYS = frozenset({"_has_been_cloned"})  # FSDP's flag attribute, a bool

ALLOWED: dict[str, Any] = {name: _record_class(name) for name in _RECORDS}
ALLOWED.update(
    {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set,
        "builtins.frozenset": frozenset,
        "builtins.slice": slice,
        "builtins.complex": complex,
        "builtins.bytes": bytes,  # protocol 2 pickles b"" as bytes() (an empty numpy array's data)
        "_codecs.encode": _latin1_bytes,
        "torch.Size": tuple,
        "torch.device": _device,
        "torch.serialization._get_layout": _layout,
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": _same,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
        "torch._tensor._rebuild_from_type_v2": "rebuild_from_type",  # methods of the machine, below
        "torch._utils._rebuild_wrapper_subclass": "rebuild_wrapper_subclass",
        "builtins.getattr": "getattr",
        "torch.distributed._shard.sharded_tensor.api.ShardedTensor": SubclassRef,
        "pathlib.PosixPath": _path,
        "pathlib.WindowsPath": _path,
        "pathlib.PurePosixPath": _path,
        "pathlib.Path": _path,
        "torch.distributed.tensor.DTensor": _DTENSOR,
        "torch.distributed.tensor._api.DTensor": _DTENSOR,
        "torch.Tensor": _PLAIN_TENSOR_TYPES[0],
        "torch.nn.parameter.Parameter": _PLAIN_TENSOR_TYPES[1],
        "numpy.dtype": "numpy_dtype",
        "numpy.ndarray": _NDARRAY,
        "numpy._core.multiarray._reconstruct": "numpy_array",
        "numpy.core.multiarray._reconstruct": "numpy_array",
        "numpy._core.multiarray.scalar": "numpy_scalar",
        "numpy.core.multiarray.scalar": "numpy_scalar",
    }
)
for _d in BY_STORAGE_CLASS.values():
    ALLOWED[f"torch.{_d.storage_class}"] = _d
for _d in BY_NAME.values():
    ALLOWED[f"torch.{_d.name}"] = _Name(_d.name)
for _alias in ("float", "double", "half", "long", "int", "short", "strided", "sparse_coo", "contiguous_format",
               "channels_last", "preserve_format"):
    ALLOWED[f"torch.{_alias}"] = _Name(_alias)
ALLOWED["torch.storage.UntypedStorage"] = dtype("uint8")
ALLOWED["torch.UntypedStorage"] = dtype("uint8")


class _Method(str):
    """A global that the machine itself implements (it needs the machine: calls of other callables, budgets)."""


for _name, _value in list(ALLOWED.items()):
    if type(_value) is str:
        ALLOWED[_name] = _Method(_value)

# Callables a pickle may call (REDUCE, NEWOBJ, OBJ), by identity; Record classes are callable too.
_FUNCTIONS = {id(f) for f in (_latin1_bytes, _device, _layout, _same, _rebuild_tensor, _rebuild_tensor_v3,
                              _rebuild_parameter, _path)}
_RECORD_TYPES = frozenset(value for value in ALLOWED.values() if isinstance(value, type) and issubclass(value, Record))
# What ``check`` walks into: everything else is a leaf (strings, numbers, dtypes, storages, classes).
_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, collections.OrderedDict, SubclassRef, TensorRef,
                         *_RECORD_TYPES})


def _number(text: bytes) -> int:
    """An integer written as text (protocol 0), at most ``MAX_INT_BYTES`` long."""
    if len(text) > 3 * MAX_INT_BYTES:
        raise _Bad(f"an integer of {len(text):,} digits")
    value = int(text, 0)
    if value.bit_length() > 8 * MAX_INT_BYTES:
        raise _Bad(f"an integer of more than {MAX_INT_BYTES} bytes")
    return value


_HOLE = object()  # a memo index never set


def _put(memo: list, index: int, value: Any) -> int:
    """``memo[index] = value``, growing the list with holes; returns 1 when the index was not set before.
    The caller has bounded ``index`` by the pickle's length."""
    if index < len(memo):
        new = memo[index] is _HOLE
        memo[index] = value
        return int(new)
    memo.extend([_HOLE] * (index - len(memo)))
    memo.append(value)
    return 1


def _frame_unpack(fmt: str) -> Callable:
    return struct.Struct(fmt).unpack_from


_U1, _U2, _U4, _U8 = (_frame_unpack(f) for f in ("<B", "<H", "<I", "<Q"))
_I4 = _frame_unpack("<i")
_F8 = _frame_unpack(">d")


# -- DCP metadata at scale -----------------------------------------------------------------------
# A checkpoint saved by thousands of ranks has a million ChunkStorageMetadata records and as many
# (MetadataIndex -> _StorageInfo) storage records, each a few dozen opcodes that CPython's pickler
# writes the same way every time. A run of them is recognized one record at a time by a regular
# expression (C speed) and kept as columns (``ChunkRows``, ``StorageRows``: numpy arrays, a few
# machine integers per record) instead of Python objects; a record that differs in any way goes
# through the ordinary opcodes. The memo slots the records would have filled are kept as that run's
# index range, not as list entries (8 bytes a slot is hundreds of MB at millions of chunks): the memo
# list holds the other slots, shifted down past the runs; a later opcode that refers to a slot of a
# run gets the object then (``_Machine.memo_value``), kept in ``_Machine.made``.

_CHUNK_CLASS = "torch.distributed.checkpoint.metadata.ChunkStorageMetadata"
_INDEX_CLASS = "torch.distributed.checkpoint.metadata.MetadataIndex"
_INFO_CLASS = "torch.distributed.checkpoint.filesystem._StorageInfo"
_LAZY = object()
_GET = rb"(h.|j.{4})"
_INT = (rb"(K.|M..|J.{4}|\x8a\x01.|\x8a\x02..|\x8a\x03.{3}|\x8a\x04.{4}|\x8a\x05.{5}|\x8a\x06.{6}|"
        rb"\x8a\x07.{7}|\x8a\x08.{8})")
_OPT = b"(" + _INT[1:-1] + b")?"
_NEW = rb"\)\x81\x94}\x94\("  # EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK, then the state's items
_SIZE_END = rb"\x94\x85\x94R\x94"  # MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE: torch.Size(tuple)
# SHORT_BINUNICODE, memoized; text holding the MEMOIZE byte (some UTF-8) goes the ordinary way, so a
# match never reaches past the record's own MEMOIZE (into a FRAME, say)
_LITERAL = rb"\x8c(.)([^\x94]{0,255})\x94"
# A record as parts: bytes as they are; "ref": a memo reference (class, key name, torch.Size) that a
# run's first record checks and the rest repeat byte for byte; ("dims", name): a torch.Size's
# integers; ("int", name); ("text", name): a string, memoized text or a memo reference.
_CHUNK_PARTS = ["ref", _NEW, "ref", "ref", ("dims", "offsets"), "ref", "ref", ("dims", "sizes"), b"ub"]
_PAIR_PARTS = ["ref", _NEW, "ref", ("text", "fqn"), "ref", ("int", "index"), "ref", "ref", ("dims", "key"), b"ub",
               "ref", _NEW, "ref", ("text", "path"), "ref", ("int", "offset"), "ref", ("int", "length"), b"ub"]
# What the references must be, in order: a class, a key name, or torch.Size (``tuple`` here).
_CHUNK_REFS = [_CHUNK_CLASS, "offsets", tuple, "sizes", tuple]
_PAIR_REFS = [_INDEX_CLASS, "fqn", "index", "offset", tuple, _INFO_CLASS, "relative_path", "offset", "length"]
_PATTERNS: dict = {}  # (parts, refs, shape) -> (pattern, group numbers by field); bounded below


def _pattern(parts: list, refs: tuple | None = None, shape: dict | None = None) -> tuple[re.Pattern, dict]:
    """The record's expression and where its fields are among the groups. Without ``refs`` any record
    of the kind (to learn a run's shape); with ``refs`` (bytes) and ``shape`` (dims per Size, text
    kind), only records exactly like the run's first."""
    key = (id(parts), refs, tuple(sorted((shape or {}).items())))
    found = _PATTERNS.get(key)
    if found:
        return found
    pieces, fields, group, refs_left = [], {}, 0, iter(refs or ())
    for part in parts:
        if isinstance(part, bytes):
            pieces.append(part)
            continue
        if part == "ref":
            piece, count, name = (b"(" + re.escape(next(refs_left)) + b")" if refs else _GET), 1, "refs"
        else:
            kind, name = part
            if kind == "int":
                piece, count = _INT, 1
            elif kind == "text":
                literal = shape[name] if shape else None
                piece = _LITERAL if literal else _GET if shape else rb"(h.|j.{4}|" + _LITERAL + b")"
                count = 2 if literal else 1 if shape else 3
            else:  # 1 to 3 integers (records of one run may differ: 2-D weights and 1-D norms)
                piece, count = _INT + _OPT + _OPT + rb"([\x85-\x87])" + _SIZE_END, 4
        fields.setdefault(name, []).extend(range(group, group + count))
        pieces.append(piece)
        group += count
    found = (re.compile(b"".join(pieces), re.DOTALL), fields)
    if len(_PATTERNS) < 256:
        _PATTERNS[key] = found
    return found


def _ints(codes: tuple | list) -> np.ndarray:
    """The values of BININT1 / BININT2 / BININT / LONG1 opcodes with their arguments (b"": 0), as int64."""
    raw = np.array(codes, dtype="S10").view(np.uint8).reshape(-1, 10).astype(np.int64)
    values = raw[:, 1] | raw[:, 2] << 8  # BININT1 (padded with a zero) and BININT2
    wide = np.flatnonzero((raw[:, 0] == 0x4A) | (raw[:, 0] == 0x8A))  # BININT and LONG1
    if len(wide):
        rest = raw[wide]
        word = rest[:, 1] | rest[:, 2] << 8 | rest[:, 3] << 16 | rest[:, 4] << 24
        word = np.where(word >= 1 << 31, word - (1 << 32), word)
        count = rest[:, 1]
        long = np.zeros(len(rest), np.int64)
        for byte in range(8):
            long |= rest[:, 2 + byte] << (8 * byte)
        top = rest[np.arange(len(rest)), np.minimum(count + 1, 9)]  # LONG1's last byte holds the sign
        negative = (count > 0) & (count < 8) & (top >= 128)  # eight bytes wrapped into int64 are signed already
        long = np.where(negative, long - np.left_shift(np.int64(1), 8 * np.minimum(count, 7)), long)
        values[wide] = np.where(rest[:, 0] == 0x4A, word, long)
    return values


def _dims_column(columns: list, groups: list[int], count: int) -> tuple[np.ndarray, np.ndarray]:
    """A torch.Size field of the first ``count`` records: ``(records, 3)`` integers (missing dims 0) and
    how many dims each has."""
    values = [_ints([code or b"" for code in columns[g][:count]]) for g in groups[:3]]
    ndim = np.frombuffer(b"".join(columns[groups[3]][:count]), np.uint8).astype(np.int64) - 0x84
    return np.stack(values, axis=1), ndim


@dataclass(frozen=True, eq=False)
class ChunkRows:
    """ChunkStorageMetadata records of one number of dims, standing in a chunks list for all of them:
    ``offsets[i]``, ``sizes[i]``."""

    offsets: np.ndarray  # (records, dims) int64
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def state(self, row: int) -> dict:
        return {"offsets": tuple(self.offsets[row].tolist()), "sizes": tuple(self.sizes[row].tolist())}

    def records(self) -> list[Record]:
        """The records as objects (for code that takes them one by one; large lists use the columns)."""
        return [_record(_CHUNK_RECORD, self.state(row)) for row in range(len(self))]


@dataclass(frozen=True, eq=False)
class StorageRows:
    """Storage records, a key of storage_data standing for all of them (its value is None): record ``i`` is
    ``MetadataIndex(fqn[i], key[i], index[i]) -> _StorageInfo(path[i], offset[i], length[i])``."""

    fqn: list[str]
    index: np.ndarray
    key: np.ndarray  # (records, 3): the chunk offsets of each key, ``key_ndim[i]`` of them
    key_ndim: np.ndarray
    path: list[str]
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.fqn)

    def states(self, row: int) -> tuple[dict, dict]:
        return ({"fqn": self.fqn[row], "index": int(self.index[row]), "offset": tuple(self.key[row, :self.key_ndim[row]].tolist())},
                {"relative_path": self.path[row], "offset": int(self.offset[row]), "length": int(self.length[row])})

    def items(self) -> list[tuple[Record, Record]]:
        """``(MetadataIndex, _StorageInfo)`` records as objects."""
        made = []
        for row in range(len(self)):
            key, info = self.states(row)
            made.append((_record(ALLOWED[_INDEX_CLASS], key), _record(ALLOWED[_INFO_CLASS], info)))
        return made


def each_record(items: list):
    """The items of a list, with the records that rows stand for (``ChunkRows``) made into objects one by one."""
    for item in items:
        if type(item) is ChunkRows:
            yield from item.records()
        else:
            yield item


def each_item(mapping: dict):
    """The items of a dict, with the storage records that rows stand for (``StorageRows``) made into objects."""
    for key, value in mapping.items():
        if type(key) is StorageRows:
            yield from key.items()
        else:
            yield key, value


def _memo_index(code: bytes) -> int:
    return code[1] if code[0] == 0x68 else _U4(code, 1)[0]


_CHUNK_RECORD = ALLOWED[_CHUNK_CLASS]
_INDEX_RECORD = ALLOWED[_INDEX_CLASS]


def _record(cls: type, state: dict) -> Record:
    record = object.__new__(cls)
    record.__dict__.update(state)
    return record


class _Machine:
    """One run of the restricted pickle machine over ``data``."""

    def __init__(self, data: bytes, source: str):
        self.data, self.source = data, source
        self.work = 0
        self.budget = WORK_PER_BYTE * len(data) + BASE_ALLOWANCE
        # Hash cost and nesting of the tuples and frozensets made here, kept alive so ids stay theirs.
        self.hashing: dict[int, tuple[Any, int, int]] = {}
        # Per dict or set: how many non-string keys share each hash.
        self.hashes: dict[int, tuple[Any, dict[int, int]]] = {}
        # Runs of records kept as rows (see rows_run).
        self.lazy_first = array.array("q")  # per run: its first memo index, and (rows, slots per record, shape)
        self.lazy_runs: list[tuple[Any, int, dict]] = []
        self.lazy_real = array.array("q")  # per run: where the memo list continues after it
        self.lazy_size = array.array("q")  # per run: its memo slots
        self.shift = 0  # memo slots of all runs (memo index = list position + the slots of the runs before)
        self.made: dict[int, Any] = {}  # slots of runs referred to (made then) or PUT again
        self.strings: dict[bytes, str] = {}  # texts of rows, decoded once
        self.memo: list = []  # run's memo (numpy arrays replace their shells in it)
        self.shells = 0  # numpy arrays made by _reconstruct and not yet given their data

    # -- budgets ---------------------------------------------------------------------------

    def charge(self, units: int) -> None:
        self.work += units
        if self.work > self.budget:
            raise _Bad(f"asks for more work than a pickle of {len(self.data):,} bytes can "
                       "(shared containers copied or hashed over and over)")

    def hash_cost(self, key: Any) -> tuple[int, int]:
        """What hashing ``key`` costs (items visited, shared items counted each time) and how deep it nests.

        Tuples and frozensets are measured once each, bottom up without recursion (a pickle can nest
        them a million deep in two bytes a level), and remembered.
        """
        kind = type(key)
        if kind is int:
            return 1 + key.bit_length() // 1024, 1
        if kind is not tuple and kind is not frozenset:
            return 1, 1
        known = self.hashing
        todo: list[tuple[Any, bool]] = [(key, False)]
        while todo:
            obj, ready = todo.pop()
            entry = known.get(id(obj))
            if entry is not None and entry[0] is obj:
                continue
            if not ready:
                todo.append((obj, True))
                todo.extend((item, False) for item in obj if type(item) is tuple or type(item) is frozenset)
                continue
            cost, depth = 1, 1
            for item in obj:
                if type(item) is tuple or type(item) is frozenset:
                    _, item_cost, item_depth = known[id(item)]
                    cost += item_cost
                    depth = max(depth, item_depth + 1)
                else:
                    cost += 1 + item.bit_length() // 1024 if type(item) is int else 1
            known[id(obj)] = (obj, min(cost, _LIMIT), depth)  # holding obj keeps its id its own
        _, cost, depth = known[id(key)]
        return cost, depth

    def key(self, container: Any, key: Any) -> None:
        """Check (and pay for) hashing ``key`` into ``container`` before it is done."""
        kind = type(key)
        if kind is str or kind is bytes or kind is _Name:
            return  # randomized hashes, cached: cheap and not floodable
        cost, depth = self.hash_cost(key)
        if depth > MAX_DEPTH:
            raise _Bad(f"a dict or set key nests more than {MAX_DEPTH} levels")
        entry = self.hashes.get(id(container))
        if entry is None or entry[0] is not container:
            entry = self.hashes[id(container)] = (container, {})
        counts = entry[1]
        self.charge(cost)
        value = hash(key)  # TypeError for unhashable keys
        seen = counts.get(value, 0) + 1
        if seen > MAX_SAME_HASH:
            raise _Bad(f"more than {MAX_SAME_HASH} keys of one dict or set share a hash (hash flooding)")
        counts[value] = seen
        self.charge(cost * seen)  # the comparisons with the keys that share it

    def set_item(self, target: Any, key: Any, value: Any) -> None:
        if not isinstance(target, dict):
            raise _Bad(f"sets an item of a {_brief(target)}, not of a dict")
        self.key(target, key)
        target[key] = value

    def add_items(self, target: set, items) -> None:
        for item in items:
            self.key(target, item)
            target.add(item)

    # -- calls -------------------------------------------------------------------------------

    def call(self, func: Any, args: Any, kwargs: Any = None) -> Any:
        """``func(*args)`` for the callables a checkpoint may use, each with its arguments checked."""
        if type(args) is not tuple:
            raise _Bad(f"call arguments are a {_brief(args)}, not a tuple")
        if kwargs:
            raise _Bad("keyword arguments in a call")
        self.charge(len(args) + 1)
        if func is tuple or func is set or func is frozenset:  # tuple: torch.Size, in every tensor's pickle
            if len(args) > 1 or args and not isinstance(args[0], (list, tuple)):
                raise _Bad(f"{func.__name__}() of something other than a list")
            items = args[0] if args else ()
            self.charge(len(items))
            if func is tuple:
                return tuple(items)
            made: set = set()
            self.add_items(made, items)
            return frozenset(made) if func is frozenset else made
        if type(func) is _Method:
            return getattr(self, "_" + func)(*args)
        if id(func) in _FUNCTIONS:
            if func is _latin1_bytes or func is _path:
                self.charge(sum(len(a) for a in args if isinstance(a, str)))
            return func(*args)
        if type(func) is type and func in _RECORD_TYPES:
            return func.__new__(func, *args)
        if func is SubclassRef:
            return SubclassRef(_SHARDED_TENSOR, args=args)
        if func is collections.OrderedDict:
            if args:
                raise _Bad("OrderedDict made with arguments (pickles give it its items afterwards)")
            return collections.OrderedDict()
        if func is slice:
            if not 1 <= len(args) <= 3 or not all(a is None or type(a) is int and a.bit_length() < 64 for a in args):
                raise _Bad("slice of something other than small integers")
            return slice(*args)
        if func is bytes:
            if args:
                raise _Bad("bytes() made from arguments (pickles call it only for b'')")
            return b""
        if func is complex:
            numbers = all(type(a) is float or type(a) is int and a.bit_length() < 1024 for a in args)
            if len(args) > 2 or not numbers:
                raise _Bad("complex of something other than two numbers")
            return complex(*args)
        raise _Bad(f"calls a {_brief(func)}, which is not a checkpoint constructor")

    def new_object(self, cls: Any, args: Any, kwargs: Any = None) -> Any:
        """NEWOBJ: ``cls.__new__(cls, *args)`` for the classes ``call`` allows."""
        if isinstance(cls, type) and issubclass(cls, Record):
            if type(args) is not tuple:
                raise _Bad(f"NEWOBJ arguments are a {_brief(args)}, not a tuple")
            self.charge(len(args) + 1)
            return cls.__new__(cls, *args)
        if cls is set or cls is collections.OrderedDict:
            return cls()  # __new__ ignores its arguments; the items come afterwards
        if not isinstance(cls, type):
            raise _Bad(f"NEWOBJ of a {_brief(cls)}, which is not a class")
        return self.call(cls, args, kwargs)

    def build(self, inst: Any, state: Any) -> Any:
        """BUILD: give an object its pickled state; returns what stands in its place (itself but for numpy arrays)."""
        if isinstance(state, dict):
            self.charge(len(state) + 1)
        elif isinstance(state, tuple) and len(state) == 2:
            self.charge(sum(len(s) for s in state if isinstance(s, dict)) + 1)
        if isinstance(inst, Record):
            Record.__setstate__(inst, state)  # through the class: an attribute named __setstate__ is data
        elif type(inst) is SubclassRef:
            SubclassRef.__setstate__(inst, state)
        elif type(inst) is collections.OrderedDict and isinstance(state, dict) and all(type(k) is str for k in state):
            inst.__dict__.update(state)  # a state dict's _metadata
        elif type(inst) is _NumpyDtype:
            # numpy.dtype.__reduce__ of a plain numeric dtype: (3, byte order, None, None, None, -1, -1, 0)
            plain = type(state) is tuple and len(state) == 8 and state[2:5] == (None, None, None)
            if not (plain and all(type(v) is int for v in state[:1] + state[5:])
                    and (state[0], *state[5:]) == (3, -1, -1, 0) and state[1] in ("<", ">", "|", "=")
                    and type(state[1]) is str and inst.order is None):
                raise _Bad(f"numpy dtype {inst.code} with state {_brief(state)}, not a plain numeric dtype's")
            inst.order = state[1]
        elif type(inst) is _ArrayShell:
            return self.numpy_array_state(inst, state)
        else:
            raise _Bad(f"gives state to a {_brief(inst)}")
        return inst

    def numpy_array_state(self, shell: _ArrayShell, state: Any) -> np.ndarray:
        """``ndarray.__setstate__((1, shape, dtype, is_fortran, raw bytes))`` done as ``np.frombuffer`` of checked bytes."""
        if not (type(state) is tuple and len(state) == 5 and state[0] == 1 and type(state[0]) is int):
            raise _Bad(f"numpy array state {_brief(state)}, not (1, shape, dtype, order, bytes)")
        _, size, element, fortran, raw = state
        shape = _dims("numpy array shape", size)
        if type(element) is not _NumpyDtype or type(fortran) is not bool:
            raise _Bad(f"numpy array of dtype {_brief(element)}, not a numeric dtype")
        if type(raw) is not bytes:  # object arrays pickle a list of objects here
            raise _Bad(f"numpy array data is a {_brief(raw)}, not bytes (object arrays are not checkpoint data)")
        kind = element.resolve()
        count = 1
        for n in shape:
            count *= n
        if count * kind.itemsize != len(raw):
            raise _Bad(f"numpy array {list(shape)} of {kind} needs {count * kind.itemsize:,} bytes, has {len(raw):,}")
        memo = self.memo
        self.charge(len(memo) - shell.memo_from + 1)
        # a writable array in native byte order, as numpy's own unpickling gives (it swaps big-endian data)
        value = np.frombuffer(raw, dtype=kind).astype(kind.newbyteorder("=")).reshape(shape, order="F" if fortran else "C")
        for index in range(shell.memo_from, len(memo)):
            if memo[index] is shell:
                memo[index] = value
        self.shells -= 1
        return value

    def _numpy_dtype(self, code, align=False, copy=True):
        if type(code) is not str or code not in _NUMPY_CODES or type(align) is not bool or type(copy) is not bool:
            raise _Bad(f"numpy dtype {_brief(code)} is not a plain numeric dtype")
        return _NumpyDtype(code)

    def _numpy_array(self, cls, shape, typecode):
        # numpy pickles an array as _reconstruct(ndarray, (0,), b"b"), then BUILD with its state
        if cls is not _NDARRAY or shape != (0,) or typecode != b"b":
            raise _Bad(f"numpy _reconstruct of {_brief(cls)}, not of a plain ndarray")
        self.shells += 1
        return _ArrayShell(len(self.memo))

    def _numpy_scalar(self, element, raw):
        if type(element) is not _NumpyDtype or type(raw) is not bytes or len(raw) != element.resolve().itemsize:
            raise _Bad(f"numpy scalar of {_brief(element)} from {_brief(raw)}, not a numeric dtype and its bytes")
        return np.frombuffer(raw, dtype=element.resolve()).astype(element.resolve().newbyteorder("="))[0]

    def _rebuild_from_type(self, func, new_type, args, state):
        # torch pickles tensor subclasses (DTensor, Parameter subclasses) as "rebuild base, then set type and state".
        if any(new_type is plain for plain in _PLAIN_TENSOR_TYPES):
            return self.plain_tensor(func, new_type, args, state)
        if not (new_type is SubclassRef or isinstance(new_type, type) and issubclass(new_type, Record)):
            raise _Bad(f"tensor subclass {_brief(new_type)} is not a checkpoint type")
        if type(func) is _Method and func == "rebuild_from_type":  # the base is a tensor, never a subclass
            raise _Bad("a tensor subclass rebuilt from another")
        base = self.call(func, args)
        if isinstance(base, TensorRef):
            base.subclass = _SHARDED_TENSOR if new_type is SubclassRef else new_type.qualname
            base.subclass_state = state
            return base
        if isinstance(base, SubclassRef):
            base.state = state
            return base
        raise _Bad(f"unexpected tensor subclass payload {_brief(base)}")

    def plain_tensor(self, func, new_type, args, state) -> TensorRef:
        """A plain tensor or parameter that carries Python attributes (FSDP1's ``_has_been_cloned``): the tensor."""
        if not any(func is f for f in (_rebuild_tensor, _rebuild_tensor_v3, _rebuild_parameter)):
            raise _Bad(f"{new_type} rebuilt by {_brief(func)}, not by a tensor rebuild function")
        flags = type(state) in (dict, collections.OrderedDict) and set(state) <= _PLAIN_TENSOR_STATE_KEYS
        if not (state is None or flags and all(type(v) is bool for v in state.values())):
            raise _Bad(f"{new_type} with state {_brief(state)}, not FSDP's _has_been_cloned flag")
        base = self.call(func, args)
        if not isinstance(base, TensorRef) or base.subclass:
            raise _Bad(f"{new_type} rebuilt as a {_brief(base)}, not a plain tensor")
        return base

    def _rebuild_wrapper_subclass(self, cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
        # torch pickles ShardedTensor and DTensor as an empty wrapper shell whose state comes afterwards.
        if cls is SubclassRef:
            qualname = _SHARDED_TENSOR
        elif isinstance(cls, type) and issubclass(cls, Record):
            qualname = cls.qualname
        else:
            raise _Bad(f"unexpected tensor subclass {_brief(cls)}")
        if not isinstance(dtype, str):
            raise _Bad(f"tensor subclass with dtype {_brief(dtype)}")
        shape, strides = _dims("tensor size", size), _dims("tensor stride", stride)
        return SubclassRef(qualname, args=(dtype, shape, strides, storage_offset))

    def _getattr(self, owner, name):
        # Protocol 2 names a nested class as getattr(outer, name); only ShardedTensor.ProcessGroupState is allowed.
        if owner is SubclassRef and name == "ProcessGroupState":
            return ALLOWED["torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"]
        raise UnsafePickleError(f"{self.source}: refuses getattr({_brief(owner)}, {_brief(name)}) (nothing was executed)")

    def find_class(self, module: Any, name: Any) -> Any:
        if type(module) is not str or type(name) is not str:
            raise _Bad("a global named by something other than strings")
        if module == "__builtin__":  # protocols 0-2 name builtins as Python 2 did (pickle maps them too)
            module = "builtins"
        qualname = f"{module}.{name}"
        try:
            return ALLOWED[qualname]
        except KeyError:
            raise UnsafePickleError(
                f"{self.source}: refuses to unpickle {printable(qualname, 120)}, which is not a checkpoint type "
                "(nothing was executed)"
            ) from None

    def persistent_load(self, pid: Any) -> StorageRef:
        # torch.save: ('storage', storage_type, key, location, numel)
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], DType)):
            raise _Bad(f"unexpected persistent id {_brief(pid)}")
        _, storage_dtype, key, _location, numel = pid
        if type(key) is int:
            key = str(key)
        if type(key) is not str or not key.isprintable() or len(key) > 256:
            raise _Bad(f"storage key {_brief(key)} is not a short name")
        numel = _count("storage size", numel)
        if numel * storage_dtype.itemsize >= _LIMIT:
            raise _Bad(f"storage of {numel} elements is larger than torch can hold")
        return StorageRef(storage_dtype, key, numel)

    # -- rows (DCP metadata at scale) ---------------------------------------------------------

    def rows_run(self, pos: int, cls: type, memo: list) -> tuple[int, tuple] | None:
        """Records of class ``cls`` from ``pos`` (its memo reference) on, kept as rows while they are
        like the first; returns the position after them and what stands for them on the stack, or None."""
        chunks = cls is _CHUNK_RECORD
        parts, wanted = (_CHUNK_PARTS, _CHUNK_REFS) if chunks else (_PAIR_PARTS, _PAIR_REFS)
        data = self.data
        generic, fields = _pattern(parts)
        first = generic.match(data, pos)
        if first is None:
            return None
        groups = first.groups()
        refs = tuple(groups[g] for g in fields["refs"])
        for code, want in zip(refs, wanted):
            value = self.peek(_memo_index(code))
            if not (value is want if want is tuple else value is ALLOWED[want] if "." in want
                    else type(value) is str and value == want):
                return None
        shape = {} if chunks else {"fqn": groups[fields["fqn"][1]] is not None,
                                   "path": groups[fields["path"][1]] is not None}
        if (id(parts), refs, tuple(sorted(shape.items()))) not in _PATTERNS:
            self.charge(4096)  # compiling an expression: a pickle of many different runs pays for each
        pattern, fields = _pattern(parts, refs, shape)
        match, rows, starts, end = pattern.match, [], [], pos
        found = match(data, end)
        while found is not None:
            starts.append(end)
            rows.append(found.groups())
            end = found.end()
            found = match(data, end)
        if not rows:
            return None
        columns = list(zip(*rows))
        if chunks:  # one number of dims: a list of chunks is one tensor's
            (offsets, ndim), (sizes, sizes_ndim) = (_dims_column(columns, fields[f], len(rows)) for f in ("offsets", "sizes"))
            wrong = np.flatnonzero((ndim != ndim[0]) | (sizes_ndim != ndim[0]))
            good = int(wrong[0]) if len(wrong) else len(rows)
            standing = ChunkRows(offsets[:good, :ndim[0]], sizes[:good, :ndim[0]])
        else:
            fqn, good = self.texts(columns, fields["fqn"], memo, len(rows))
            path, good = self.texts(columns, fields["path"], memo, good)
            standing = StorageRows(fqn[:good], _ints(columns[fields["index"][0]][:good]),
                                   *_dims_column(columns, fields["key"], good), path[:good],
                                   _ints(columns[fields["offset"][0]][:good]), _ints(columns[fields["length"][0]][:good]))
        if good == 0:
            return None
        end = starts[good] if good < len(rows) else end
        slots = 8 if chunks else 7 + shape["fqn"] + shape["path"]  # the MEMOIZE opcodes of a record
        self.charge((end - pos) >> 3)
        self.lazy_first.append(len(memo) + self.shift)
        self.lazy_real.append(len(memo))
        self.lazy_size.append(slots * good)
        self.lazy_runs.append((standing, slots, shape))
        self.shift += slots * good
        return end, (standing,) if chunks else (standing, None)

    def texts(self, columns: list, groups: list[int], memo: list, count: int) -> tuple[list[str], int]:
        """A string field of the first ``count`` records, and how many of them are well formed."""
        if len(groups) == 1:  # memo references: each must be a string
            raw = np.array(columns[groups[0]][:count], dtype="S5").view(np.uint8).reshape(-1, 5).astype(np.int64)
            indices = np.where(raw[:, 0] == 0x68, raw[:, 1], raw[:, 1] | raw[:, 2] << 8 | raw[:, 3] << 16 | raw[:, 4] << 24)
            real = self.list_positions(indices)
            if len(real) and real.max() >= len(memo):
                count = int(np.argmax(real >= len(memo)))
            made = self.made  # -1: a slot of a run
            values = [memo[r] if r >= 0 else made.get(i, _LAZY) for r, i in zip(real[:count].tolist(), indices.tolist())]
            if set(map(type, values)) - {str}:
                count = next(i for i, value in enumerate(values) if type(value) is not str)
            return values[:count], count
        lengths, texts = columns[groups[0]][:count], columns[groups[1]][:count]
        wrong = np.flatnonzero(np.frombuffer(b"".join(lengths), np.uint8) != np.fromiter(map(len, texts), np.int64, count))
        count = int(wrong[0]) if len(wrong) else count  # text holding the MEMOIZE byte: not this record's shape
        strings = self.strings  # one object per distinct text (a tensor's name recurs once per rank)
        for text in set(texts[:count]) - strings.keys():
            strings[text] = str(text, "utf-8", "surrogatepass")
        return list(map(strings.__getitem__, texts[:count])), count

    def locate(self, index: int) -> tuple[int, int]:
        """Where memo slot ``index`` is: ``(list position, -1)``, or ``(-1, run)`` for a slot of a run."""
        run = bisect.bisect_right(self.lazy_first, index) - 1
        if run < 0:
            return index, -1
        inside, size = index - self.lazy_first[run], self.lazy_size[run]
        return (-1, run) if inside < size else (self.lazy_real[run] + inside - size, -1)

    def list_positions(self, indices: np.ndarray) -> np.ndarray:
        """``locate`` of many memo indices at once: list positions, -1 for slots of runs."""
        if not self.lazy_runs:
            return indices
        first, real_at = np.frombuffer(self.lazy_first, np.int64), np.frombuffer(self.lazy_real, np.int64)
        sizes = np.frombuffer(self.lazy_size, np.int64)
        run = np.maximum(np.searchsorted(first, indices, side="right") - 1, 0)
        inside = indices - first[run]
        before = indices < first[0]
        positions = np.where(before, indices, real_at[run] + inside - sizes[run])
        positions[~before & (inside < sizes[run])] = -1
        return positions

    def peek(self, index: int) -> Any:
        """What memo slot ``index`` holds, without making a run's object: ``_HOLE``, ``_LAZY`` or the value."""
        position, run = self.locate(index)
        if run >= 0:
            return self.made.get(index, _LAZY)
        return self.memo[position] if position < len(self.memo) else _HOLE

    def put(self, memo: list, index: int, value: Any) -> int:
        """PUT at a memo index (``_put`` past the runs); returns 1 when the index was not set before."""
        position, run = self.locate(index)
        if run >= 0:
            self.made[index] = value
            return 0
        return _put(memo, position, value)

    def memo_value(self, memo: list, index: int) -> Any:
        """The object at a memo index: a record's part made now for a slot of a run, or an error for a hole."""
        value = self.peek(index) if index >= 0 else _HOLE
        if value is _HOLE:
            raise _Bad(f"memo index {index:,} was never set")
        if type(value) is _ArrayShell:
            raise _Bad("a numpy array used before its data")
        if value is not _LAZY:
            return value
        run = bisect.bisect_right(self.lazy_first, index) - 1
        standing, slots, shape = self.lazy_runs[run]
        row, slot = divmod(index - self.lazy_first[run], slots)
        if type(standing) is ChunkRows:
            state = standing.state(row)
            offsets, sizes = state["offsets"], state["sizes"]
            parts = [_record(_CHUNK_RECORD, state), state, offsets, (offsets,), offsets, sizes, (sizes,), sizes]
        else:
            key, info = standing.states(row)
            offsets = key["offset"]
            parts = [_record(_INDEX_RECORD, key), key] + [key["fqn"]] * shape["fqn"] + \
                [offsets, (offsets,), offsets, _record(ALLOWED[_INFO_CLASS], info), info] + [info["relative_path"]] * shape["path"]
        value = self.made[index] = parts[slot]
        return value


    # -- the machine -------------------------------------------------------------------------

    def take(self, pos: int, count: int) -> bytes:
        """``count`` bytes from ``pos``, refused when the pickle is shorter (nothing is allocated first)."""
        if count < 0 or count > len(self.data) - pos:
            raise _Bad(f"truncated: needs {count:,} bytes at byte {pos:,}, the pickle has {len(self.data) - pos:,} left")
        return self.data[pos:pos + count]

    def line(self, pos: int) -> bytes:
        stop = self.data.find(b"\n", pos)
        if stop < 0:
            raise _Bad(f"truncated: a line at byte {pos:,} has no end")
        return self.data[pos:stop]

    def run(self) -> Any:
        """Interpret the pickle. One flat loop with the frequent opcodes first: this runs per opcode."""
        data = self.data
        end = len(data)
        # The memo as a list (a dict would cost ten times the memory): ``_HOLE`` marks indices never
        # set; PUT indices are bounded by the pickle's length, so holes cost O(N) at most.
        memo: list = self.memo
        filled = 0  # indices set: MEMOIZE puts at this one, as pickle does
        shift = 0  # memo slots kept as runs (self.shift)
        lazy_from = end + 1  # the first memo index of a run: indices from there on go through self.locate
        stack: list = []
        marks: list[list] = []
        pos = 0
        records = _RECORD_TYPES
        while True:
            op = data[pos]  # IndexError past the end: load_bytes says "truncated"
            pos += 1
            if op == 0x94:  # MEMOIZE
                if filled == len(memo) + shift:
                    memo.append(stack[-1])
                    filled += 1
                else:
                    filled += self.put(memo, filled, stack[-1])
            elif op == 0x71:  # BINPUT
                index = data[pos]
                filled += _put(memo, index, stack[-1]) if index < lazy_from else self.put(memo, index, stack[-1])
                pos += 1
            elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                index = data[pos] if op == 0x68 else _U4(data, pos)[0]
                value = memo[index] if index < lazy_from else self.memo_value(memo, index)  # IndexError: "unreadable"
                if value is _HOLE:
                    value = self.memo_value(memo, index)
                elif value is _CHUNK_RECORD or value is _INDEX_RECORD:  # DCP records, maybe a run of them
                    found = len(memo) + shift == filled and self.rows_run(pos - 1, value, memo)
                    if found:
                        pos, standing = found
                        shift = self.shift
                        filled = len(memo) + shift
                        lazy_from = self.lazy_first[0]
                        stack.extend(standing)
                        continue
                elif type(value) is _ArrayShell:
                    value = self.memo_value(memo, index)
                stack.append(value)
                pos += 1 if op == 0x68 else 4
            elif op == 0x4B:  # BININT1
                stack.append(data[pos])
                pos += 1
            elif op == 0x28:  # MARK
                marks.append(stack)
                stack = []
            elif op == 0x29:  # EMPTY_TUPLE
                stack.append(())
            elif op == 0x81:  # NEWOBJ
                args = stack.pop()
                cls = stack[-1]
                if type(cls) is type and cls in records and type(args) is tuple:
                    self.work += len(args)
                    if self.work > self.budget:
                        self.charge(0)
                    stack[-1] = cls.__new__(cls, *args)
                else:
                    stack[-1] = self.new_object(cls, args)
            elif op == 0x62:  # BUILD
                state = stack.pop()
                inst = stack[-1]
                if type(state) is dict and isinstance(inst, Record):
                    self.work += len(state)
                    if self.work > self.budget:
                        self.charge(0)
                    inst.__dict__.update(state)
                else:
                    stack[-1] = self.build(inst, state)
            elif op == 0x85:  # TUPLE1
                stack[-1] = (stack[-1],)
            elif op == 0x75:  # SETITEMS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if len(items) % 2 or not isinstance(target, dict):
                    raise _Bad("SETITEMS with a key and no value" if len(items) % 2 else
                               f"sets items of a {_brief(target)}, not of a dict")
                for i in range(0, len(items), 2):
                    key = items[i]
                    if type(key) is not str:
                        self.key(target, key)
                    target[key] = items[i + 1]
            elif op == 0x7D:  # EMPTY_DICT
                stack.append({})
            elif op == 0x52:  # REDUCE
                args = stack.pop()
                stack[-1] = self.call(stack[-1], args)
            elif op == 0x86:  # TUPLE2
                second = stack.pop()
                stack[-1] = (stack[-1], second)
            elif op == 0x89:  # NEWFALSE
                stack.append(False)
            elif op == 0x88:  # NEWTRUE
                stack.append(True)
            elif op == 0x8C:  # SHORT_BINUNICODE
                count = data[pos]
                text = data[pos + 1:pos + 1 + count]
                if len(text) != count:
                    self.take(pos + 1, count)
                pos += 1 + count
                stack.append(str(text, "utf-8", "surrogatepass"))
            elif op == 0x58:  # BINUNICODE
                count = _U4(data, pos)[0]
                text = self.take(pos + 4, count)
                pos += 4 + count
                stack.append(str(text, "utf-8", "surrogatepass"))
            elif op == 0x4D:  # BININT2
                stack.append(_U2(data, pos)[0])
                pos += 2
            elif op == 0x4A:  # BININT
                stack.append(_I4(data, pos)[0])
                pos += 4
            elif op == 0x74:  # TUPLE
                items = stack
                stack = marks.pop()
                stack.append(tuple(items))
            elif op == 0x5D:  # EMPTY_LIST
                stack.append([])
            elif op == 0x61:  # APPEND
                value = stack.pop()
                target = stack[-1]
                if type(target) is not list:
                    raise _Bad(f"appends to a {_brief(target)}, not to a list")
                target.append(value)
            elif op == 0x65:  # APPENDS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if type(target) is not list:
                    raise _Bad(f"appends to a {_brief(target)}, not to a list")
                target.extend(items)
            elif op == 0x4E:  # NONE
                stack.append(None)
            elif op == 0x87:  # TUPLE3
                third = stack.pop()
                second = stack.pop()
                stack[-1] = (stack[-1], second, third)
            elif op == 0x72:  # LONG_BINPUT
                index = _U4(data, pos)[0]
                pos += 4
                if index > end:
                    raise _Bad(f"memo index {index:,} is beyond what a pickle of {end:,} bytes can hold")
                filled += self.put(memo, index, stack[-1])
            elif op == 0x93:  # STACK_GLOBAL
                name = stack.pop()
                stack[-1] = self.find_class(stack[-1], name)
            elif op == 0x63:  # GLOBAL
                module = self.line(pos)
                pos += len(module) + 1
                name = self.line(pos)
                pos += len(name) + 1
                stack.append(self.find_class(module.decode("utf-8"), name.decode("utf-8")))
            elif op == 0x51:  # BINPERSID
                stack[-1] = self.persistent_load(stack[-1])
            elif op == 0x8A:  # LONG1
                count = data[pos]
                stack.append(int.from_bytes(self.take(pos + 1, count), "little", signed=True))
                pos += 1 + count
            elif op == 0x47:  # BINFLOAT
                stack.append(_F8(data, pos)[0])
                pos += 8
            elif op == 0x95:  # FRAME: a buffering hint; its length must fit the pickle
                size = _U8(data, pos)[0]
                pos += 8
                if size > end - pos:
                    raise _Bad(f"truncated: a frame of {size:,} bytes at byte {pos:,}, the pickle has {end - pos:,} left")
            elif op == 0x80:  # PROTO
                if data[pos] > 5:
                    raise _Bad(f"pickle protocol {data[pos]} is unknown")
                pos += 1
            elif op == 0x2E:  # STOP
                return stack.pop()
            elif op == 0x8B:  # LONG4
                count = _I4(data, pos)[0]
                if count > MAX_INT_BYTES:
                    raise _Bad(f"an integer of {count:,} bytes (at most {MAX_INT_BYTES})")
                stack.append(int.from_bytes(self.take(pos + 4, count), "little", signed=True))
                pos += 4 + count
            elif op == 0x6C:  # LIST
                items = stack
                stack = marks.pop()
                stack.append(items)
            elif op == 0x64:  # DICT
                items = stack
                stack = marks.pop()
                if len(items) % 2:
                    raise _Bad("DICT with a key and no value")
                made: dict = {}
                for i in range(0, len(items), 2):
                    self.set_item(made, items[i], items[i + 1])
                stack.append(made)
            elif op == 0x73:  # SETITEM
                value = stack.pop()
                key = stack.pop()
                self.set_item(stack[-1], key, value)
            elif op == 0x8F:  # EMPTY_SET
                stack.append(set())
            elif op == 0x90:  # ADDITEMS
                items = stack
                stack = marks.pop()
                target = stack[-1]
                if type(target) is not set:
                    raise _Bad(f"adds items to a {_brief(target)}, not to a set")
                self.add_items(target, items)
            elif op == 0x91:  # FROZENSET
                items = stack
                stack = marks.pop()
                made_set: set = set()
                self.add_items(made_set, items)
                stack.append(frozenset(made_set))
            elif op == 0x92:  # NEWOBJ_EX
                kwargs = stack.pop()
                args = stack.pop()
                if type(kwargs) is not dict:
                    raise _Bad("NEWOBJ_EX keyword arguments are not a dict")
                stack[-1] = self.new_object(stack[-1], args, kwargs)
            elif op == 0x50:  # PERSID
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(self.persistent_load(text.decode("ascii")))
            elif op == 0x30:  # POP
                if stack:
                    stack.pop()
                else:
                    stack = marks.pop()
            elif op == 0x31:  # POP_MARK
                stack = marks.pop()
            elif op == 0x32:  # DUP
                if type(stack[-1]) is _ArrayShell:
                    raise _Bad("a numpy array used before its data")
                stack.append(stack[-1])
            elif op == 0x43:  # SHORT_BINBYTES
                count = data[pos]
                stack.append(self.take(pos + 1, count))
                pos += 1 + count
            elif op == 0x42:  # BINBYTES
                count = _U4(data, pos)[0]
                stack.append(self.take(pos + 4, count))
                pos += 4 + count
            elif op == 0x8E or op == 0x96 or op == 0x8D:  # BINBYTES8, BYTEARRAY8, BINUNICODE8
                count = _U8(data, pos)[0]
                value = self.take(pos + 8, count)
                pos += 8 + count
                stack.append(bytearray(value) if op == 0x96 else str(value, "utf-8", "surrogatepass") if op == 0x8D
                             else value)
            elif op == 0x55:  # SHORT_BINSTRING (a Python 2 str)
                count = data[pos]
                stack.append(self.take(pos + 1, count).decode("ascii"))
                pos += 1 + count
            elif op == 0x54:  # BINSTRING
                count = _I4(data, pos)[0]
                stack.append(self.take(pos + 4, count).decode("ascii"))
                pos += 4 + count
            elif op == 0x53:  # STRING
                text = self.line(pos)
                pos += len(text) + 1
                if len(text) < 2 or text[0] != text[-1] or text[0] not in b"\"'":
                    raise _Bad("the STRING opcode argument must be quoted")
                stack.append(codecs.escape_decode(text[1:-1])[0].decode("ascii"))
            elif op == 0x56:  # UNICODE
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(str(text, "raw-unicode-escape"))
            elif op == 0x49:  # INT
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(False if text == b"00" else True if text == b"01" else _number(text))
            elif op == 0x4C:  # LONG
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(_number(text[:-1] if text.endswith(b"L") else text))
            elif op == 0x46:  # FLOAT
                text = self.line(pos)
                pos += len(text) + 1
                stack.append(float(text))
            elif op == 0x67:  # GET
                text = self.line(pos)
                pos += len(text) + 1
                index = _number(text)
                stack.append(self.memo_value(memo, index))
            elif op == 0x70:  # PUT
                text = self.line(pos)
                pos += len(text) + 1
                index = _number(text)
                if not 0 <= index <= end:
                    raise _Bad(f"memo index {index:,} is beyond what a pickle of {end:,} bytes can hold")
                filled += self.put(memo, index, stack[-1])
            elif op == 0x69:  # INST
                module = self.line(pos)
                pos += len(module) + 1
                name = self.line(pos)
                pos += len(name) + 1
                cls = self.find_class(module.decode("utf-8"), name.decode("utf-8"))
                items = stack
                stack = marks.pop()
                stack.append(self.call(cls, tuple(items)))
            elif op == 0x6F:  # OBJ
                items = stack
                stack = marks.pop()
                if not items:
                    raise _Bad("OBJ without a class")
                stack.append(self.call(items[0], tuple(items[1:])))
            else:
                names = {0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER"}
                if op in names:
                    raise _Bad(f"uses opcode {names[op]} at byte {pos - 1:,}, which checkpoints never use")
                raise _Bad(f"unknown opcode {op:#04x} at byte {pos - 1:,}")

    def check(self, root: Any) -> None:
        """Refuse results that code walking them would choke on: cycles, deep nesting, exponential sharing.

        Walks the result level by level with ``gc.get_referents`` (C speed), counting shared containers
        at every place they appear, up to a budget proportional to the pickle's size; a cycle shows as
        nesting without end. A record's attributes are one level below it, its ``__dict__`` between.
        """
        limit = NODES_PER_BYTE * len(self.data) + BASE_ALLOWANCE
        containers = _CONTAINERS
        level = [root] if type(root) in containers else []
        depth = total = 0
        while level:
            depth += 1
            if depth > MAX_LEVELS:
                raise _Bad(f"nests objects more than {MAX_LEVELS} levels deep, or holds a reference cycle")
            found = gc.get_referents(*level)
            total += len(found)
            if total > limit:
                raise _Bad(f"holds more than {limit:,} objects once shared containers are counted where they appear")
            level = [item for item in found if type(item) in containers]


def load_bytes(data: bytes, source: str) -> Any:
    """Unpickle ``data`` with the allowlist; ``source`` names the file in error messages."""
    machine = _Machine(bytes(data), source)
    collecting = gc.isenabled()
    gc.disable()  # the result holds no cycles (checked), and collections while building it cost a tenth of the time
    try:
        result = machine.run()
        if machine.shells:
            raise _Bad("holds a numpy array without its data")
        machine.check(result)
        return result
    except CheckpointError as exc:
        text = str(exc)
        if text.startswith(source):
            raise
        raise type(exc)(f"{source}: {printable(text, 300)}") from None
    except _Bad as exc:
        raise CheckpointError(f"{source}: not a valid checkpoint pickle ({printable(str(exc), 200)})") from None
    except struct.error:  # an opcode's argument cut off by the end
        raise CheckpointError(f"{source}: unreadable pickle (truncated: an argument runs past the end)") from None
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError,
            MemoryError) as exc:  # a malformed pickle: stack underflow, wrong types, bad text
        message = printable(f"{type(exc).__name__}: {exc}", 160)
        raise CheckpointError(f"{source}: unreadable pickle ({message})") from None
    finally:
        machine.hashing.clear()
        machine.hashes.clear()
        if collecting:
            gc.enable()


def walk(obj: Any, visit: Callable[[Any], None]) -> None:
    """Call ``visit`` on ``obj`` and everything nested in its dicts, lists and tuples (``load_bytes`` bounds the depth)."""
    todo = [obj]
    while todo:
        item = todo.pop()
        visit(item)
        if isinstance(item, dict):
            todo.extend(reversed(list(item.values())))
        elif isinstance(item, (list, tuple)):
            todo.extend(reversed(item))
