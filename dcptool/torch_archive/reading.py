"""Reading a ``torch.save`` archive without torch: its zip directory, its pickle, where each tensor's bytes are.

Also the chunk encoding of such archives (``TORCH_ARCHIVE``, registered with ``dcptool.encodings``):
DCP stores each tensor chunk as an archive at an offset inside a ``.distcp`` file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from zlib_ng.zlib_ng import crc32

from dcptool import encodings, safe_pickle
from dcptool.errors import CheckpointError, printable
from dcptool.safe_pickle import TensorRef
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive.layouts import RecordLayout
from dcptool.torch_archive.records import StoredData, check_crc, crc_of_range, record_checks

# Zip structures (stored entries only; torch.save never compresses), as in the zip specification (APPNOTE).
LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # local file header, 30 bytes
CENTRAL_HEADER = struct.Struct("<4s4B4HL2L5H2L")  # central directory file header, 46 bytes
END = struct.Struct("<4s4H2LH")  # end of central directory, 22 bytes
END64 = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory, 56 bytes
LOCATOR64 = struct.Struct("<4sLQL")  # zip64 end of central directory locator, 20 bytes
DESCRIPTORS = (struct.Struct("<LLL"), struct.Struct("<LQQ"))  # a data descriptor's CRC-32 and sizes, 4 or 8 bytes each
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


def record_name(files: CheckpointFiles, relative: str, offset: int, label: str = "") -> str:
    """How messages name the archive at ``offset`` of ``relative`` that holds ``label`` (a key, a chunk)."""
    at = f" at byte {offset:,}" if offset else ""
    return str(files.path(relative)) + (f" (record of {printable(label)}{at})" if label else
                                        f" (record at byte {offset})" if offset else "")


def archive_prefix(entries, where: str, looked_in: str = "") -> str:
    """The folder of a ``torch.save`` archive's entries: its ``data.pkl``'s (the shortest one's)."""
    pickles = sorted((name for name in entries if name.endswith("data.pkl")), key=len)
    if not pickles:
        raise CheckpointError(f"{where}: not a torch.save archive (no data.pkl{looked_in})")
    return pickles[0][: -len("data.pkl")]


@dataclass(frozen=True)
class ZipEntry:
    """An entry of an archive's central directory: its local header's offset in the archive, its size and
    CRC-32, and the fields its local header repeats."""

    header: int
    size: int
    compression: int
    crc: int
    flags: int
    time: int
    date: int


class Archive:
    """One ``torch.save`` archive at ``[offset, offset+length)`` of a checkpoint file.

    Two reads open it: its tail holds the zip directory, and its head ``data.pkl`` and the first
    storage's header (a third, checked, reads the data descriptor after a storage that ends in neither).
    A DCP checkpoint has one archive per chunk, tens of thousands in large ones.

    Unless the files say not to (``files.verify_records``, ``--no-verify-records``), the archive is checked
    as torch's reader would check it, and more: the end records (zip64 included) against each other and
    the central directory, every local header against its directory entry, entries inside the archive
    and apart, and the CRC-32 of every entry but the storages (``storage_data`` gives those, checked where
    their bytes are read: ``records``). ``label`` names what the archive holds in messages (a key), ``where``
    (when given) the archive itself; ``head`` and ``tail``: the bytes its first and last reads take.
    """

    HEAD = TAIL = 4096

    def __init__(self, files: CheckpointFiles, relative: str, offset: int = 0, length: int | None = None,
                 label: str = "", where: str | None = None, head: int = HEAD, tail: int = TAIL):
        self.files, self.relative, self.offset = files, relative, offset
        self.length = files.size(relative) - offset if length is None else length
        self.labelled = bool(label) or where is not None  # whether messages name what it holds already
        self.where = where or record_name(files, relative, offset, label)
        self.checked = getattr(files, "verify_records", True)
        files.check_range(relative, offset, self.length)  # offsets and lengths from metadata, before any read
        self._head = files.read(relative, offset, min(self.length, head))
        self._tail_start = max(0, self.length - tail)
        self._tail = self._head[self._tail_start:] if self.length <= head else \
            files.read(relative, offset + self._tail_start, self.length - self._tail_start)
        self._starts: dict[str, int] = {}
        self._descriptors: dict[str, int] = {}  # where the data descriptors' CRC-32s are (entries that have one)
        try:
            self._entries = self._directory()
        except CheckpointError:  # a read that failed says why itself
            raise
        except Damaged as exc:
            raise CheckpointError(f"{self.where}: damaged zip record: {exc}") from None
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{self.where}: not a torch.save archive (corrupt zip directory: "
                                  f"{printable(str(exc), 120)})") from None
        self.prefix = archive_prefix(self._entries, self.where)
        # torch.save with set_crc32_options(False) stores 0 for every CRC-32: there are none to check
        self.crc_recorded = any(entry.crc for entry in self._entries.values())
        if self.checked:
            self._check_entries()
            if offset == 0 and length is None:  # a whole torch.save file: its tensors are read as plain bytes
                record_checks(files).add_file(relative, self.storage_data())

    def _read(self, start: int, size: int) -> bytes:
        """Bytes ``[start, start+size)`` of the archive."""
        if start < 0 or start + size > self.length:
            raise ValueError(f"needs bytes up to {start + size} of an archive of {self.length}")
        if start + size <= len(self._head):
            return self._head[start:start + size]
        if start >= self._tail_start:
            return self._tail[start - self._tail_start:start - self._tail_start + size]
        return self.files.read(self.relative, self.offset + start, size)

    def _directory(self) -> dict[str, ZipEntry]:
        """``name -> ZipEntry`` from the zip's central directory, its end records checked when ``checked``."""
        tail, checked = self._tail, self.checked
        end = tail.rfind(b"PK\x05\x06")
        if end < 0 or end + END.size > len(tail):
            raise ValueError("no end of central directory")
        end_at = self._tail_start + end
        _, disk, first_disk, on_disk, count, size, start, comment = END.unpack_from(tail, end)
        if checked and (end_at + END.size + comment != self.length or disk or first_disk or on_disk != count):
            raise Damaged("the end of central directory record is corrupt")
        directory_end = end_at
        locator = tail[end - LOCATOR64.size:end - LOCATOR64.size + 4] == b"PK\x06\x07" if end >= LOCATOR64.size else False
        # torch.save writes zip64 end records into every archive; a reader takes them whenever they are there
        if FIELD_LIMIT in (size, start) or count == 0xFFFF or (checked and locator):
            if not locator:
                raise ValueError("no zip64 end of central directory locator")
            _, locator_disk, end64, disks = LOCATOR64.unpack_from(tail, end - LOCATOR64.size)
            signature, record_size, _, _, disk64, first_disk64, on_disk64, count64, size64, start64 = \
                END64.unpack(self._read(end64, END64.size))
            if signature != b"PK\x06\x06":
                raise (Damaged if checked else ValueError)("no zip64 end of central directory where its locator says")
            if checked:
                if locator_disk or disks != 1 or end64 + 12 + record_size != end_at - LOCATOR64.size:
                    raise Damaged("the zip64 end of central directory locator is corrupt")
                if disk64 or first_disk64 or on_disk64 != count64 or any(
                        short not in (limit, value) for short, limit, value in
                        ((count, 0xFFFF, count64), (size, FIELD_LIMIT, size64), (start, FIELD_LIMIT, start64))):
                    raise Damaged("the zip64 end of central directory record is corrupt (it disagrees with the "
                                  "end of central directory)")
            count, size, start = count64, size64, start64
            directory_end = end64
        if checked and start + size != directory_end:
            raise Damaged(f"the central directory ({size:,} bytes at {start:,}) does not end where the end "
                          f"records begin ({directory_end:,})")
        self._directory_start = start
        directory = self._read(start, size)
        entries, position = {}, 0
        self._central: dict[str, int] = {}  # where each entry's central directory header starts in the archive
        for _ in range(count):
            fields = CENTRAL_HEADER.unpack_from(directory, position)
            if fields[0] != b"PK\x01\x02":
                raise (Damaged if checked else ValueError)("bad central directory entry")
            flags, compression, time, date, crc, packed, entry_size = fields[5:12]
            name_length, extra_length, comment_length, disk_start, header = fields[12:16] + (fields[18],)
            name_end = position + CENTRAL_HEADER.size + name_length
            name = directory[position + CENTRAL_HEADER.size:name_end].decode()
            if FIELD_LIMIT in (entry_size, header):
                entry_size, header = zip64_values(directory[name_end:name_end + extra_length], fields[10:12], header)
            if checked and (name in entries or flags & 1 or packed != fields[11] or disk_start
                            or header + LOCAL_HEADER.size > start):
                raise Damaged(f"the central directory entry of {printable(name)!r} is corrupt")
            entries[name] = ZipEntry(header, entry_size, compression, crc, flags, time, date)
            self._central[name] = start + position
            position = name_end + extra_length + comment_length
        if checked and position != size:
            raise Damaged(f"the central directory holds {size:,} bytes, its {count} entries {position:,}")
        return entries

    def _check_entries(self) -> None:
        """Each local header against its directory entry, entries apart and before the directory, and the
        CRC-32 of every entry that is not a storage (storages are checked where they are read)."""
        spans = []
        for name, entry in self._entries.items():
            start, end = self._local(name, entry)
            self._starts[name] = start
            spans.append((entry.header, end, name))
            if not name.startswith(self.prefix + "data/"):
                self._check_crc(name, entry, self._read(start, entry.size))
        spans.sort()
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointError(f"{self.where}: damaged zip record: entries {self._named(a)} and "
                                      f"{self._named(b)} overlap")
        if spans and spans[-1][1] > self._directory_start:
            raise CheckpointError(f"{self.where}: damaged zip record: entry {self._named(spans[-1][2])} runs into "
                                  "the central directory")

    def _named(self, name: str) -> str:
        """An entry as messages name it: a storage with the keys of the tensors the archive's pickle keeps in it
        (``'archive/data/0' (model.w)``), where the pickle can still be read and the archive's label does
        not name them already."""
        shown = repr(printable(name))
        storages = self.prefix + "data/"
        if self.labelled or not name.startswith(storages):
            return shown
        try:
            root = self.load()
        except CheckpointError:
            return shown
        keys = list(_keys_of_storage(root, name[len(storages):]))
        more = f", and {len(keys) - 3:,} more" if len(keys) > 3 else ""
        return f"{shown} ({', '.join(printable(key) for key in keys[:3])}{more})" if keys else shown

    def _local(self, name: str, entry: ZipEntry) -> tuple[int, int]:
        """Where the entry's data starts in the archive, and where the entry ends (its data descriptor
        included); its local header checked against the directory when ``checked``."""
        try:
            fields = LOCAL_HEADER.unpack(self._read(entry.header, LOCAL_HEADER.size))
            if fields[0] != b"PK\x03\x04":
                raise Damaged("no local header where the central directory says")
            name_length, extra_length = fields[-2], fields[-1]
            start = entry.header + LOCAL_HEADER.size + name_length + extra_length  # after the name and extra field
            if start + entry.size > self.length:
                raise CheckpointError(f"{self.where}: truncated: entry {self._named(name)} ends past the archive")
            if not self.checked:
                return start, start + entry.size
            named = self._read(entry.header + LOCAL_HEADER.size, name_length + extra_length)
            if named[:name_length] != name.encode() or fields[3:7] != (entry.flags, entry.compression, entry.time,
                                                                       entry.date):
                raise Damaged("its local header disagrees with the central directory")
            crc, sizes = fields[7], fields[8:10]
            if FIELD_LIMIT in sizes:
                sizes = zip64_values(named[name_length:], sizes, 0)[:1] * 2
            if entry.flags & 8:  # a data descriptor after the data holds the CRC-32 and sizes (torch.save's own writer)
                if (crc, *sizes) not in ((0, 0, 0), (entry.crc, entry.size, entry.size)):
                    raise Damaged("its local header disagrees with the central directory")
                return start, self._descriptor(name, entry, start + entry.size)
            if (crc, *sizes) != (entry.crc, entry.size, entry.size):
                raise Damaged("its local header disagrees with the central directory")
            return start, start + entry.size
        except CheckpointError:
            raise
        except Damaged as exc:
            raise CheckpointError(f"{self.where}: damaged zip record: entry {self._named(name)}: {exc}") from None
        except (struct.error, ValueError) as exc:
            raise CheckpointError(f"{self.where}: corrupt zip entry {self._named(name)} ({printable(str(exc), 80)})") \
                from None

    def _descriptor(self, name: str, entry: ZipEntry, at: int) -> int:
        """The end of the data descriptor at ``at``, checked against the directory entry: its signature is
        optional, its sizes 8 bytes each after a zip64 local header, else 4 (either is taken)."""
        found = self._read(at, min(28, self._directory_start - at))
        start = 4 if found[:4] == b"PK\x07\x08" else 0
        for layout in DESCRIPTORS:
            if len(found) >= start + layout.size and \
                    layout.unpack_from(found, start) == (entry.crc, entry.size, entry.size):
                self._descriptors[name] = at + start
                return at + start + layout.size
        raise Damaged("its data descriptor disagrees with the central directory")

    def _check_crc(self, name: str, entry: ZipEntry, data) -> None:
        if self.crc_recorded and crc32(data) != entry.crc:
            check_crc(f"{self.where}: {printable(name[len(self.prefix):])}", crc32(data), entry.crc)

    def _data_offset(self, name: str) -> tuple[int, int]:
        """Absolute file offset and size of a stored (uncompressed) zip entry."""
        entry = self._entries.get(self.prefix + name)
        if entry is None:
            raise CheckpointError(f"{self.where}: archive has no entry {printable(name)!r}")
        if entry.compression != 0:
            raise CheckpointError(f"{self.where}: entry {printable(name)!r} is compressed; torch.save never compresses")
        start = self._starts.get(self.prefix + name)
        if start is None:
            start = self._starts[self.prefix + name] = self._local(self.prefix + name, entry)[0]
        return self.offset + start, entry.size

    def load(self) -> Any:
        """The archived object, with tensors as ``safe_pickle.TensorRef`` (no tensor bytes are read)."""
        start, size = self._data_offset("data.pkl")
        return safe_pickle.load_bytes(self._read(start - self.offset, size), f"{self.where}/data.pkl")

    def record_layout(self, raw: RawBytes) -> RecordLayout | None:
        """The layout that records like this one share (``layouts``), this record checked whole being its
        template; ``raw`` says where the chunk's elements are in it. None when it cannot stand for others:
        records not checked, more than one storage, or elements that are not one row-major run in it."""
        storages = [name for name in self._entries if name.startswith(self.prefix + "data/")]
        if not self.checked or len(storages) != 1 or raw.file != self.relative or \
                raw.strides != row_major(raw.shape):
            return None
        name = storages[0]
        start = self._data_offset(name[len(self.prefix):])[0] - self.offset
        size = self._entries[name].size
        elements = raw.offset - self.offset
        if not start <= elements <= elements + raw.span <= start + size:
            return None
        template = self._read(0, start) + self._read(start + size, self.length - start - size)
        variable: list[tuple[int, int]] = []
        storage_crc: tuple[int, ...] = ()
        summed = []
        for entry_name, entry in self._entries.items():
            fields = self._crc_fields(entry_name, entry)
            own = entry_name[len(self.prefix):]
            if entry_name != name and not own.startswith(".data/"):
                continue  # the same bytes in every record of this layout, and so the same CRC-32
            if entry_name != name:  # written anew by every torch.save (its serialization id)
                variable.append((self._starts[entry_name], entry.size))
            if self.crc_recorded:
                variable += [(field, 4) for field in fields]
                if entry_name == name:
                    storage_crc = fields
                else:
                    summed.append((self._starts[entry_name], entry.size, fields))
        return RecordLayout(self.length, (start, size), elements, template, variable, storage_crc, summed,
                            printable(name[len(self.prefix):]))

    def _crc_fields(self, name: str, entry: ZipEntry) -> tuple[int, ...]:
        """Where the entry's CRC-32 is recorded in the archive: its central directory header, then its local header
        (unless that holds 0, the data descriptor's being the one) and its data descriptor."""
        fields = [self._central[name] + 16]
        if struct.unpack("<L", self._read(entry.header + 14, 4))[0] == entry.crc:
            fields.append(entry.header + 14)
        if name in self._descriptors:
            fields.append(self._descriptors[name])
        return tuple(fields)

    def storage_data(self) -> list[StoredData]:
        """The bytes of every storage (``data/<key>``) and the CRC-32 the archive records for them."""
        storages = self.prefix + "data/"
        found = []
        for name, entry in self._entries.items():
            if name.startswith(storages):
                offset, size = self._data_offset(name[len(self.prefix):])
                found.append(StoredData(self.relative, offset, size, entry.crc if self.crc_recorded else None,
                                        f"{self.where}: {printable(name[len(self.prefix):])}"))
        return found

    def check_storages(self) -> None:
        """Check the CRC-32 of every storage now (an object's few small ones: its whole archive is read)."""
        if self.checked:
            for stored in self.storage_data():
                check_crc(stored.where, crc_of_range(self.files, stored.relative, stored.offset, stored.size),
                          stored.crc)

    def raw_bytes(self, tensor: safe_pickle.TensorRef) -> RawBytes:
        """Where the elements of ``tensor`` are in the file, checked against the storage's size."""
        start, size = self._data_offset(f"data/{tensor.storage.key}")
        itemsize = tensor.dtype.itemsize
        raw = RawBytes(self.relative, start + tensor.storage_offset * itemsize, tensor.shape, tensor.stride, itemsize)
        if tensor.storage_offset * itemsize + raw.span > size or size < tensor.storage.numel * itemsize:
            raise CheckpointError(f"{self.where}: tensor bytes lie outside storage data/{printable(tensor.storage.key)}")
        return raw


def _keys_of_storage(obj, storage: str, path: str = ""):
    """The dotted keys (as DCP flattens a state dict) of the tensors in ``obj`` that view ``storage``."""
    if isinstance(obj, TensorRef):
        if obj.storage.key == storage:
            yield path
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _keys_of_storage(value, storage, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _keys_of_storage(value, storage, f"{path}.{index}" if path else str(index))


class Damaged(ValueError):
    """A zip structure that contradicts itself (said as ``damaged zip record: ...``)."""


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
    """Where the elements of ``chunk`` (a ``chunks.Chunk`` of ``tensor``) are in ``archive`` (an ``Archive``, or
    another with its ``load``, ``raw_bytes`` and ``where``), checked against the dtype and sizes the metadata
    gives them."""
    ref = archive.load()
    if not isinstance(ref, TensorRef) or tuple(ref.shape) != chunk.sizes or ref.dtype.name != tensor.dtype:
        held = f"{ref.dtype.name}{list(ref.shape)}" if isinstance(ref, TensorRef) else type(ref).__name__
        raise CheckpointError(f"{archive.where}: holds {held}, but the metadata says {tensor.key} chunk at "
                              f"{list(chunk.offsets)} is {tensor.dtype}{list(chunk.sizes)}")
    return archive.raw_bytes(ref)


def chunk_label(key: str, chunk) -> str:
    """How messages name a chunk's record: ``model.w chunk at [0, 0]``."""
    return f"{key} chunk at {list(chunk.offsets)}"


def _chunk_archive(files: CheckpointFiles, chunk, label: str) -> Archive:
    return Archive(files, chunk.file, chunk.offset, chunk.length, label)


def _chunk_storage(files: CheckpointFiles, tensor, chunk, label: str) -> StoredData:
    """The storage of a chunk's record (its one ``data/`` entry), the record checked as it is opened."""
    archive = _chunk_archive(files, chunk, label)
    found = archive.storage_data()
    if len(found) != 1:
        ref = archive.load()
        key = f"data/{ref.storage.key}" if isinstance(ref, TensorRef) else None
        found = [stored for stored in found if stored.where.endswith(f": {key}")]
        if len(found) != 1:
            raise CheckpointError(f"{archive.where}: holds no storage of the chunk's tensor")
    return found[0]


def _chunk_layout(files: CheckpointFiles, tensor, chunk, label: str) -> RecordLayout | None:
    """The layout of the records of ``chunk``'s dtype, shape and length, its record their template."""
    archive = _chunk_archive(files, chunk, label)
    return archive.record_layout(chunk_bytes(archive, tensor, chunk))


encodings.register(encodings.Encoding(  # torch.save lays out every archive of one dtype and shape alike
    TORCH_ARCHIVE,
    locate=lambda files, tensor, chunk: chunk_bytes(_chunk_archive(files, chunk, chunk_label(tensor.key, chunk)),
                                                    tensor, chunk),
    record=_chunk_storage,
    uniform=True,
    layout=_chunk_layout,
))
