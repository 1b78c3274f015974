"""Pickles that name torch's classes without importing torch: ``dumps`` of small values, and ``PickleStream``
for pickles too large to build as objects first (the ``.metadata`` of a thousand ranks)."""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from dcptool import dtypes as dtype_table
from dcptool.errors import CheckpointError, option
from dcptool.safe_pickle import Record, SubclassRef, TensorRef
from dcptool.safe_pickle.allowlist import ALLOWED, ENUM_RECORDS, NAMESPACE_RECORDS, Name
from dcptool.torch_archive.reading import row_major


class Global:
    """A reference to a global by name, pickled as such (``Global("torch", "bfloat16")``)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        self.__name__ = name  # the pure-Python pickler reads it in save_reduce

    def __call__(self, *args):  # the pickler insists that reduce functions are callable
        raise TypeError(f"{self.module}.{self.name} is a pickle reference, not a function")


class Reduced:
    """An object pickled as ``func(*args)`` and then given ``state`` (BUILD), without its class at hand."""

    def __init__(self, func: Global, args: tuple, state: Any = None):
        self.func, self.args, self.state = func, args, state


def new_object(module: str, name: str, state: Any) -> Reduced:
    """An instance of ``module.name`` created without calling its constructor, then given ``state``."""
    return Reduced(Global("copyreg", "__newobj__"), (Global(module, name),), state)


def torch_size(dims) -> Reduced:
    return Reduced(Global("torch", "Size"), (tuple(int(d) for d in dims),))


@dataclass(frozen=True)
class StorageOut:
    """A storage to be written as ``data/{key}`` of an archive."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorOut:
    """A contiguous tensor over a whole ``StorageOut``, pickled as torch does."""

    storage: StorageOut
    shape: tuple[int, ...]

    def strides(self) -> tuple[int, ...]:
        return row_major(self.shape)


class Unpicklable(CheckpointError):
    """A value ``dumps`` cannot pickle as what it stands for: the restricted unpickler's stand-in of a
    class (``Record``, ``SubclassRef``), or a tensor whose storage the caller did not make a ``StorageOut``."""


# The names of torch's dtypes and their aliases, as the restricted unpickler keeps them (``torch.float32`` -> "float32").
TORCH_NAMES = frozenset(str(value) for key, value in ALLOWED.items() if type(value) is Name and key == f"torch.{value}")


class _TorchPickler(pickle._Pickler):  # the pure-Python pickler lets us emit globals without importing them
    dispatch = pickle._Pickler.dispatch.copy()

    def persistent_id(self, obj):
        if isinstance(obj, StorageOut):
            element = dtype_table.dtype(obj.dtype)
            if element.storage_class is None:  # as torch saves float8 and uint16: the storage's bytes, untyped
                return ("storage", Global("torch.storage", "UntypedStorage"), obj.key, "cpu", obj.numel * element.itemsize)
            return ("storage", Global("torch", element.storage_class), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorOut):
            ordered_dict = Reduced(Global("collections", "OrderedDict"), ())
            args = (obj.storage, 0, torch_size(obj.shape), torch_size(obj.strides()), False, ordered_dict)
            if dtype_table.dtype(obj.storage.dtype).storage_class is None:  # an untyped storage: the dtype goes beside
                return (Global("torch._utils", "_rebuild_tensor_v3"), args + (Global("torch", obj.storage.dtype),))
            return (Global("torch._utils", "_rebuild_tensor_v2"), args)
        if isinstance(obj, Reduced):
            return (obj.func, obj.args, obj.state)
        if isinstance(obj, Record) and type(obj).qualname in ENUM_RECORDS | NAMESPACE_RECORDS:
            module, name = type(obj).qualname.rsplit(".", 1)
            if type(obj).qualname in ENUM_RECORDS:  # an enum member is its class called with its value
                return (Global(module, name), tuple(getattr(obj, "args", ())))
            return (Global("copyreg", "__newobj__"), (Global(module, name),), dict(vars(obj)))
        if isinstance(obj, (TensorRef, Record, SubclassRef)):
            raise Unpicklable(f"cannot write a {type(obj).__name__} nested in a non-tensor entry into this format: "
                              f"leave that entry out with {option('exclude')}")
        return NotImplemented

    def save_reduce(self, func, args, state=None, *rest, obj=None):
        if isinstance(func, Global) and func.name == "__newobj__":
            cls, *cls_args = args  # NEWOBJ: cls.__new__(cls, *args), without the pickler's class checks
            self.save(cls)
            self.save(tuple(cls_args))
            self.write(pickle.NEWOBJ)
            if obj is not None:  # as pickle does: an object met again is a reference (DTensors share one mesh)
                self.memoize(obj)
            if state is not None:
                self.save(state)
                self.write(pickle.BUILD)
            return
        super().save_reduce(func, args, state, *rest, obj=obj)

    def save_global_ref(self, obj: Global) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())

    dispatch[Global] = save_global_ref

    def save_torch_name(self, obj: Name) -> None:
        """A dtype the restricted unpickler kept by its name (Megatron's ``args.params_dtype``): ``torch.<name>``."""
        if obj not in TORCH_NAMES:
            raise Unpicklable(f"cannot write {obj!r} nested in a non-tensor entry into this format: leave that entry "
                              f"out with {option('exclude')}")
        self.save_global_ref(Global("torch", str(obj)))

    dispatch[Name] = save_torch_name


def dumps(obj: Any, protocol: int = 2) -> bytes:
    """Pickle ``obj``, in which ``Global``, ``Reduced``, ``StorageOut`` and ``TensorOut`` stand for torch objects
    (the restricted unpickler's stand-ins raise ``Unpicklable``)."""
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()


@dataclass
class Streamed:
    """A dict that ``PickleStream`` writes from ``pairs`` (an iterable of ``(key, value)``), made as they are written."""

    pairs: Any


class PickleStream:
    """Protocol-4 pickle opcodes written straight to a file, for pickles too large to build as objects first
    (the ``.metadata`` of a thousand ranks: a million chunks). Only globals and strings are memoized, so
    memory stays that of the distinct strings; values may be ``Streamed``, made as they are written.

    >>> from dcptool.safe_pickle import load_bytes
    >>> stream = PickleStream(io.BytesIO())
    >>> stream.start(); stream.save({"a": (1, None)}); stream.stop()
    >>> load_bytes(stream.file.getvalue(), "streamed.pkl")
    {'a': (1, None)}
    """

    BATCH = 1000  # items per SETITEMS / APPENDS, as pickle batches them (the unpickler's stack stays small)

    def __init__(self, file, buffer_bytes: int = 2**20):
        self.file, self._buffer, self._limit = file, bytearray(), buffer_bytes
        self._memo: dict[tuple, int] = {}

    def write(self, data: bytes) -> None:
        self._buffer += data
        if len(self._buffer) >= self._limit:
            self.file.write(self._buffer)
            self._buffer.clear()

    def start(self) -> None:
        self.write(pickle.PROTO + b"\x04")

    def stop(self) -> None:
        self.write(pickle.STOP)
        self.file.write(self._buffer)
        self._buffer.clear()

    def _memoized(self, key: tuple, emit) -> None:
        index = self._memo.get(key)
        if index is not None:
            self.write(pickle.BINGET + bytes([index]) if index < 256 else pickle.LONG_BINGET + struct.pack("<I", index))
            return
        emit()
        self._memo[key] = len(self._memo)
        self.write(pickle.MEMOIZE)

    def string(self, text: str) -> None:
        def emit():
            data = text.encode("utf-8", "surrogatepass")
            self.write((pickle.SHORT_BINUNICODE + bytes([len(data)]) if len(data) < 256 else
                        pickle.BINUNICODE + struct.pack("<I", len(data))) + data)
        self._memoized(("s", text), emit)

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.write(pickle.BININT1 + bytes([value]))
        elif 0 <= value < 65536:
            self.write(pickle.BININT2 + struct.pack("<H", value))
        elif -2**31 <= value < 2**31:
            self.write(pickle.BININT + struct.pack("<i", value))
        else:
            data = pickle.encode_long(value)
            self.write(pickle.LONG1 + bytes([len(data)]) + data)

    def global_ref(self, ref: Global) -> None:
        def emit():
            self.string(ref.module)
            self.string(ref.name)
            self.write(pickle.STACK_GLOBAL)
        self._memoized(("g", ref.module, ref.name), emit)

    def save(self, value: Any) -> None:
        """Any value of ``None``, bools, ints, floats, strings, tuples, lists, dicts, ``Global`` and ``Reduced``."""
        if value is None:
            self.write(pickle.NONE)
        elif value is True or value is False:
            self.write(pickle.NEWTRUE if value else pickle.NEWFALSE)
        elif type(value) is int:
            self.integer(value)
        elif type(value) is float:
            self.write(pickle.BINFLOAT + struct.pack(">d", value))
        elif type(value) is str:
            self.string(value)
        elif type(value) is tuple:
            self.tuple(value)
        elif type(value) is list:
            self.write(pickle.EMPTY_LIST)
            self._batched(pickle.APPENDS, value, self.save)
        elif type(value) is dict:
            self.dict(value.items())
        elif isinstance(value, Streamed):
            self.dict(value.pairs)
        elif isinstance(value, Global):
            self.global_ref(value)
        elif isinstance(value, Reduced):
            self.reduced(value)
        else:
            raise Unpicklable(f"cannot write a {type(value).__name__} into a streamed pickle")

    def tuple(self, items: tuple) -> None:
        if not items:
            self.write(pickle.EMPTY_TUPLE)
            return
        if len(items) > 3:
            self.write(pickle.MARK)
        for item in items:
            self.save(item)
        self.write(pickle.TUPLE if len(items) > 3 else (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[len(items) - 1])

    def dict(self, items) -> None:
        """A dict from ``(key, value)`` pairs, which may be a generator (nothing is held but a batch)."""
        self.write(pickle.EMPTY_DICT)
        self._batched(pickle.SETITEMS, items, lambda pair: (self.save(pair[0]), self.save(pair[1])))

    def _batched(self, opcode: bytes, items, save_one) -> None:
        count = 0
        for item in items:
            if count % self.BATCH == 0:
                if count:
                    self.write(opcode)
                self.write(pickle.MARK)
            save_one(item)
            count += 1
        if count:
            self.write(opcode)

    def reduced(self, value: Reduced) -> None:
        if value.func.name == "__newobj__" and value.func.module == "copyreg":
            cls, *cls_args = value.args  # NEWOBJ, as pickle writes an object of a class with no __reduce__
            self.global_ref(cls)
            self.tuple(tuple(cls_args))
            self.write(pickle.NEWOBJ)
        else:
            self.global_ref(value.func)
            self.tuple(value.args)
            self.write(pickle.REDUCE)
        if value.state is not None:
            self.save(value.state)
            self.write(pickle.BUILD)
