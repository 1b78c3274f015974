"""Reading a ``torch.save`` archive without torch: its zip directory, its pickle, where each tensor's bytes are.

Also the chunk encoding of such archives (``TORCH_ARCHIVE``, registered with ``dcptool.encodings``):
DCP stores each tensor chunk as an archive at an offset inside a ``.distcp`` file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from dcptool import encodings, safe_pickle
from dcptool.errors import CheckpointError, printable
from dcptool.safe_pickle import TensorRef
from dcptool.storage import CheckpointFiles

# Zip structures (stored entries only; torch.save never compresses), as in the zip specification (APPNOTE).
LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # local file header, 30 bytes
CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")  # central directory file header, 46 bytes
END = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
LOCATOR64 = struct.Struct("<4sLQL")  # zip64 end of central directory locator, 20 bytes
FIELD_LIMIT = 0xFFFFFFFF  # a size or offset this large moves to a zip64 extra field
DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01, the timestamp torch.save writes
ZIP_VERSION, ZIP64_VERSION = 20, 45
TORCH_ARCHIVE = "torch-archive"  # the chunk encoding of a torch.save archive of one tensor (DCP's chunk records)


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
        if end < 0 or end + END.size > len(tail):
            raise ValueError("no end of central directory")
        _, _, _, _, count, size, start, _ = END.unpack_from(tail, end)
        if FIELD_LIMIT in (size, start) or count == 0xFFFF:  # the real values are in the zip64 record
            if end < LOCATOR64.size:
                raise ValueError("no zip64 end of central directory locator")
            _, _, end64, _ = LOCATOR64.unpack_from(tail, end - LOCATOR64.size)
            signature, *_, count, size, start = END64.unpack(self._read(end64, END64.size))
            if signature != b"PK\x06\x06":
                raise ValueError("no zip64 end of central directory")
        directory = tail[start - tail_start:start - tail_start + size] if start >= tail_start else self._read(start, size)
        entries, position = {}, 0
        for _ in range(count):
            fields = CENTRAL_HEADER.unpack_from(directory, position)
            if fields[0] != b"PK\x01\x02":
                raise ValueError("bad central directory entry")
            compression, crc, entry_size, name_length, extra_length, comment_length, header = (
                fields[6], fields[9], fields[11], fields[12], fields[13], fields[14], fields[18])
            name_end = position + CENTRAL_HEADER.size + name_length
            name = directory[position + CENTRAL_HEADER.size:name_end].decode()
            if FIELD_LIMIT in (entry_size, header):
                entry_size, header = zip64_values(directory[name_end:name_end + extra_length], fields[10:12], header)
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
            fields = LOCAL_HEADER.unpack(self._read(header, LOCAL_HEADER.size))
        except CheckpointError:  # a read that failed says why itself
            raise
        except ValueError:
            fields = (b"",)
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: corrupt zip entry {printable(name)!r}")
        start = header + LOCAL_HEADER.size + fields[-2] + fields[-1]  # after the name and extra field
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


def zip64_values(extra: bytes, sizes: tuple[int, int], header: int) -> tuple[int, int]:
    """The entry's size and header offset, taking those too large for their fields from the zip64 extra field."""
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        if tag == 1:
            values = list(struct.unpack_from(f"<{length // 8}Q", extra, position + 4))
            uncompressed, compressed = (values.pop(0) if value == FIELD_LIMIT else value for value in sizes[::-1])
            return uncompressed, values.pop(0) if header == FIELD_LIMIT else header
        position += 4 + length
    raise ValueError("a size or offset is missing its zip64 field")


def chunk_bytes(archive, tensor, chunk) -> RawBytes:
    """Where the elements of ``chunk`` (a ``core.Chunk`` of ``tensor``) are in ``archive`` (an ``Archive``, or
    another with its ``load``, ``raw_bytes`` and ``where``), checked against the dtype and sizes the metadata
    gives them."""
    ref = archive.load()
    if not isinstance(ref, TensorRef) or tuple(ref.shape) != chunk.sizes or ref.dtype.name != tensor.dtype:
        held = f"{ref.dtype.name}{list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__
        raise CheckpointError(f"{archive.where}: holds {held}, but the metadata says {tensor.key} chunk at "
                              f"{list(chunk.offsets)} is {tensor.dtype}{list(chunk.sizes)}")
    return archive.raw_bytes(ref)


def _chunk_archive(files: CheckpointFiles, chunk) -> Archive:
    return Archive(files, chunk.file, chunk.offset, chunk.length)


encodings.register(encodings.Encoding(  # torch.save lays out every archive of one dtype and shape alike
    TORCH_ARCHIVE,
    locate=lambda files, tensor, chunk: chunk_bytes(_chunk_archive(files, chunk), tensor, chunk),
    stored_crc=lambda files, chunk, offset, length: _chunk_archive(files, chunk).stored_crc(offset, length),
    uniform=True,
))
