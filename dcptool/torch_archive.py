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
import zipfile
from dataclasses import dataclass
from typing import Any

from dcptool import dtypes as dtype_table
from dcptool import safe_pickle
from dcptool.safe_pickle import Record, SubclassRef, TensorRef
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes


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


class Archive:
    """One ``torch.save`` archive at ``[offset, offset+length)`` of a checkpoint file."""

    def __init__(self, files: CheckpointFiles, relative: str, offset: int = 0, length: int | None = None):
        self.files, self.relative, self.offset = files, relative, offset
        self.length = files.size(relative) - offset if length is None else length
        self.where = str(files.path(relative)) + (f" (record at byte {offset})" if offset else "")
        try:
            with zipfile.ZipFile(files.window(relative, offset, self.length)) as archive:
                infos = archive.infolist()
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{self.where}: not a torch.save archive ({exc})") from None
        self._entries = {info.filename: info for info in infos}
        pickles = sorted((n for n in self._entries if n.endswith("data.pkl")), key=len)
        if not pickles:
            raise CheckpointError(f"{self.where}: not a torch.save archive (no data.pkl)")
        self.prefix = pickles[0][: -len("data.pkl")]

    def _data_offset(self, name: str) -> tuple[int, int]:
        """Absolute file offset and size of a stored (uncompressed) zip entry."""
        info = self._entries.get(self.prefix + name)
        if info is None:
            raise CheckpointError(f"{self.where}: archive has no entry {name!r}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.where}: entry {name!r} is compressed; torch.save never compresses")
        header = self.files.read(self.relative, self.offset + info.header_offset, _LOCAL_HEADER.size)
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: corrupt zip entry {name!r}")
        name_length, extra_length = fields[-2], fields[-1]
        start = self.offset + info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        return start, info.file_size

    def load(self) -> Any:
        """The archived object, with tensors as ``safe_pickle.TensorRef`` (no tensor bytes are read)."""
        start, size = self._data_offset("data.pkl")
        return safe_pickle.load_bytes(self.files.read(self.relative, start, size), f"{self.where}/data.pkl")

    def raw_bytes(self, tensor: safe_pickle.TensorRef) -> RawBytes:
        """Where the elements of ``tensor`` are in the file, checked against the storage's size."""
        start, size = self._data_offset(f"data/{tensor.storage.key}")
        itemsize = tensor.dtype.itemsize
        raw = RawBytes(self.relative, start + tensor.storage_offset * itemsize, tensor.shape, tensor.stride, itemsize)
        if tensor.storage_offset * itemsize + raw.span > size or size < tensor.storage.numel * itemsize:
            raise CheckpointError(f"{self.where}: tensor bytes lie outside storage data/{tensor.storage.key}")
        return raw


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


class _TorchPickler(pickle._Pickler):  # the pure-Python pickler lets us emit globals without importing them
    dispatch = pickle._Pickler.dispatch.copy()

    def persistent_id(self, obj):
        if isinstance(obj, StorageOut):
            storage_class = dtype_table.dtype(obj.dtype).storage_class
            return ("storage", Global("torch", storage_class), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if isinstance(obj, TensorOut):
            rebuild = Global("torch._utils", "_rebuild_tensor_v2")
            ordered_dict = Reduced(Global("collections", "OrderedDict"), ())
            return (rebuild, (obj.storage, 0, torch_size(obj.shape), torch_size(obj.strides()), False, ordered_dict))
        if isinstance(obj, Reduced):
            return (obj.func, obj.args, obj.state)
        if isinstance(obj, (TensorRef, Record, SubclassRef)):
            raise CheckpointError(f"cannot re-save a {type(obj).__name__} found inside a non-tensor entry")
        return NotImplemented

    def save_reduce(self, func, args, state=None, *rest, obj=None):
        if isinstance(func, Global) and func.name == "__newobj__":
            cls, *cls_args = args  # NEWOBJ: cls.__new__(cls, *args), without the pickler's class checks
            self.save(cls)
            self.save(tuple(cls_args))
            self.write(pickle.NEWOBJ)
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
    """Pickle ``obj``, in which ``Global``, ``Reduced``, ``StorageOut`` and ``TensorOut`` stand for torch objects."""
    buffer = io.BytesIO()
    _TorchPickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()


class ArchiveWriter:
    """Writes one ``torch.save`` archive at the current position of ``stream``, storages streamed in.

    >>> with open("t.pt", "wb") as f:                                   # doctest: +SKIP
    ...     w = ArchiveWriter(f)
    ...     s = StorageOut("0", "float32", 3)
    ...     w.add_pickle({"w": TensorOut(s, (3,))})
    ...     w.add_storage(s, [b"\\0" * 12])
    ...     w.close()
    """

    ALIGNMENT = 64

    def __init__(self, stream, name: str = "archive"):
        self.stream, self.name = _Shifted(stream), name
        self.start = 0
        self.zip = zipfile.ZipFile(self.stream, "w", compression=zipfile.ZIP_STORED, allowZip64=True)

    def _entry(self, name: str, size: int) -> zipfile.ZipInfo:
        info = zipfile.ZipInfo(f"{self.name}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64_extra = 20 if size > 0xFFFF0000 else 0  # zipfile adds a zip64 size field to large entries
        header = _LOCAL_HEADER.size + len(info.filename.encode()) + zip64_extra
        pad = (-(self.stream.tell() - self.start + header + 4)) % self.ALIGNMENT
        info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch pads with an "FB" field
        return info

    def add_bytes(self, name: str, data: bytes) -> None:
        with self.zip.open(self._entry(name, len(data)), "w", force_zip64=len(data) > 0xFFFF0000) as entry:
            entry.write(data)

    def add_pickle(self, obj: Any) -> None:
        self.add_bytes("data.pkl", dumps(obj))
        self.add_bytes(".format_version", b"1")
        self.add_bytes(".storage_alignment", b"64")
        self.add_bytes("byteorder", b"little")

    def add_storage(self, storage: StorageOut, pieces) -> None:
        """Stream a storage's bytes from ``pieces`` (an iterable of buffers, in order)."""
        size = storage.numel * dtype_table.dtype(storage.dtype).itemsize
        written = 0
        with self.zip.open(self._entry(f"data/{storage.key}", size), "w", force_zip64=size > 0xFFFF0000) as entry:
            for piece in pieces:
                entry.write(piece)
                written += len(piece)
        if written != size:
            raise RuntimeError(f"storage {storage.key}: wrote {written} bytes, expected {size}")

    def close(self) -> int:
        """Finish the archive; returns its length in bytes."""
        self.add_bytes("version", b"3\n")
        self.zip.close()
        return self.stream.tell() - self.start


class _Shifted(io.RawIOBase):
    """A write stream whose positions count from where it was opened.

    zipfile records absolute positions, but torch reads a DCP record as a standalone archive
    sliced out of its ``.distcp`` file, so offsets must start at the record.
    """

    def __init__(self, stream):
        self._stream, self._base = stream, stream.tell()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        return self._stream.write(data)

    def tell(self) -> int:
        return self._stream.tell() - self._base

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            offset += self._base
        return self._stream.seek(offset, whence) - self._base

    def flush(self) -> None:
        self._stream.flush()
