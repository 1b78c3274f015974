"""Where the bytes of a checkpoint's chunks are, and regions of its tensors read from them.

``StoredBytes`` is what ``core.Checkpoint`` reads with: a chunk's elements located in its file (its
record opened the first time, the place of the elements in records of one shape learned once), each
record's CRC-32 checked where its bytes are read (DCP's chunk records a batch at a time, against the
layout they share), and any rectangular region of a tensor assembled from the chunks it overlaps
through a fixed read buffer, however large the chunks are.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import numpy as np
from zlib_ng.zlib_ng import crc32, crc32_combine

from dcptool import dtypes, encodings
from dcptool.engine.chunks import RAW, Chunk, ChunkTable
from dcptool.errors import CheckpointError
from dcptool.torch_archive import RawBytes, chunk_label, record_name, row_major
from dcptool.torch_archive.layouts import RecordLayout
from dcptool.torch_archive.records import StoredData, check_crc, record_checks

# Records of a layout at most this long are read whole, storage and all, whatever part of their chunk a read needs:
# one read, where a frame and a part of the storage apart take two or three.
SMALL_RECORD = 2**16
# The frames of records (their bytes but their storages') one thread reads and checks at once.
FRAME_BYTES = 2**18

_UNLEARNED = object()


def overlapping(tensor, offsets, sizes) -> list[Chunk] | Sequence[Chunk]:
    """The chunks of ``tensor`` that a region overlaps (all chunks of a plain list: callers skip the rest)."""
    if isinstance(tensor.chunks, ChunkTable):
        return tensor.chunks.overlapping(offsets, sizes)
    return tensor.chunks


_workspaces = threading.local()


def workspace(name: str, shape, dtype) -> np.ndarray:
    """This thread's reusable array ``name`` of ``shape`` and ``dtype``, for the temporaries of a computation
    (``Computed.read``): slab after slab reuses its memory (fresh arrays cost more in page faults than the
    arithmetic). Its contents are the caller's until it asks for ``name`` again; the memory is the thread's
    until it ends (copies run in threads of their own)."""
    shape = tuple(shape)
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buffers = _workspaces.__dict__
    buffer = buffers.get(name)
    if buffer is None or len(buffer) < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, 1), np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


class StoredBytes:
    """How a checkpoint (``core.Checkpoint``, which derives from it) reads its chunks' bytes.

    It uses the checkpoint's ``files`` and what it has learned of them, kept with the checkpoint so that views
    of it share it: ``_resolved`` (chunk -> where its elements are), ``_layouts`` (records of one encoding,
    dtype, sizes and length -> where the elements start in them) and ``_record_layouts`` (the same -> the
    layout such records share, which checks them a batch at a time; None: they are checked alone).
    """

    def raw_bytes(self, tensor, chunk: Chunk) -> RawBytes:
        """Where a chunk's elements are, opening its record the first time it is needed.

        A record of a uniform encoding (``torch.save`` lays out every archive of one dtype and shape alike)
        of the same dtype, shape and length as one already opened has its elements at the same place in it:
        a million chunks cost one record each of their few shapes, not two reads each."""
        raw = self._resolved.get(chunk)
        if raw is not None:
            return raw
        encoding = encodings.get(chunk.encoding) if chunk.view is None else None
        if encoding is not None and encoding.uniform:
            shape = (chunk.encoding, tensor.dtype, chunk.sizes, chunk.length)
            start = self._layouts.get(shape)
            if start is not None:
                itemsize = dtypes.dtype(tensor.dtype).itemsize
                return RawBytes(chunk.file, chunk.offset + start, chunk.sizes, row_major(chunk.sizes), itemsize)
            raw = self._resolve(tensor, chunk)
            if raw.file == chunk.file and raw.strides == row_major(chunk.sizes) and len(self._layouts) < 4096:
                self._layouts[shape] = raw.offset - chunk.offset
                return raw
        else:
            raw = self._resolve(tensor, chunk)
        self._resolved[chunk] = raw
        return raw

    def record_of(self, tensor, chunk: Chunk) -> StoredData | None:
        """The storage of the record that holds ``chunk``'s bytes, whose CRC-32 is checked where they are read
        (the record's zip structure is checked as it is opened); None when its format stores no CRC-32
        (safetensors) or records are not checked (``--no-verify-records``)."""
        checks = record_checks(self.files)
        if checks is None:
            return None
        base = chunk.view.base if chunk.view is not None else chunk
        if base.encoding == RAW:  # bytes of a whole torch.save file, or of no record at all
            return checks.in_file(base.file, base.offset)
        encoding = encodings.get(base.encoding)
        if encoding is None or encoding.record is None:
            return None
        return checks.record(base.file, base.offset,
                             lambda: encoding.record(self.files, tensor, base, chunk_label(tensor.key, base)))

    def check_record(self, tensor, chunk: Chunk) -> None:
        """Check the record that holds ``chunk``'s bytes (once per record; ``record_of``)."""
        stored = self.record_of(tensor, chunk)
        if stored is not None:
            record_checks(self.files).check(stored, tensor.key)

    def _resolve(self, tensor, chunk: Chunk) -> RawBytes:
        itemsize = dtypes.dtype(tensor.dtype).itemsize
        if chunk.view is not None:
            view, base = chunk.view, self.raw_bytes(tensor, chunk.view.base)
            first = sum(i * s for i, s in zip(view.start, base.strides))
            strides = tuple(sum(n * s for n, s in zip(step, base.strides)) for step in view.steps)
            return RawBytes(base.file, base.offset + first * itemsize, chunk.sizes, strides, itemsize)
        if chunk.encoding == RAW:
            strides = chunk.strides or row_major(chunk.sizes)
            raw = RawBytes(chunk.file, chunk.offset, chunk.sizes, strides, itemsize)
            self.files.check_range(chunk.file, chunk.offset, raw.span)
            return raw
        encoding = encodings.get(chunk.encoding)
        if encoding is None:
            raise CheckpointError(f"{self.files.path(chunk.file)}: unsupported chunk encoding {chunk.encoding!r}")
        return encoding.locate(self.files, tensor, chunk)

    def region_in(self, tensor, offsets, sizes, buffer, scratch: memoryview,
                  passing: bool = False) -> np.ndarray:
        """A region read into the start of ``buffer`` (reused by the caller), as an unsigned view of shape ``sizes``."""
        values = np.frombuffer(buffer, dtype=dtypes.raw_view_type(dtypes.dtype(tensor.dtype).itemsize),
                               count=math.prod(sizes)).reshape(sizes)
        self.read_region(tensor, offsets, sizes, values, scratch, passing)
        return values

    def read_region(self, tensor, offsets, sizes, out: np.ndarray, scratch: memoryview,
                    passing: bool = False) -> None:
        """Fill ``out`` (shape ``sizes``, an unsigned view of the tensor's item size) with a region.

        The region is assembled from every chunk it overlaps; each file read covers at most
        ``len(scratch)`` bytes, so memory stays bounded however large the chunks are. Each chunk's record is
        checked as its bytes are read: records of a layout (DCP's chunk records) a batch at a time, each read
        once, storage and all (``_read_records``); any other before its bytes are used (``check_record``), or,
        with ``passing`` (a copy that finishes the checks of what it read: ``transfer``), a part of a chunk
        that is one run of its record's bytes hands in the CRC-32 of those bytes as they are read
        (``RecordChecks.add_part``).
        """
        if tensor.transform is not None:
            tensor.transform.read(self, offsets, sizes, out, scratch)
            return
        boxes = []
        for chunk in overlapping(tensor, offsets, sizes):
            lo = [max(o, co) for o, co in zip(offsets, chunk.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if not any(h <= l for l, h in zip(lo, hi)):
                boxes.append((chunk, lo, hi))
        checks = record_checks(self.files)
        if checks is not None:
            boxes = self._read_records(tensor, boxes, offsets, sizes, out, scratch)
        for chunk, lo, hi in boxes:
            raw = self.raw_bytes(tensor, chunk)
            local_lo, extent = [l - co for l, co in zip(lo, chunk.offsets)], [h - l for l, h in zip(lo, hi)]
            # Ellipsis keeps a view even for 0-d tensors, where out[()] would be a copy.
            target = out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets)) + (Ellipsis,)]
            if checks is None:
                self._copy_box(raw, local_lo, extent, target, scratch, chunk.view is not None)
                continue
            stored = self.record_of(tensor, chunk) if passing and chunk.view is None else None
            start = raw.offset + sum(l * s for l, s in zip(local_lo, raw.strides)) * raw.itemsize
            run = (start, math.prod(extent) * raw.itemsize)  # the record's bytes whose CRC-32 is handed in
            if stored is not None and not is_contiguous(extent, raw.strides):
                run = whole_rows(raw, chunk.sizes, local_lo, extent, len(scratch))
                if run is not None and record_checks(self.files).has_part(stored, *run):
                    run = None  # the block beside it (another column block of these rows) handed it in
                elif run is None:
                    self.check_record(tensor, chunk)
                stored = None if run is None else stored
            elif stored is None:
                self.check_record(tensor, chunk)
            crc = self._copy_box(raw, local_lo, extent, target, scratch, chunk.view is not None,
                                 run if stored is not None else None)
            if stored is not None:
                record_checks(self.files).add_part(stored, tensor.key, *run, crc)

    def _read_records(self, tensor, boxes: list, offsets, sizes, out: np.ndarray,
                      scratch: memoryview) -> list:
        """Read the boxes ``(chunk, lo, hi)`` whose records are of a layout (``encodings.Encoding.layout``), a batch
        of records of one layout at a time (``_read_batch``); returns the boxes left to read one by one: those of
        other records, of records found to be of no layout (checked alone), and of large records read in part
        (their frames checked here, their storages as their bytes pass)."""
        left, records = [], {}
        for box in boxes:
            chunk = box[0]
            base = chunk.view.base if chunk.view is not None else chunk
            layout = self._record_layout(tensor, base)
            if layout is None:
                left.append(box)
                continue
            found = records.get((base.file, base.offset))
            if found is None:
                found = records[(base.file, base.offset)] = (layout, base, [])
            found[2].append(box)
        if not records:
            return left
        itemsize = dtypes.dtype(tensor.dtype).itemsize
        # a whole chunk that is one run of ``out`` is read straight into it
        into = memoryview(out.reshape(-1)).cast("B") if out.flags.c_contiguous else None
        out_strides = row_major(sizes)
        batches: dict[int, tuple[RecordLayout, list]] = {}
        room = len(scratch)  # left for the storages of small records read whole into scratch
        checks = record_checks(self.files)
        for layout, base, its_boxes in records.values():
            start, size = layout.storage
            chunk, lo, hi = its_boxes[0]
            extent = [h - l for l, h in zip(lo, hi)]
            if into is not None and len(its_boxes) == 1 and chunk.view is None and lo == list(chunk.offsets) and \
                    extent == list(chunk.sizes) and layout.elements == start and size == chunk.numel * itemsize \
                    and is_contiguous(extent, out_strides):
                first = sum((l - o) * s for l, o, s in zip(lo, offsets, out_strides)) * itemsize
                storage, in_place = into[first:first + size], True
            elif layout.length <= SMALL_RECORD and size <= len(scratch):  # read whole, though only part is needed
                if size > room:
                    left += self._read_batches(tensor, batches, offsets, out)
                    batches, room = {}, len(scratch)
                storage, in_place = scratch[len(scratch) - room:len(scratch) - room + size], False
                room -= size
            elif checks.known(base.file, base.offset):  # its frame checked by an earlier read of another part
                left += its_boxes
                continue
            else:  # a large record read in part: its storage's CRC-32 is checked as its bytes pass
                storage, in_place = None, False
            batches.setdefault(id(layout), (layout, []))[1].append((base, its_boxes, storage, in_place))
        return left + self._read_batches(tensor, batches, offsets, out)

    def _read_batches(self, tensor, batches: dict, offsets, out: np.ndarray) -> list:
        """``_read_batch`` of each layout's records, ``FRAME_BYTES`` of frames at a time."""
        left = []
        for layout, items in batches.values():
            rows = max(1, FRAME_BYTES // layout.width)
            for first in range(0, len(items), rows):
                left += self._read_batch(tensor, layout, items[first:first + rows], offsets, out)
        return left

    def _read_batch(self, tensor, layout: RecordLayout, items: list, offsets, out: np.ndarray) -> list:
        """Read and check records of one layout, ``(base chunk, boxes, storage, in_place)`` each: its frame into a
        row of the thread's frames, its storage into ``storage`` in the same read (the boxes are copied from
        there, unless ``in_place``: it is their place in ``out``) and checked against the CRC-32 it records;
        None reads the frame alone, the storage's CRC-32 left to the copy that reads it
        (``RecordChecks.record``). Returns the boxes left to read one by one."""
        (start, size), width, frame_size = layout.storage, layout.width, layout.frame_size
        frames = workspace("record_frames", (len(items), width), np.uint8)
        rows = memoryview(frames).cast("B")
        computed = []
        read_parts = self.files.read_parts
        for row, (base, _, storage, _) in enumerate(items):
            frame = rows[row * width:row * width + frame_size]
            if storage is None:
                read_parts(base.file, base.offset, [frame[:start]])
                read_parts(base.file, base.offset + start + size, [frame[start:]])
                computed.append(None)
            else:
                read_parts(base.file, base.offset, [frame[:start], storage, frame[start:]])
                computed.append(crc32(storage))
        misfits, recorded = layout.check(frames)
        misfits = misfits.tolist()
        recorded = recorded.tolist() if recorded is not None else [None] * len(items)
        checks, left = record_checks(self.files), []
        for (base, its_boxes, storage, in_place), misfit, crc, stored_crc in zip(items, misfits, computed, recorded):
            if misfit:
                left += self._check_alone(tensor, base, its_boxes)
                continue
            if storage is None:
                stored = StoredData(base.file, base.offset + start, size, stored_crc,
                                    functools.partial(self._storage_name, tensor, base, layout))
                checks.record(base.file, base.offset, lambda stored=stored: stored)
                left += its_boxes
                continue
            if stored_crc is not None and crc != stored_crc:
                check_crc(self._storage_name(tensor, base, layout), crc, stored_crc)
            for chunk, lo, hi in [] if in_place else its_boxes:  # read whole into scratch: copied out of it
                raw = self.raw_bytes(tensor, chunk)
                at = raw.offset - base.offset - start + sum((l - c) * s for l, c, s in
                                                              zip(lo, chunk.offsets, raw.strides)) * raw.itemsize
                extent = [h - l for l, h in zip(lo, hi)]
                count = sum((n - 1) * s for n, s in zip(extent, raw.strides)) + 1
                values = np.frombuffer(storage, out.dtype, count, at)
                target = out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets)) + (Ellipsis,)]
                target[...] = np.lib.stride_tricks.as_strided(values, shape=extent,
                                                              strides=[s * raw.itemsize for s in raw.strides])
        return left

    def _storage_name(self, tensor, base: Chunk, layout: RecordLayout) -> str:
        """How messages name the storage of ``base``'s record (as ``Archive.storage_data`` does)."""
        record = record_name(self.files, base.file, base.offset, chunk_label(tensor.key, base))
        return f"{record}: {layout.storage_name}"

    def _check_alone(self, tensor, base: Chunk, boxes: list) -> list:
        """Check a record that differs from its layout on its own (raises, naming what is wrong, when it is
        damaged); its boxes are then read one by one, from where its own archive says its elements are."""
        encoding = encodings.get(base.encoding)
        stored = encoding.record(self.files, tensor, base, chunk_label(tensor.key, base))
        record_checks(self.files).record(base.file, base.offset, lambda: stored)
        self._resolved[base] = encoding.locate(self.files, tensor, base)
        return boxes

    def _record_layout(self, tensor, chunk: Chunk) -> RecordLayout | None:
        """The layout of ``chunk``'s record and those of its dtype, shape and length (learned from it the first
        time: its record checked whole); None when its encoding has none."""
        shape = (chunk.encoding, tensor.dtype, chunk.sizes, chunk.length)
        layout = self._record_layouts.get(shape, _UNLEARNED)
        if layout is _UNLEARNED:
            encoding = encodings.get(chunk.encoding)
            layout = None if encoding is None or encoding.layout is None else \
                encoding.layout(self.files, tensor, chunk, chunk_label(tensor.key, chunk))
            if len(self._record_layouts) < 4096:
                self._record_layouts[shape] = layout
                if layout is not None:  # where the elements are in such records (``raw_bytes``): known now
                    self._layouts[shape] = layout.elements
        return layout

    def _copy_box(self, raw: RawBytes, lo: list[int], extent: list[int], target: np.ndarray, scratch,
                  split_gaps: bool = False, checksum: tuple[int, int] | None = None) -> int:
        """Copy a box of a chunk's elements into ``target``; with ``checksum`` (``(offset, size)`` of the run of
        the file that holds the box: the box itself when it is one run, else ``whole_rows``'s), return the
        CRC-32 of that run's bytes, else 0."""
        itemsize = raw.itemsize
        start = raw.offset + sum(l * s for l, s in zip(lo, raw.strides)) * itemsize
        if target.flags.c_contiguous and is_contiguous(extent, raw.strides):  # one run to one run: read in place
            data = memoryview(target).cast("B")
            self.files.read_into(raw.file, start, data)
            return crc32(data) if checksum else 0
        span = (sum((n - 1) * s for n, s in zip(extent, raw.strides)) + 1) * itemsize
        if checksum is not None and checksum[1] <= len(scratch):  # the run that holds the box, read (or mapped) as one
            return self._copy_rows(raw, start, extent, target, scratch, checksum)
        # Split what does not fit, and views that are mostly gaps (rows of a permuted view far apart).
        sparse = split_gaps and span > 2 * math.prod(extent) * itemsize + 4096
        if (span > len(scratch) or sparse) and any(n > 1 for n in extent):
            dim = max((d for d, n in enumerate(extent) if n > 1), key=lambda d: raw.strides[d]) if sparse else \
                next(d for d, n in enumerate(extent) if n > 1)
            half, crc = extent[dim] // 2, 0
            for begin, count in ((0, half), (half, extent[dim] - half)):
                sub_lo, sub_extent = list(lo), list(extent)
                sub_lo[dim] += begin
                sub_extent[dim] = count
                index = tuple(slice(begin, begin + count) if d == dim else slice(None) for d in range(len(extent)))
                sub_run = None if checksum is None else (
                    raw.offset + sum(l * s for l, s in zip(sub_lo, raw.strides)) * itemsize,
                    math.prod(sub_extent) * itemsize)
                part = self._copy_box(raw, sub_lo, sub_extent, target[index], scratch, split_gaps, sub_run)
                # halves along the first dim of more than one element: consecutive runs of a contiguous box
                crc = crc32_combine(crc, part, math.prod(sub_extent) * itemsize) if begin else part
            return crc
        if span > len(scratch):  # a single element larger than the scratch buffer cannot happen in practice
            raise CheckpointError("read buffer smaller than one element")
        # Strided on either side (a column block's rows): copied from the file's pages in place where it is local,
        # else read whole into the scratch buffer first. The mapping spans at most the scratch buffer's bytes.
        with self.files.mapped(raw.file, start, span) as mapped:
            buffer = mapped if mapped is not None else scratch[:span]
            if mapped is None:
                self.files.read_into(raw.file, start, buffer)
            flat = np.frombuffer(buffer, dtype=dtypes.raw_view_type(itemsize))
            target[...] = np.lib.stride_tricks.as_strided(flat, shape=extent, strides=[s * itemsize for s in raw.strides])
            del flat  # the mapping closes only once no array points into it
            return 0

    def _copy_rows(self, raw: RawBytes, start: int, extent: list[int], target: np.ndarray, scratch,
                   rows: tuple[int, int]) -> int:
        """Copy a box out of the run ``rows`` that holds it (``whole_rows``); the CRC-32 of the run."""
        first, size = rows
        with self.files.mapped(raw.file, first, size) as mapped:
            buffer = mapped if mapped is not None else scratch[:size]
            if mapped is None:
                self.files.read_into(raw.file, first, buffer)
            flat = np.frombuffer(buffer, dtype=dtypes.raw_view_type(raw.itemsize), offset=start - first)
            target[...] = np.lib.stride_tricks.as_strided(flat, shape=extent,
                                                          strides=[s * raw.itemsize for s in raw.strides])
            del flat  # the mapping closes only once no array points into it
            return crc32(buffer)


def whole_rows(raw: RawBytes, sizes, lo, extent, limit: int) -> tuple[int, int] | None:
    """``(offset, size)`` of the whole rows of a chunk stored in row-major order that hold a box of it (a
    column block: the rows from its first to its last, all their columns), when they are at most ``limit``
    bytes; else None. Column blocks of the same rows give the same run, so its CRC-32 is computed once and
    the runs of successive rows tile the record (``RecordChecks.add_part``).

    >>> whole_rows(RawBytes("f", 100, (4, 6), (6, 1), 2), (4, 6), [1, 2], [2, 3], 2**20)
    (112, 24)
    """
    if tuple(raw.strides) != row_major(sizes):
        return None
    partial = max((d for d, (n, whole) in enumerate(zip(extent, sizes)) if n < whole), default=0)
    row = raw.strides[partial - 1] if partial else math.prod(sizes)  # elements of one row
    first = sum(l * s for l, s in zip(lo, raw.strides))
    last = first + sum((n - 1) * s for n, s in zip(extent, raw.strides))
    begin, end = first // row * row, (last // row + 1) * row
    if (end - begin) * raw.itemsize > limit:
        return None
    return raw.offset + begin * raw.itemsize, (end - begin) * raw.itemsize


def is_contiguous(extent, strides) -> bool:
    """Whether a box of ``extent`` elements, laid out with ``strides``, is one run of memory in row-major order."""
    expected = 1
    for count, stride in zip(reversed(extent), reversed(strides)):
        if count > 1:
            if stride != expected:
                return False
            expected *= count
    return True
