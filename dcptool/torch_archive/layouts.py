"""Records of one layout checked many at once: DCP's chunk records, of which a checkpoint has a million.

``torch.save`` lays out every archive of one dtype and shape alike: the same entries, headers, directory and
end records at the same places. What differs from record to record is the storage's bytes, the entries
``torch.save`` writes anew every time (under ``.data/``: its serialization id) and their CRC-32s. A
``RecordLayout`` is learned from one record checked whole (``Archive.record_layout``), and checks others of its
dtype, shape and length with numpy, a batch at a time: each record's *frame* (its bytes but its storage's)
equals the template's frame wherever every record of the layout must, the CRC-32 fields of the entries that
differ agree with each other, and the CRC-32s of the ``.data/`` entries are those of their bytes. A record
that differs anywhere else is no record of this layout: the caller checks it alone (``Archive``), which
names what is wrong with it, or reads it as the record it is. The storage's own CRC-32 is the caller's to
check where its bytes are read (``recorded`` gives what each record stores).

Per record this costs one read (frame and storage together) and a few microseconds, where opening it as an
archive costs two reads and tens of microseconds of Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from zlib_ng.zlib_ng import crc32


@dataclass(frozen=True)
class Summed:
    """An entry whose bytes differ between records of one layout, checked against its CRC-32 in each:
    ``start`` and ``size`` of its bytes in the frame, ``fields`` where its CRC-32 is recorded (the central
    directory's first, then the copies in its local header or data descriptor)."""

    start: int
    size: int
    fields: tuple[int, ...]


class RecordLayout:
    """The layout of records ``length`` bytes long whose storage is ``storage = (start, size)`` of them, learned
    from ``template`` (a record checked whole: its frame, the record's bytes but its storage's).

    ``variable``: ``(start, size)`` ranges of the record (outside the storage) whose bytes may differ between
    records: the CRC-32 fields of the storage and of ``summed`` entries, and those entries' bytes; every other
    byte of a record's frame must be the template's. ``storage_crc``: where the storage's CRC-32 is recorded
    (the central directory's first; empty when the records store none). ``summed``: entries whose bytes differ,
    as ``(start, size, crc fields)`` in the record. ``elements``: where the chunk's elements start (row-major).
    ``storage_name``: the storage's entry as messages name it (``data/0``).

    >>> record = bytes(range(40))
    >>> layout = RecordLayout(40, (10, 8), 10, record[:10] + record[18:], [(30, 4)], (30,), [], "data/0")
    >>> frames = np.zeros((2, layout.width), np.uint8)
    >>> frames[:, :layout.frame_size] = np.frombuffer(layout.template_frame, np.uint8)
    >>> frames[1, 0] ^= 1                          # damaged outside the storage: no record of this layout
    >>> frames[0, 22:26] = [7, 0, 0, 0]            # a storage CRC-32 of 7 (record byte 30 is frame byte 22)
    >>> misfits, recorded = layout.check(frames)
    >>> misfits.tolist(), int(recorded[0])
    ([False, True], 7)
    """

    def __init__(self, length: int, storage: tuple[int, int], elements: int, template: bytes,
                 variable: list[tuple[int, int]], storage_crc: tuple[int, ...], summed: list[tuple[int, int, tuple]],
                 storage_name: str):
        self.length, self.storage, self.elements, self.storage_name = length, storage, elements, storage_name
        self.frame_size = length - storage[1]
        self.width = -(-self.frame_size // 8) * 8  # a frame's row: whole 8-byte words, compared a word at a time
        self.template_frame = template
        template_row = np.zeros(self.width, np.uint8)
        template_row[:self.frame_size] = np.frombuffer(template, np.uint8)
        fixed = np.zeros(self.width, np.uint8)
        fixed[:self.frame_size] = 0xFF
        for start, size in variable:
            fixed[self._in_frame(start):self._in_frame(start) + size] = 0
        self._fixed = fixed.view(np.uint64)
        self._template = template_row.view(np.uint64) & self._fixed
        self._storage_crc = tuple(self._in_frame(p) for p in storage_crc)
        self._summed = tuple(Summed(self._in_frame(start), size, tuple(self._in_frame(p) for p in fields))
                             for start, size, fields in summed)

    def _in_frame(self, position: int) -> int:
        """Where byte ``position`` of a record (outside its storage) is in its frame."""
        start, size = self.storage
        return position if position < start else position - size

    @property
    def crc_recorded(self) -> bool:
        """Whether the records store a CRC-32 of their storage (``torch.save`` may be told not to)."""
        return bool(self._storage_crc)

    def check(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``(misfits, recorded)`` of records whose frames are the rows of ``frames`` (``width`` bytes each):
        which are no records of this layout (to be checked alone), and the CRC-32 each records for its storage
        (None when the records store none)."""
        count = len(frames)
        words = frames.view(np.uint64)
        misfits = ((words & self._fixed) != self._template).any(axis=1)
        recorded = None
        if self._storage_crc:
            recorded = _field(frames, self._storage_crc[0])
            for copy in self._storage_crc[1:]:
                misfits |= _field(frames, copy) != recorded
        flat = memoryview(frames).cast("B")
        for summed in self._summed:
            stored = _field(frames, summed.fields[0])
            for copy in summed.fields[1:]:
                misfits |= _field(frames, copy) != stored
            start, size, width = summed.start, summed.size, self.width
            computed = np.fromiter((crc32(flat[row * width + start:row * width + start + size])
                                    for row in range(count)), np.uint32, count)
            misfits |= computed != stored
        return misfits, recorded


def _field(frames: np.ndarray, position: int) -> np.ndarray:
    """The little-endian 4-byte field at ``position`` of every frame, as uint32."""
    return np.ascontiguousarray(frames[:, position:position + 4]).view("<u4")[:, 0]
