"""``torch.save`` archives without torch: where each tensor's bytes are, and how to write one.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the pickled object, with
storages as persistent ids), ``<prefix>/data/<key>`` (the raw bytes of each storage, 64-byte
aligned), ``byteorder`` and ``version``. DCP stores each tensor chunk as such an archive at an
offset inside a ``.distcp`` file; FSDP1 and full state dicts are whole files of it.
"""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from dcptool import dtypes as dtype_table
from dcptool import safe_pickle
from dcptool.safe_pickle import Record, SubclassRef, TensorRef
from dcptool.errors import CheckpointError, printable
from dcptool.storage import CheckpointFiles

# Zip structures (stored entries only; torch.save never compresses), as in the zip specification (APPNOTE).
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # local file header, 30 bytes
_CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")  # central directory file header, 46 bytes
_END = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
_END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
_LOCATOR64 = struct.Struct("<4sLQL")  # zip64 end of central directory locator, 20 bytes
_FIELD_LIMIT = 0xFFFFFFFF  # a size or offset this large moves to a zip64 extra field
_DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01, the timestamp torch.save writes
_ZIP_VERSION, _ZIP64_VERSION = 20, 45


def row_major(shape) -> tuple[int, ...]:
    """Element strides of a contiguous tensor: ``(2, 3)`` -> ``(3, 1)``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class RawBytes:
    """Elements stored at a byte offset of a file, laid out with ``strides`` (in elements)."""

    file: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def span(self) -> int:
        """Bytes from the first to one past the last element (what one read must cover)."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        return (last + 1) * self.itemsize


def archive_prefix(entries, where: str, looked_in: str = "") -> str:
    """The folder of a ``torch.save`` archive's entries: its ``data.pkl``'s (the shortest one's)."""
    pickles = sorted((name for name in entries if name.endswith("data.pkl")), key=len)
    if not pickles:
        raise CheckpointError(f"{where}: not a torch.save archive (no data.pkl{looked_in})")
    return pickles[0][: -len("data.pkl")]


class Archive:
    """One ``torch.save`` archive at ``[offset, offset+length)`` of a checkpoint file.

    Two reads open it: its tail holds the zip directory, and its head ``data.pkl`` and the first
    storage's header. A DCP checkpoint has one archive per chunk, tens of thousands in large ones.
    """

    HEAD = TAIL = 4096

    def __init__(self, files: CheckpointFiles, relative: str, offset: int = 0, length: int | None = None):
        self.files, self.relative, self.offset = files, relative, offset
        self.length = files.size(relative) - offset if length is None else length
        self.where = str(files.path(relative)) + (f" (record at byte {offset})" if offset else "")
        files.check_range(relative, offset, self.length)  # offsets and lengths from metadata, before any read
        self._head = files.read(relative, offset, min(self.length, self.HEAD))
        try:
            self._entries = self._directory()
        except CheckpointError:  # a read that failed says why itself
            raise
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.where}: not a torch.save archive (corrupt zip directory: "
                                  f"{printable(str(exc), 120)})") from None
        self.prefix = archive_prefix(self._entries, self.where)

    def _read(self, start: int, size: int) -> bytes:
        """Bytes ``[start, start+size)`` of the archive."""
        if start + size > self.length:
            raise ValueError(f"needs bytes up to {start + size} of an archive of {self.length}")
        if start + size <= len(self._head):
            return self._head[start:start + size]
        return self.files.read(self.relative, self.offset + start, size)

    def _directory(self) -> dict[str, tuple[int, int, int, int]]:
        """``name -> (local header offset, size, compression, CRC-32)`` from the zip's central directory."""
        tail_start = max(0, self.length - self.TAIL)
        tail = self._read(tail_start, self.length - tail_start)
        end = tail.rfind(b"PK\x05\x06")
        if end < 0 or end + _END.size > len(tail):
            raise ValueError("no end of central directory")
        _, _, _, _, count, size, start, _ = _END.unpack_from(tail, end)
        if _FIELD_LIMIT in (size, start) or count == 0xFFFF:  # the real values are in the zip64 record
            if end < _LOCATOR64.size:
                raise ValueError("no zip64 end of central directory locator")
            _, _, end64, _ = _LOCATOR64.unpack_from(tail, end - _LOCATOR64.size)
            signature, *_, count, size, start = _END64.unpack(self._read(end64, _END64.size))
            if signature != b"PK\x06\x06":
                raise ValueError("no zip64 end of central directory")
        directory = tail[start - tail_start:start - tail_start + size] if start >= tail_start else self._read(start, size)
        entries, position = {}, 0
        for _ in range(count):
            fields = _CENTRAL_HEADER.unpack_from(directory, position)
            if fields[0] != b"PK\x01\x02":
                raise ValueError("bad central directory entry")
            compression, crc, entry_size, name_length, extra_length, comment_length, header = (
                fields[6], fields[9], fields[11], fields[12], fields[13], fields[14], fields[18])
            name_end = position + _CENTRAL_HEADER.size + name_length
            name = directory[position + _CENTRAL_HEADER.size:name_end].decode()
            if _FIELD_LIMIT in (entry_size, header):
                entry_size, header = _zip64_values(directory[name_end:name_end + extra_length], fields[10:12], header)
            entries[name] = (header, entry_size, compression, crc)
            position = name_end + extra_length + comment_length
        return entries

    def _data_offset(self, name: str) -> tuple[int, int]:
        """Absolute file offset and size of a stored (uncompressed) zip entry."""
        entry = self._entries.get(self.prefix + name)
        if entry is None:
            raise CheckpointError(f"{self.where}: archive has no entry {printable(name)!r}")
        header, size, compression, _ = entry
        if compression != 0:
            raise CheckpointError(f"{self.where}: entry {printable(name)!r} is compressed; torch.save never compresses")
        try:
            fields = _LOCAL_HEADER.unpack(self._read(header, _LOCAL_HEADER.size))
        except CheckpointError:  # a read that failed says why itself
            raise
        except ValueError:
            fields = (b"",)
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: corrupt zip entry {printable(name)!r}")
        start = header + _LOCAL_HEADER.size + fields[-2] + fields[-1]  # after the name and extra field
        if start + size > self.length:
            raise CheckpointError(f"{self.where}: truncated: entry {printable(name)!r} ends past the archive")
        return self.offset + start, size

    def load(self) -> Any:
        """The archived object, with tensors as ``safe_pickle.TensorRef`` (no tensor bytes are read)."""
        start, size = self._data_offset("data.pkl")
        return safe_pickle.load_bytes(self._read(start - self.offset, size), f"{self.where}/data.pkl")

    def stored_crc(self, offset: int, length: int) -> int | None:
        """The CRC-32 the zip directory records for file bytes ``[offset, offset+length)``, when they are
        exactly one stored entry's data (a chunk's whole storage); else None."""
        storages = self.prefix + "data/"
        for name, (_, size, compression, crc) in self._entries.items():
            if name.startswith(storages) and size == length and compression == 0 \
                    and self._data_offset(name[len(self.prefix):]) == (offset, size):
                return crc
        return None

    def raw_bytes(self, tensor: safe_pickle.TensorRef) -> RawBytes:
        """Where the elements of ``tensor`` are in the file, checked against the storage's size."""
        start, size = self._data_offset(f"data/{tensor.storage.key}")
        itemsize = tensor.dtype.itemsize
        raw = RawBytes(self.relative, start + tensor.storage_offset * itemsize, tensor.shape, tensor.stride, itemsize)
        if tensor.storage_offset * itemsize + raw.span > size or size < tensor.storage.numel * itemsize:
            raise CheckpointError(f"{self.where}: tensor bytes lie outside storage data/{printable(tensor.storage.key)}")
        return raw


def _zip64_values(extra: bytes, sizes: tuple[int, int], header: int) -> tuple[int, int]:
    """The entry's size and header offset, taking those too large for their fields from the zip64 extra field."""
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            uncompressed, compressed = (values.pop(0) if value == _FIELD_LIMIT else value for value in sizes[::-1])
            return uncompressed, values.pop(0) if header == _FIELD_LIMIT else header
        position += 4 + length
    raise ValueError("a size or offset is missing its zip64 field")


# ---------------------------------------------------------------------------------------------
# Writing: pickles that name torch's classes without importing torch, and streamed zip records.


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
        if isinstance(obj, (TensorRef, Record, SubclassRef)):
            raise Unpicklable(f"cannot write a {type(obj).__name__} nested in a non-tensor entry into this format: "
                              "leave that entry out with --exclude")
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

    >>> stream = PickleStream(io.BytesIO())
    >>> stream.start(); stream.save({"a": (1, None)}); stream.stop()
    >>> safe_pickle.load_bytes(stream.file.getvalue(), "streamed.pkl")
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


@dataclass
class _Record:
    name: bytes
    header: int  # where its local header starts, from the archive's start
    size: int
    pad: int  # bytes of torch's "FB" padding field, so that the data is 64-byte aligned
    data: bytes | None  # the bytes of small records; None for storages, which the caller writes

    @property
    def zip64(self) -> bool:
        return self.size >= _FIELD_LIMIT

    def local_header(self, crc: int) -> bytes:
        extra = struct.pack("<HH", 0x4246, self.pad) + b"Z" * self.pad
        size = self.size
        if self.zip64:
            extra += struct.pack("<HHQQ", 1, 16, size, size)
            size = _FIELD_LIMIT
        return _LOCAL_HEADER.pack(b"PK\x03\x04", _ZIP64_VERSION if self.zip64 else _ZIP_VERSION, 0, 0, 0, 0,
                                  _DOS_DATE, crc, size, size, len(self.name), len(extra)) + self.name + extra

    def central_header(self, crc: int) -> bytes:
        large = [value for value in (self.size, self.size, self.header) if value >= _FIELD_LIMIT]
        extra = struct.pack(f"<HH{len(large)}Q", 1, 8 * len(large), *large) if large else b""
        size, header = (min(value, _FIELD_LIMIT) for value in (self.size, self.header))
        version = _ZIP64_VERSION if large else _ZIP_VERSION
        return _CENTRAL_HEADER.pack(b"PK\x01\x02", version, 3, version, 0, 0, 0, 0, _DOS_DATE, crc, size, size,
                                    len(self.name), len(extra), 0, 0, 0, 0, header) + self.name + extra


class ArchiveLayout:
    """Where every byte of one ``torch.save`` archive goes, fixed before any of it is written.

    Nothing is compressed, so record sizes fix every offset: storage bytes can be written at their
    place in any order, by several threads or processes. The zip headers carry each record's
    CRC-32, so they come last, from ``segments(crcs)``. Offsets count from the archive's start
    (a DCP record is read as a standalone archive sliced out of its ``.distcp`` file).

    >>> import zipfile
    >>> layout = ArchiveLayout(dumps({"w": TensorOut(StorageOut("0", "float32", 3), (3,))}))
    >>> start = layout.add_storage("0", 12)
    >>> archive = bytearray(layout.close())
    >>> archive[start:start + 12] = bytes(range(12))
    >>> for offset, data in layout.segments({"0": zlib.crc32(bytes(range(12)))}):
    ...     archive[offset:offset + len(data)] = data
    >>> zipfile.ZipFile(io.BytesIO(archive)).testzip() is None   # every CRC-32 checks out
    True
    """

    ALIGNMENT = 64

    def __init__(self, pickled: bytes, name: str = "archive"):
        """``pickled``: the archived object as ``dumps`` pickles it."""
        self.prefix = name + "/"
        self.records: list[_Record] = []
        self.length = 0
        self._add("data.pkl", pickled)
        self._add(".format_version", b"1")
        self._add(".storage_alignment", b"64")
        self._add("byteorder", b"little")
        self._storages: dict[str, _Record] = {}

    def _add(self, name: str, data: bytes | None, size: int | None = None) -> int:
        encoded = (self.prefix + name).encode()
        size = len(data) if data is not None else size
        fixed = _LOCAL_HEADER.size + len(encoded) + 4 + (20 if size >= _FIELD_LIMIT else 0)
        pad = (-(self.length + fixed)) % self.ALIGNMENT
        record = _Record(encoded, self.length, size, pad, data)
        self.records.append(record)
        self.length = record.header + fixed + pad + size
        return self.length - size

    def add_storage(self, key: str, nbytes: int) -> int:
        """Reserve ``data/{key}``; returns where its bytes start."""
        start = self._add(f"data/{key}", None, nbytes)
        self._storages[key] = self.records[-1]
        return start

    def close(self) -> int:
        """Add the last record; returns the archive's length in bytes."""
        self._add("version", b"3\n")
        self._central_start = self.length
        return self.length + len(self._central({}))

    def segments(self, crcs: dict[str, int]) -> list[tuple[int, bytes]]:
        """Everything but the storage bytes, as ``(offset, bytes)``: headers, small records, the central
        directory. ``crcs`` holds the CRC-32 of every storage's bytes, by key."""
        segments: list[tuple[int, bytes]] = []
        for record in self.records:
            data = record.local_header(self._crc(record, crcs)) + (record.data or b"")
            if segments and segments[-1][0] + len(segments[-1][1]) == record.header:
                segments[-1] = (segments[-1][0], segments[-1][1] + data)  # adjacent: one write
            else:
                segments.append((record.header, data))
        segments.append((self._central_start, self._central(crcs)))
        return segments

    def _crc(self, record: _Record, crcs: dict[str, int]) -> int:
        if record.data is not None:
            return zlib.crc32(record.data)
        return crcs.get(record.name.decode()[len(self.prefix) + len("data/"):], 0)

    def _central(self, crcs: dict[str, int]) -> bytes:
        directory = b"".join(record.central_header(self._crc(record, crcs)) for record in self.records)
        start, count = self._central_start, len(self.records)
        if max(start, len(directory)) < _FIELD_LIMIT and count < 0xFFFF:
            return directory + _END.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), start, 0)
        end64 = _END64.pack(b"PK\x06\x06", _END64.size - 12, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0,
                            count, count, len(directory), start)
        locator = _LOCATOR64.pack(b"PK\x06\x07", 0, start + len(directory), 1)
        end = _END.pack(b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                        min(len(directory), _FIELD_LIMIT), min(start, _FIELD_LIMIT), 0)
        return directory + end64 + locator + end


def archive_bytes(obj: Any) -> bytes:
    """A whole ``torch.save`` archive of ``obj``, which holds no tensors (step counters, scheduler state)."""
    layout = ArchiveLayout(dumps(obj))
    archive = bytearray(layout.close())
    for offset, data in layout.segments({}):
        archive[offset:offset + len(data)] = data
    return bytes(archive)
