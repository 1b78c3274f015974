"""DCP records stored through torch's stream transforms (``_StorageInfo.transform_descriptors``).

torch 2.13 ships one transform, ``stream.zstd/1`` (``torch.distributed.checkpoint._extension.ZStandard``):
each record (a chunk's ``torch.save`` archive, or an object's) is one zstd stream. Records are read by
streaming decompression and nothing is written anywhere: a record's decompressed bytes are read under a
name of their own (``DecompressingFiles.record``), and a read of them decompresses straight into the
caller's buffer, decompressing and discarding what comes before it. Decompressors part-way through
their records (cursors) stay open, a few at a time, so that a record read in order, by one task or by
several one after another, is decompressed once; memory is the callers' buffers plus zstd's windows.

A chunk's archive is located from the head of its record alone (``CompressedArchive``): the zip's
central directory is at its end, behind the tensor's bytes, but the local headers in order give where
each entry starts. ``torch.save`` into torch's zstd stream cannot seek back, so its entries carry no
size in their local headers (``--compress zstd`` output does): a data descriptor follows each entry's
data instead, found for the small entries before the storage by its sizes and CRC-32, and the
storage's size is the one ``data.pkl`` gives. An object's record is decompressed to its end when the checkpoint
is opened, to count its bytes, and read from then on as a plain archive (objects are small).

A chunk's record is checked as a plain one is (``torch_archive.records``; torch's zstd frames carry no
checksum of their own): its storage's CRC-32 over the decompressed bytes as they pass, against the CRC-32
the archive records behind them. The read that reaches the storage's end goes on to the record's end (its
data descriptor and central directory: a few hundred bytes), so nothing is decompressed twice, and the
archive is then checked, all but the storage's bytes, as a plain record is opened.

Writing (``compress_records``) still writes each data file plain first, then rewrites it with each
record compressed in turn: for a while the file takes its plain and its compressed size on disk.

>>> files = DecompressingFiles(CheckpointFiles("step-100-zstd"))                      # doctest: +SKIP
>>> archive = CompressedArchive(files, "__0_0.distcp", 0, 743, 96 + ARCHIVE_SLACK)  # doctest: +SKIP
>>> archive.raw_bytes(archive.load())                                              # doctest: +SKIP
RawBytes(file='<zstd>/__0_0.distcp@0', offset=704, shape=(4, 6), strides=(6, 1), itemsize=4)
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcptool import dtypes, encodings, safe_pickle
from dcptool.errors import CheckpointError, UsageError, printable
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive.reading import (
    FIELD_LIMIT,
    LOCAL_HEADER,
    TORCH_ARCHIVE,
    Archive,
    RawBytes,
    archive_prefix,
    chunk_bytes,
    chunk_label,
    zip64_values,
)
from dcptool.torch_archive.records import StoredData, check_crc

ZSTD = "stream.zstd/1"  # ZStandard.get_descriptor() of torch 2.13
ZSTD_ARCHIVE = "zstd-archive"  # the chunk encoding of a torch.save archive in a zstd record
SUPPORTED = (ZSTD,)
BLOCK = 4 * 2**20  # bytes compressed at a time when writing
INPUT = 2**17  # compressed bytes read at a time (zstd's recommended input size)
HEAD = 2**14  # decompressed bytes a chunk's archive is located from: data.pkl and the headers before the storage
TRAILER_READ = 2**12  # decompressed bytes read at a time after a storage: its archive's last few hundred
CURSORS = 16  # decompressors kept open part-way through their records: two per copy thread
# A record decompresses to at most its elements plus this much archive (zip headers, data.pkl): a read
# past that is a zstd bomb, refused. Object records (pickled state) may hold up to OBJECT_LIMIT.
ARCHIVE_SLACK = 2**20
OBJECT_LIMIT = 2**30
_NAME = "<zstd>/"  # names of records' decompressed bytes: no checkpoint file can be called so
_HAS_DESCRIPTOR = 0x08  # general purpose flag: sizes and CRC-32 follow the entry's data
_DESCRIPTORS = (struct.Struct("<4sL2L"), struct.Struct("<4sL2Q"))  # signature, CRC-32, sizes (zip64: 8 bytes each)


def _zstandard():
    try:
        import zstandard
    except ImportError:
        raise UsageError("reading or writing zstd-compressed DCP needs the zstandard package: "
                         "pip install 'dcptool[zstd]'") from None
    return zstandard


def encoding_of(transforms, at: str) -> str:
    """The chunk encoding of a record stored with ``transforms`` (None or empty: a plain archive)."""
    if not transforms:
        return TORCH_ARCHIVE
    if isinstance(transforms, (list, tuple)) and tuple(transforms) == (ZSTD,):
        return ZSTD_ARCHIVE
    shown = ", ".join(printable(t, 40) if isinstance(t, str) else type(t).__name__ for t in transforms[:4]) \
        if isinstance(transforms, (list, tuple)) else type(transforms).__name__
    raise CheckpointError(f"{at} is stored with transforms [{shown}]; dcptool reads {', '.join(SUPPORTED)} only")


@dataclass
class _Record:
    """A compressed record: ``[offset, offset+length)`` of ``relative``, decompressing to at most ``limit`` bytes."""

    relative: str
    offset: int
    length: int
    limit: int
    label: str = ""  # what it holds, as messages name it (a chunk)
    size: int | None = None  # its decompressed bytes, once counted
    used_end: int | None = None  # where the bytes read of it end (a chunk's storage): a cursor there is done
    head: bytes | None = None  # its first decompressed bytes; once its storage is located, those before it
    whole: bool = False  # whether the head holds all of its bytes
    trailer: bytes | None = None  # its decompressed bytes from ``used_end`` to its end, until taken (``trailer``)
    trailer_taken: bool = False  # its storage was checked: a read that reaches ``used_end`` again keeps nothing


class _Cursor:
    """A record's decompression, ``pos`` bytes in; ``until`` is the end of the read in progress (None: idle)."""

    def __init__(self, files: DecompressingFiles, name: str, record: _Record):
        self.files, self.name, self.record = files, name, record
        window = files.window(record.relative, record.offset, record.length)
        self._reader = _zstandard().ZstdDecompressor().stream_reader(window, read_size=INPUT, read_across_frames=True)
        self.pos, self.until, self.ended = 0, None, False

    def read(self, offset: int, buffers: list[memoryview], whole: bool = True) -> int:
        """Decompress the record's bytes from ``offset`` (``pos`` or later) into ``buffers`` in turn; returns how
        many. Fewer than asked only at the record's end, which is corrupt when ``whole``."""
        zstandard = _zstandard()
        filled = 0
        try:
            if offset > self.pos:  # decompressed and discarded (seek stops at the end)
                self.pos = self._reader.seek(offset - self.pos, os.SEEK_CUR)
            self.ended = self.pos < offset
            for buffer in buffers if not self.ended else ():
                done = 0
                while done < len(buffer) and not self.ended:
                    got = self._reader.readinto(buffer[done:])
                    done += got
                    self.ended = got == 0
                filled += done
                self.pos += done
        except zstandard.ZstdError as exc:
            raise self.files.corrupt(self.name, printable(str(exc), 120)) from None
        if self.ended and whole:
            raise self.files.corrupt(self.name, f"it ends after {self.pos:,} decompressed bytes")
        return filled


class DecompressingFiles(CheckpointFiles):
    """A checkpoint's files, plus the decompressed bytes of its compressed records under names of their own
    (``record``). Those are read, never copied by the kernel (``local_fd`` is None): safe from several threads,
    each read decompressing only what lies between an open cursor of the record and the bytes it wants."""

    def __init__(self, files: CheckpointFiles):
        self.__dict__.update(files.__dict__)  # the same store, caches and lock: one view of the folder
        self._records: dict[str, _Record] = {}
        self._cursors: list[_Cursor] = []  # least recently used first
        self._waiting: list[tuple[str, int]] = []  # (name, offset) of the reads waiting for a cursor
        self._turns = threading.Condition()

    def record(self, relative: str, offset: int, length: int, limit: int, label: str = "") -> str:
        """The name that the decompressed bytes of the record ``[offset, offset+length)`` of ``relative`` are read
        under; a read past ``limit`` bytes of them is refused (a zstd bomb). ``label`` names what it holds."""
        self.check_range(relative, offset, length)
        name = f"{_NAME}{relative}@{offset}"
        with self._turns:
            self._records.setdefault(name, _Record(relative, offset, length, limit, label))
        return name

    def state_of(self, name: str) -> _Record:
        """What is known of the record read under ``name`` (``record``): its head, how far its storage ends."""
        return self._records[name]

    def decompressed(self, relative: str, offset: int, length: int, limit: int = OBJECT_LIMIT,
                     label: str = "") -> tuple[str, int]:
        """``(name, size)`` of a record's decompressed bytes (``record``), decompressed to the end once to count
        them: an object's record, read as a whole archive (its zip directory is at its end)."""
        name = self.record(relative, offset, length, limit, label)
        record = self._records[name]
        if record.size is None:
            cursor = _Cursor(self, name, record)
            cursor.read(limit + 1, [], whole=False)  # stops at the end
            if cursor.pos > limit:
                raise self.too_large(name)
            record.size = cursor.pos
        return name, record.size

    def head(self, name: str, size: int) -> bytes:
        """The first ``size`` bytes of a record's decompressed bytes (all of them when there are fewer), kept
        (``CompressedArchive`` keeps those before the storage: all that locating the storage again needs)."""
        record = self._records[name]
        if record.head is None:
            buffer = bytearray(size)
            got = _Cursor(self, name, record).read(0, [memoryview(buffer)], whole=False)
            record.head, record.whole = bytes(buffer[:got]), got < size
        return record.head

    def trailer(self, name: str) -> bytes:
        """A record's decompressed bytes after the storage a chunk's bytes are read from (``used_end``): its
        archive's data descriptor and central directory, what its storage's CRC-32 is checked against. Kept
        by the read that reaches ``used_end``, which goes on to the record's end (a few hundred bytes more),
        until taken by this; decompressed again only where no read kept them."""
        record = self._records[name]
        if record.trailer is None:
            self._keep_trailer(_Cursor(self, name, record), record)
        trailer, record.trailer, record.trailer_taken = record.trailer, None, True
        return trailer

    def _keep_trailer(self, cursor: _Cursor, record: _Record) -> None:
        """Read ``cursor`` (at or before ``used_end``) to the record's end, keeping the bytes from ``used_end``."""
        cursor.read(record.used_end, [], whole=False)
        trailer = bytearray()
        while not cursor.ended:
            if cursor.pos > record.limit:
                raise self.too_large(cursor.name)
            piece = bytearray(min(TRAILER_READ, record.limit + 1 - cursor.pos))
            trailer += piece[:cursor.read(cursor.pos, [memoryview(piece)], whole=False)]
        record.trailer = bytes(trailer)

    def corrupt(self, name: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self._named(name)} is corrupt ({why})")

    def too_large(self, name: str) -> CheckpointError:
        return CheckpointError(f"{self._named(name)} decompresses to more than the {self._records[name].limit:,} "
                               "bytes it can hold")

    def _named(self, name: str) -> str:
        record = self._records[name]
        held = f" of {printable(record.label)}" if record.label else ""
        return f"{super().path(record.relative)}: the zstd record{held} at byte {record.offset:,}"

    # Records' names read through cursors; all others as the checkpoint's files.

    def stored_in(self, relative: str) -> str:
        return self._records[relative].relative if relative.startswith(_NAME) else relative

    def path(self, relative: str):
        record = self._records.get(relative)
        if record is not None:
            return f"{super().path(record.relative)} (zstd record at byte {record.offset:,})"
        return super().path(relative)

    def _size_or_none(self, relative: str) -> int | None:
        record = self._records.get(relative)
        if record is not None:  # its size once counted; until then the most it may hold
            return record.limit if record.size is None else record.size
        return super()._size_or_none(relative)

    def local_fd(self, relative: str) -> int | None:
        return None if relative in self._records else super().local_fd(relative)

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        record = self._records.get(relative)
        if record is None:
            super().read_into(relative, offset, buffer)
            return
        end = offset + len(buffer)
        if end > record.limit:
            raise self.too_large(relative)
        self.check_range(relative, offset, end - offset)
        if end == offset:
            return
        cursor = self._take(relative, record, offset, end)
        failed = True
        try:
            cursor.read(offset, [buffer])
            if cursor.pos == record.used_end and record.trailer is None and not record.trailer_taken \
                    and self.verify_records:
                self._keep_trailer(cursor, record)  # what the storage's CRC-32 is checked against, as it passes
            failed = False
        finally:
            self._give_back(cursor, failed)

    def _take(self, name: str, record: _Record, offset: int, end: int) -> _Cursor:
        """An open cursor of the record at ``offset`` or before it (the nearest), else a new one; marked busy
        until ``end``. A read waits for a busy cursor that will stop at or before its ``offset``, and for the
        reads waiting nearer a cursor than itself: a record read in order by several threads (consecutive tasks
        of one chunk) is decompressed once, each read continuing where the one before it stopped."""
        ticket = (name, offset)  # told apart from other waiters' by identity
        with self._turns:
            try:
                while True:
                    mine = [c for c in self._cursors if c.name == name]
                    idle = [c for c in mine if c.until is None and c.pos <= offset]
                    nearest = max(idle, key=lambda c: c.pos, default=None)
                    if nearest is not None and not any(
                            w is not ticket and w[0] == name and nearest.pos <= w[1] < offset for w in self._waiting):
                        self._cursors.remove(nearest)
                        cursor = nearest
                        break
                    if nearest is None and not any(c.until is not None and c.until <= offset for c in mine):
                        cursor = _Cursor(self, name, record)
                        break
                    if not any(w is ticket for w in self._waiting):
                        self._waiting.append(ticket)
                    self._turns.wait()
            finally:
                if any(w is ticket for w in self._waiting):  # the reads it kept waiting look again
                    self._waiting[:] = [w for w in self._waiting if w is not ticket]
                    self._turns.notify_all()
            cursor.until = end
            self._cursors.append(cursor)
            self._evict()
            return cursor

    def _give_back(self, cursor: _Cursor, failed: bool) -> None:
        with self._turns:
            cursor.until = None
            used_end = cursor.record.used_end
            # After an error its state is unknown; at the end of what is read it has nothing left to give.
            if failed or cursor.ended or (used_end is not None and cursor.pos >= used_end):
                self._cursors.remove(cursor)
            self._evict()
            self._turns.notify_all()

    def _evict(self) -> None:
        """Close the least recently used idle cursors beyond ``CURSORS`` (their windows are most of their memory)."""
        idle = [c for c in self._cursors if c.until is None]
        for cursor in idle[:max(0, len(self._cursors) - CURSORS)]:
            self._cursors.remove(cursor)

    def close(self) -> None:
        super().close()
        with self._turns:
            self._cursors.clear()


class CompressedArchive:
    """A chunk's ``torch.save`` archive in a zstd record, located from the record's first ``HEAD`` decompressed
    bytes; ``load`` and ``raw_bytes`` as ``torch_archive.Archive``'s, the elements read under the record's name."""

    def __init__(self, files: DecompressingFiles, relative: str, offset: int, length: int, limit: int,
                 label: str = ""):
        self.files, self.relative, self.offset, self.limit = files, relative, offset, limit
        self.name = files.record(relative, offset, length, limit, label)
        self.where = f"{files.path(relative)} (record of {printable(label)} at byte {offset:,}, zstd)" if label else \
            str(files.path(self.name))
        self._head = files.head(self.name, min(HEAD, limit))
        try:
            self._entries = _local_entries(self._head)
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.where}: not a torch.save archive (corrupt zip header: "
                                  f"{printable(str(exc), 120)})") from None
        self.prefix = archive_prefix(self._entries, self.where, f" in its first {HEAD:,} bytes")

    def _entry(self, name: str) -> tuple[int, int | None]:
        entry = self._entries.get(self.prefix + name)
        if entry is None:
            raise CheckpointError(f"{self.where}: archive has no entry {printable(name)!r} in its first {HEAD:,} bytes")
        return entry

    def load(self) -> Any:
        """The archived object, with tensors as ``safe_pickle.TensorRef``."""
        start, size = self._entry("data.pkl")
        if size is None:
            raise CheckpointError(f"{self.where}: data.pkl does not end within the archive's first {HEAD:,} bytes")
        return safe_pickle.load_bytes(self._head[start:start + size], f"{self.where}/data.pkl")

    def _storage(self, tensor: safe_pickle.TensorRef) -> tuple[int, int]:
        """``(start, size)`` of the storage of ``tensor`` in the record's decompressed bytes: no read of the
        chunk goes past it (``used_end``)."""
        start, size = self._entry(f"data/{tensor.storage.key}")
        if size is None:  # said only by its data descriptor, behind its bytes: the size data.pkl gives it
            size = tensor.storage.numel * tensor.dtype.itemsize
        if start + size > self.limit:
            raise self.files.too_large(self.name)
        record = self.files.state_of(self.name)
        record.used_end = start + size
        if not record.whole:
            record.head = self._head[:start]
        return start, size

    def raw_bytes(self, tensor: safe_pickle.TensorRef) -> RawBytes:
        """Where the elements of ``tensor`` are in the record's decompressed bytes, checked against its storage."""
        start, size = self._storage(tensor)
        itemsize = tensor.dtype.itemsize
        raw = RawBytes(self.name, start + tensor.storage_offset * itemsize, tensor.shape, tensor.stride, itemsize)
        if tensor.storage_offset * itemsize + raw.span > size or size < tensor.storage.numel * itemsize:
            raise CheckpointError(f"{self.where}: tensor bytes lie outside storage "
                                  f"data/{printable(tensor.storage.key)}")
        return raw

    def stored_data(self) -> StoredData | None:
        """The chunk's storage, whose CRC-32 is checked where its bytes are read, as a plain record's
        (``torch_archive.records``). The CRC-32 and the archive's central directory follow the storage in
        the stream: they are read after it (``DecompressingFiles.trailer``), and the whole archive but the
        storage's bytes is then checked as a plain record is opened (``recorded_after``). A record that
        ends within its head is checked whole now (None: nothing left to check)."""
        tensor = self.load()
        if not isinstance(tensor, safe_pickle.TensorRef):
            raise CheckpointError(f"{self.where}: holds {type(tensor).__name__}, not a tensor")
        start, size = self._storage(tensor)
        entry = f"{self.where}: data/{printable(tensor.storage.key)}"
        if self.files.state_of(self.name).whole:
            found = _checked(self._head, b"", len(self._head), self.where).storage_data()
            check_crc(entry, zlib.crc32(self._head[start:start + size]),
                      next((stored.crc for stored in found if stored.offset == start), None))
            return None
        return StoredData(self.name, start, size, None, entry, recorded_after=functools.partial(
            _recorded_crc, self.files, self.name, self._head[:start], start, size, self.where))


def _recorded_crc(files: DecompressingFiles, name: str, before: bytes, start: int, size: int, where: str) -> int | None:
    """The CRC-32 a zstd record's archive records for its storage ``[start, start+size)`` (``before`` are the
    bytes before it), the archive's whole structure checked over the bytes before and after the storage."""
    archive = _checked(before, files.trailer(name), start + size, where)
    found = [stored for stored in archive.storage_data() if stored.offset == start and stored.size == size]
    if len(found) != 1:
        raise CheckpointError(f"{where}: damaged zip record: its central directory has no storage of "
                              f"{size:,} bytes at byte {start:,}, where its local headers place it")
    return found[0].crc


def _checked(head: bytes, trailer: bytes, trailer_at: int, where: str) -> Archive:
    """A record's archive, checked as a plain record is opened (``torch_archive.Archive``), from the bytes
    known of it: ``head`` from its start, ``trailer`` from ``trailer_at`` to its end (the storage's bytes
    between are not needed)."""
    known = _KnownBytes(where, head, trailer, trailer_at)
    return Archive(known, "", 0, known.size(""), where=where, head=len(head), tail=len(trailer) or Archive.TAIL)


class _KnownBytes:
    """The bytes known of a record, as the files a ``torch_archive.Archive`` reads: its head, and its trailer
    from ``trailer_at`` on (an archive opened reads no storage's bytes)."""

    verify_records = True

    def __init__(self, where: str, head: bytes, trailer: bytes, trailer_at: int):
        self.where, self.head, self.trailer, self.trailer_at = where, head, trailer, trailer_at

    def size(self, relative: str) -> int:
        return self.trailer_at + len(self.trailer)

    def path(self, relative: str) -> str:
        return self.where

    def check_range(self, relative: str, offset: int, length: int) -> None:
        pass  # the archive reads within its length, which is this one's size

    def read(self, relative: str, offset: int, length: int) -> bytes:
        if offset + length <= len(self.head):
            return self.head[offset:offset + length]
        if offset >= self.trailer_at:
            return self.trailer[offset - self.trailer_at:offset - self.trailer_at + length]
        raise ValueError(f"it places a zip structure at bytes {offset:,}..{offset + length:,}, in its storage")


def _local_entries(head: bytes) -> dict[str, tuple[int, int | None]]:
    """``name -> (data start, size)`` of the stored zip entries whose local headers lie in ``head``, an archive's
    first bytes, walked in order; the size is None for the last one when its end is beyond ``head``."""
    entries: dict[str, tuple[int, int | None]] = {}
    position = 0
    while head.startswith(b"PK\x03\x04", position) and position + LOCAL_HEADER.size <= len(head):
        fields = LOCAL_HEADER.unpack_from(head, position)
        flags, method, size, name_length, extra_length = fields[3], fields[4], fields[9], fields[10], fields[11]
        name_end = position + LOCAL_HEADER.size + name_length
        start = name_end + extra_length
        if start > len(head):
            break
        name = head[position + LOCAL_HEADER.size:name_end].decode()
        if method != 0:
            raise ValueError(f"entry {name!r} is compressed; torch.save never compresses")
        end = None
        if flags & _HAS_DESCRIPTOR:
            size, end = _described(head, start) or (None, None)
        elif size == FIELD_LIMIT:
            size, _ = zip64_values(head[name_end:start], (fields[8], fields[9]), 0)
        entries[name] = (start, size)
        if size is None:
            break
        position = end if end is not None else start + size
    return entries


def _described(head: bytes, start: int) -> tuple[int, int] | None:
    """``(size, end of its descriptor)`` of the entry whose data starts at ``start`` and is followed by a data
    descriptor: the first descriptor whose sizes and CRC-32 match the bytes before it; None if not in ``head``."""
    at = head.find(b"PK\x07\x08", start)
    while at >= 0:
        for descriptor in _DESCRIPTORS:
            if at + descriptor.size <= len(head):
                _, crc, compressed, uncompressed = descriptor.unpack_from(head, at)
                if compressed == uncompressed == at - start and crc == zlib.crc32(head[start:at]):
                    return at - start, at + descriptor.size
        at = head.find(b"PK\x07\x08", at + 1)
    return None


def compress_records(folder: Path, name: str, records: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Rewrite ``folder/name`` with each record ``(offset, length)`` compressed, in order, as torch's
    ZStandard extension writes them; returns the records' new ``(offset, length)``. Streams in ``BLOCK``s."""
    zstandard = _zstandard()
    source, target = folder / name, folder / f"{name}.zstd-partial"
    placed = []
    with open(source, "rb") as raw, open(target, "wb") as out:
        for offset, length in records:
            start = out.tell()
            raw.seek(offset)
            writer = zstandard.ZstdCompressor().stream_writer(out, closefd=False, size=length)
            left = length
            while left:
                block = raw.read(min(BLOCK, left))
                writer.write(block)
                left -= len(block)
            writer.close()
            placed.append((start, out.tell() - start))
    os.replace(target, source)
    return placed


def _locate(files: DecompressingFiles, tensor, chunk) -> RawBytes:
    """A chunk's elements in its zstd record: located from the record's head, read by streaming decompression."""
    archive = CompressedArchive(files, chunk.file, chunk.offset, chunk.length, _limit(tensor, chunk),
                                chunk_label(tensor.key, chunk))
    return chunk_bytes(archive, tensor, chunk)


def _limit(tensor, chunk) -> int:
    """The most bytes a chunk's record may decompress to: its elements and an archive around them."""
    return chunk.numel * dtypes.dtype(tensor.dtype).itemsize + ARCHIVE_SLACK


def _stored(files: DecompressingFiles, tensor, chunk, label: str) -> StoredData | None:
    """The storage of a chunk's zstd record, checked where its bytes are read (``CompressedArchive.stored_data``)."""
    return CompressedArchive(files, chunk.file, chunk.offset, chunk.length, _limit(tensor, chunk),
                             label).stored_data()


encodings.register(encodings.Encoding(ZSTD_ARCHIVE, locate=_locate, record=_stored, front_to_back=True))
