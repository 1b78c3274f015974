"""The CRC-32s of the storages of ``torch.save`` archives, checked where their bytes are read.

An archive's structure and its small entries are checked when it is opened (``reading.Archive``); its
storages (a DCP chunk's bytes, every tensor of a ``torch.save`` file) are checked as they are read:
``RecordChecks.check`` reads a storage once (from the page cache where it is local) the first time any of
its bytes are asked for, and a copy that moves a storage's bytes as runs (``dcptool.engine.transfer``) hands in
the CRC-32 of each run instead (``add_part``), so the bytes are checksummed once, as they pass. One
``RecordChecks`` per checkpoint's files (``record_checks``); none with ``--no-verify-records``.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable

from zlib_ng.zlib_ng import crc32, crc32_combine

from dcptool.errors import CheckpointError

# Bytes read at once to checksum a range: they stay in the core's cache while they are checksummed.
CRC_WINDOW = 2**20


@dataclass(frozen=True)
class StoredData:
    """The bytes ``[offset, offset+size)`` of ``relative`` that a zip entry holds, and the CRC-32 its archive
    records for them (None: ``torch.save`` was told not to compute them); ``where`` names the record and entry
    (``place``: that name, or what makes it: records checked a batch at a time name theirs only if asked).

    ``recorded_after``: where the CRC-32 is recorded behind the bytes, in a stream read once (a zstd record:
    its data descriptor and central directory follow the storage), the call that checks the rest of the
    record once the bytes have been read and returns the CRC-32 it records (``crc`` is then None)."""

    relative: str
    offset: int
    size: int
    crc: int | None
    place: str | Callable[[], str] = field(compare=False)
    recorded_after: Callable[[], int | None] | None = field(default=None, compare=False)

    @property
    def where(self) -> str:
        """The record and entry, as messages name them."""
        return self.place if isinstance(self.place, str) else self.place()

    @property
    def checkable(self) -> bool:
        """Whether the record stores a CRC-32 of these bytes, now or behind them."""
        return self.crc is not None or self.recorded_after is not None

    def recorded_crc(self) -> int | None:
        """The CRC-32 the record stores for these bytes (``recorded_after``'s once the bytes have been read)."""
        return self.crc if self.recorded_after is None else self.recorded_after()


def check_crc(where: str, computed: int, stored: int | None) -> None:
    """Raise unless ``computed`` is the CRC-32 the record stores (None: nothing stored to check against)."""
    if stored is not None and computed != stored:
        raise CheckpointError(f"{where}: CRC-32 is {computed:#010x}, the record stores {stored:#010x} "
                              "(its bytes are damaged)")


def crc_of_range(files, relative: str, offset: int, nbytes: int) -> int:
    """CRC-32 of bytes of a checkpoint file, read a window at a time into the thread's buffer, which stays in
    the core's cache while it is checksummed: 10 GB/s of the page cache here, where checksumming a mapping of
    it ran at 7.5 (its page faults cost more than the copy)."""
    crc, buffer = 0, _window()
    for start in range(offset, offset + nbytes, len(buffer)):
        window = buffer[:min(len(buffer), offset + nbytes - start)]
        files.read_into(relative, start, window)
        crc = crc32(window, crc)
    return crc


_buffers = threading.local()


def _window() -> memoryview:
    """The calling thread's read buffer for checksums (``CRC_WINDOW`` bytes)."""
    buffer = getattr(_buffers, "window", None)
    if buffer is None:
        buffer = _buffers.window = memoryview(bytearray(CRC_WINDOW))
    return buffer


class RecordChecks:
    """The storages of one checkpoint's files checked so far, and the runs of those being copied.

    Safe to share between threads: a storage checked by two at once is checked twice, to the same result.
    """

    def __init__(self, files):
        self.files = files
        self._lock = threading.Lock()
        self._by_file: dict[str, tuple[list[int], list[StoredData]]] = {}  # storages of whole torch.save files
        self._records: dict[tuple[str, int], StoredData | None] = {}  # chunk records opened, by (file, offset)
        self._checked: set[StoredData] = set()
        self._parts: dict[StoredData, dict[tuple[int, int], int]] = {}  # (offset, size) -> CRC-32 of runs copied
        self._keys: dict[StoredData, str] = {}  # the tensor each storage's runs were copied for
        self._checking: dict[StoredData, threading.Event] = {}  # set once the thread checking it is done
        self._failed: dict[StoredData, CheckpointError] = {}

    def add_file(self, relative: str, storages: list[StoredData]) -> None:
        """Make the storages of a whole ``torch.save`` file findable by the bytes they hold (``in_file``)."""
        ordered = sorted(storages, key=lambda stored: stored.offset)
        with self._lock:
            self._by_file.setdefault(relative, ([stored.offset for stored in ordered], ordered))

    def in_file(self, relative: str, offset: int) -> StoredData | None:
        """The storage of a whole ``torch.save`` file that holds the byte at ``offset``; None when none does."""
        starts, storages = self._by_file.get(relative, ((), ()))
        index = bisect.bisect_right(starts, offset) - 1
        if index >= 0 and offset < storages[index].offset + max(storages[index].size, 1):
            return storages[index]
        return None

    def known(self, relative: str, offset: int) -> bool:
        """Whether the record at ``offset`` of ``relative`` was opened already (``record``)."""
        return (relative, offset) in self._records

    def record(self, relative: str, offset: int, opened: Callable[[], StoredData | None]) -> StoredData | None:
        """The storage of the record at ``offset`` of ``relative``, ``opened()`` (which checks the record) the
        first time it is asked for."""
        place = (relative, offset)
        if place not in self._records:
            stored = opened()
            with self._lock:
                self._records[place] = stored
        return self._records[place]

    def check(self, stored: StoredData, key: str) -> None:
        """Check a storage's CRC-32 over its bytes, once: threads that ask while another checks it wait for
        that answer (several threads assembling blocks of one tensor read its records at the same time)."""
        if not stored.checkable:
            return
        with self._lock:
            if stored in self._checked:
                return
            failed = self._failed.get(stored)
            checking = self._checking.get(stored)
            mine = checking is None and failed is None
            if mine:
                checking = self._checking[stored] = threading.Event()
        if failed is not None:
            raise failed
        if not mine:
            checking.wait()
            self.check(stored, key)  # checked now, or failed: says so
            return
        try:
            _check_storage(stored, key, crc_of_range(self.files, stored.relative, stored.offset, stored.size))
        except CheckpointError as exc:
            with self._lock:
                self._failed[stored] = exc
            raise
        else:
            with self._lock:
                self._checked.add(stored)
                self._parts.pop(stored, None)
        finally:
            with self._lock:
                del self._checking[stored]
            checking.set()

    def has_part(self, stored: StoredData, offset: int, nbytes: int) -> bool:
        """Whether the CRC-32 of bytes ``[offset, offset+nbytes)`` of a storage was handed in already (or the
        storage is checked): a copy that reads those bytes again need not checksum them."""
        with self._lock:
            return stored in self._checked or (offset, nbytes) in self._parts.get(stored, ())

    def add_part(self, stored: StoredData, key: str, offset: int, nbytes: int, crc: int) -> None:
        """The CRC-32 of bytes ``[offset, offset+nbytes)`` of a storage, as a copy read them; the storage is
        checked once the runs handed in cover it."""
        if not stored.checkable:
            return
        with self._lock:
            if stored in self._checked or stored in self._failed:
                return
            self._keys[stored] = key
            parts = self._parts.setdefault(stored, {})
            parts[(offset, nbytes)] = crc
            whole = _combined(parts, stored)
            if whole is None:
                return
            self._checked.add(stored)
            del self._parts[stored]
        _check_storage(stored, key, whole)

    def finish(self, tensor: str | None = None) -> None:
        """Check the storages that runs covered only in part (the rest of their bytes was not copied): those
        whose runs were last handed in for the key ``tensor`` where given (a reader done with one tensor, while
        other threads may still be reading theirs), else all."""
        with self._lock:
            left = [(stored, self._keys[stored]) for stored in self._parts
                    if tensor is None or self._keys[stored] == tensor]
        for stored, key in left:
            self.check(stored, key)


def _check_storage(stored: StoredData, key: str, computed: int) -> None:
    """Raise unless ``computed`` is the CRC-32 the storage's record stores (named only then: a name of a record
    checked in a batch is made when asked for)."""
    recorded = stored.recorded_crc()
    if recorded is not None and computed != recorded:
        check_crc(_named(stored, key), computed, recorded)


def _named(stored: StoredData, key: str) -> str:
    """Where a storage is, naming the tensor read from it unless its record names it (a DCP chunk's does)."""
    return stored.where if f"record of {key} " in stored.where else f"{stored.where} (holds {key})"


def _combined(parts: dict[tuple[int, int], int], stored: StoredData) -> int | None:
    """The CRC-32 of the whole storage when the parts tile it from its first byte to its last, else None."""
    if sum(size for _, size in parts) < stored.size:
        return None
    by_start: dict[int, list[tuple[int, int]]] = {}
    for (offset, size), crc in parts.items():
        by_start.setdefault(offset, []).append((size, crc))
    position, end, whole = stored.offset, stored.offset + stored.size, 0
    while position < end:
        found = [(size, crc) for size, crc in by_start.get(position, ()) if size and position + size <= end]
        if not found:
            return None
        size, crc = max(found)
        whole = crc32_combine(whole, crc, size) if position > stored.offset else crc
        position += size
    return whole if stored.size else 0


def record_checks(files) -> RecordChecks | None:
    """The record checks of a checkpoint's files (made on first use); None when they are not to be checked
    (``files.verify_records`` false: ``--no-verify-records``)."""
    if not getattr(files, "verify_records", True):
        return None
    checks = getattr(files, "record_checks", None)
    if checks is None:
        checks = files.record_checks = RecordChecks(files)
    return checks
