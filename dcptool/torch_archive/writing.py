"""Writing a ``torch.save`` archive: every record's place fixed before any byte is written, headers last."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

from dcptool.torch_archive.pickling import dumps
from dcptool.torch_archive.reading import (CENTRAL_HEADER, DOS_DATE, END, END64, FIELD_LIMIT, LOCAL_HEADER, LOCATOR64,
                                           ZIP64_VERSION, ZIP_VERSION)


@dataclass
class _Record:
    name: bytes
    header: int  # where its local header starts, from the archive's start
    size: int
    pad: int  # bytes of torch's "FB" padding field, so that the data is 64-byte aligned
    data: bytes | None  # the bytes of small records; None for storages, which the caller writes

    @property
    def zip64(self) -> bool:
        return self.size >= FIELD_LIMIT

    def local_header(self, crc: int) -> bytes:
        extra = struct.pack("<HH", 0x4246, self.pad) + b"Z" * self.pad
        size = self.size
        if self.zip64:
            extra += struct.pack("<HHQQ", 1, 16, size, size)
            size = FIELD_LIMIT
        return LOCAL_HEADER.pack(b"PK\x03\x04", ZIP64_VERSION if self.zip64 else ZIP_VERSION, 0, 0, 0, 0,
                                  DOS_DATE, crc, size, size, len(self.name), len(extra)) + self.name + extra

    def central_header(self, crc: int) -> bytes:
        large = [value for value in (self.size, self.size, self.header) if value >= FIELD_LIMIT]
        extra = struct.pack(f"<HH{len(large)}Q", 1, 8 * len(large), *large) if large else b""
        size, header = (min(value, FIELD_LIMIT) for value in (self.size, self.header))
        version = ZIP64_VERSION if large else ZIP_VERSION
        return CENTRAL_HEADER.pack(b"PK\x01\x02", version, 3, version, 0, 0, 0, 0, DOS_DATE, crc, size, size,
                                    len(self.name), len(extra), 0, 0, 0, 0, header) + self.name + extra


class ArchiveLayout:
    """Where every byte of one ``torch.save`` archive goes, fixed before any of it is written.

    Nothing is compressed, so record sizes fix every offset: storage bytes can be written at their
    place in any order, by several threads or processes. The zip headers carry each record's
    CRC-32, so they come last, from ``segments(crcs)``. Offsets count from the archive's start
    (a DCP record is read as a standalone archive sliced out of its ``.distcp`` file).

    >>> import io, zipfile
    >>> from dcptool.torch_archive import StorageOut, TensorOut, dumps
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
        fixed = LOCAL_HEADER.size + len(encoded) + 4 + (20 if size >= FIELD_LIMIT else 0)
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
        if max(start, len(directory)) < FIELD_LIMIT and count < 0xFFFF:
            return directory + END.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), start, 0)
        end64 = END64.pack(b"PK\x06\x06", END64.size - 12, ZIP64_VERSION, ZIP64_VERSION, 0, 0,
                            count, count, len(directory), start)
        locator = LOCATOR64.pack(b"PK\x06\x07", 0, start + len(directory), 1)
        end = END.pack(b"PK\x05\x06", 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                        min(len(directory), FIELD_LIMIT), min(start, FIELD_LIMIT), 0)
        return directory + end64 + locator + end


def archive_bytes(obj: Any) -> bytes:
    """A whole ``torch.save`` archive of ``obj``, which holds no tensors (step counters, scheduler state)."""
    layout = ArchiveLayout(dumps(obj))
    archive = bytearray(layout.close())
    for offset, data in layout.segments({}):
        archive[offset:offset + len(data)] = data
    return bytes(archive)
