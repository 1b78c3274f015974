"""The format-neutral description of a checkpoint that every reader produces and every writer consumes.

A checkpoint is a set of tensors and opaque objects, each under its nested path (``("model",
"layers", "0", "weight")``, flattened with ``.`` into its key, as DCP does). A tensor has a dtype, a
global shape and chunks: rectangular pieces with global offsets and sizes and the place of their
bytes. Any rectangular region of a tensor is assembled from the chunks that overlap it.

>>> ckpt = dcptool.open_checkpoint("step-100")          # doctest: +SKIP
>>> t = ckpt.tensors["model.embed_tokens.weight"]       # doctest: +SKIP
>>> t.dtype, t.shape, len(t.chunks)                     # doctest: +SKIP
('bfloat16', (32000, 4096), 8)
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from zlib_ng.zlib_ng import crc32, crc32_combine

from dcptool import dtypes, encodings
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive, RawBytes, chunk_label, record_name, row_major
from dcptool.torch_archive.layouts import RecordLayout
from dcptool.torch_archive.records import StoredData, check_crc, record_checks

RAW = "raw"  # the encoding of a chunk whose elements are stored as they are
# Records of a layout at most this long are read whole, storage and all, whatever part of their chunk a read needs:
# one read, where a frame and a part of the storage apart take two or three.
SMALL_RECORD = 2**16
# The frames of records (their bytes but their storages') one thread reads and checks at once.
FRAME_BYTES = 2**18

# The problems of single entries found while a checkpoint is opened under ``entry_problems``.
_entry_problems: ContextVar[list[tuple[str, str, CheckpointError]] | None] = ContextVar("entry_problems", default=None)


@contextlib.contextmanager
def entry_problems() -> Iterator[list[tuple[str, str, CheckpointError]]]:
    """While a checkpoint is opened in this context, a problem of one entry (what its metadata says of it, its
    chunks' cover) is collected as ``(kind, key, error)`` and the entry left out, where it would stop the
    opening: ``check`` names every problem, not the first."""
    found: list[tuple[str, str, CheckpointError]] = []
    token = _entry_problems.set(found)
    try:
        yield found
    finally:
        _entry_problems.reset(token)


def entry_problem(kind: str, key: str, error: CheckpointError) -> None:
    """Raise ``error``, a problem of the entry ``key`` (``metadata``, ``cover``), unless ``entry_problems`` collects
    them; the caller then leaves the entry out."""
    found = _entry_problems.get()
    if found is None:
        raise error
    found.append((kind, key, error))


@dataclass(frozen=True)
class Chunk:
    """A rectangular piece of a tensor and where its bytes are.

    ``encoding`` says how ``[offset, offset+length)`` of ``file`` holds the elements: ``RAW``, the
    elements themselves, row-major unless ``strides`` (in elements) says otherwise; any other is a
    record read by the codec that registered that encoding (``dcptool.encodings``: a ``torch.save``
    archive of one tensor, as DCP's chunk records; such an archive in a zstd record). A chunk with a
    ``view`` holds elements of another chunk, picked as ``view`` says (renamed, stacked, split or
    permuted tensors of ``dcptool.engine.views``; ``file``, ``offset``, ``length`` and ``rank`` are the base's).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    encoding: str = RAW
    strides: tuple[int, ...] | None = None
    rank: int | None = None  # the rank whose file holds it, where the format records one (DCP)
    view: ChunkView | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class ChunkView:
    """Where a view chunk's elements lie in a chunk of a stored tensor: element ``i`` (a multi-index
    of the view chunk) is element ``start + sum(i[d] * steps[d])`` of ``base`` (multi-indices of its box).

    Any selection, stacking, concatenation or row permutation of stored chunks is such an affine map,
    so a view reads its bytes where they are and is never materialized.
    """

    base: Chunk
    start: tuple[int, ...]
    steps: tuple[tuple[int, ...], ...]  # one base-index step vector per view dim


class ChunkTable(Sequence):
    """A tensor's chunks as columns (checkpoints of thousands of ranks have a million chunks): a
    sequence of ``Chunk`` made one at a time as they are asked for, and ``overlapping`` to find those
    a region needs in O(log n) plus what it finds.

    >>> table = ChunkTable(np.array([[0, 0], [2, 0]]), np.array([[2, 4], [2, 4]]), ["__0_0.distcp", "__1_0.distcp"],
    ...                    np.array([0, 1]), np.array([0, 0]), np.array([900, 900]), "torch-archive", [0, 1])
    >>> [c.offsets for c in table.overlapping((1, 0), (2, 4))], table[1].file
    ([(0, 0), (2, 0)], '__1_0.distcp')
    >>> table.splits(), table.ranks_recorded
    ([2, 1], True)
    """

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray, files: list[str], file_index: np.ndarray,
                 offset: np.ndarray, length: np.ndarray, encoding: str, ranks: list[int | None]):
        self.offsets, self.sizes = offsets, sizes  # (chunks, dims) int64
        self.files, self.ranks = files, ranks  # per file: its name and the rank that saved it
        self.file_index, self.offset, self.length = file_index, offset, length  # per chunk
        self.encoding = encoding
        # Along dim 0: chunks by first row, and the tallest, so a region finds its chunks by bisection.
        starts = offsets[:, 0] if offsets.shape[1] else np.zeros(len(offsets), np.int64)
        self._order = np.argsort(starts, kind="stable")
        self._starts = starts[self._order]
        self._tallest = int(sizes[:, 0].max()) if len(sizes) and sizes.shape[1] else 0

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        file = int(self.file_index[index])
        return _chunk(tuple(self.offsets[index].tolist()), tuple(self.sizes[index].tolist()), self.files[file],
                      int(self.offset[index]), int(self.length[index]), self.encoding, self.ranks[file])

    def __iter__(self):
        files, ranks, encoding = self.files, self.ranks, self.encoding
        for offsets, sizes, file, offset, length in zip(self.offsets.tolist(), self.sizes.tolist(),
                                                        self.file_index.tolist(), self.offset.tolist(),
                                                        self.length.tolist()):
            yield _chunk(tuple(offsets), tuple(sizes), files[file], offset, length, encoding, ranks[file])

    @property
    def ranks_recorded(self) -> bool:
        """Whether the format recorded which rank saved each file (DCP does)."""
        return any(rank is not None for rank in self.ranks)

    def splits(self) -> list[int]:
        """Per dim, how many distinct chunk offsets: how many pieces each dim is cut into
        (``[4, 1]``: four row blocks), read off the columns without making a Chunk."""
        return [len(np.unique(self.offsets[:, dim])) for dim in range(self.offsets.shape[1])]

    def overlapping(self, offsets, sizes) -> list[Chunk]:
        """The chunks holding any element of the region (none for an empty region), in file order."""
        if not len(self) or not len(offsets):
            return list(self) if math.prod(sizes) else []
        first = np.searchsorted(self._starts, offsets[0] - self._tallest, side="right")
        last = np.searchsorted(self._starts, offsets[0] + sizes[0], side="left")
        rows = self._order[first:last]
        lo, hi = np.asarray(offsets), np.asarray(offsets) + np.asarray(sizes)
        chunk_lo, chunk_hi = self.offsets[rows], self.offsets[rows] + self.sizes[rows]
        rows = rows[np.all((chunk_lo < hi) & (chunk_hi > lo), axis=1)]
        rows = rows[np.lexsort((self.offset[rows], self.file_index[rows]))]
        return [self[int(row)] for row in rows]


def _chunk(offsets, sizes, file, offset, length, encoding, rank) -> Chunk:
    """``Chunk(...)`` without the frozen dataclass's per-field checks (tables make millions of them)."""
    chunk = object.__new__(Chunk)
    object.__setattr__(chunk, "__dict__", {"offsets": offsets, "sizes": sizes, "file": file, "offset": offset,
                                           "length": length, "encoding": encoding, "strides": None, "rank": rank,
                                           "view": None})
    return chunk


def chunk_splits(chunks: list[Chunk] | ChunkTable, ndim: int) -> list[int]:
    """Per dim of the tensor, how many distinct offsets its chunks start at (``ChunkTable.splits``).

    >>> chunk_splits([Chunk((0, 0), (2, 4), "f", 0, 32), Chunk((2, 0), (2, 4), "f", 32, 32)], 2)
    [2, 1]
    """
    if isinstance(chunks, ChunkTable):
        return chunks.splits()
    return [len({c.offsets[dim] for c in chunks}) for dim in range(ndim)]


def ranks_recorded(chunks: list[Chunk] | ChunkTable) -> bool:
    """Whether any chunk records the rank whose file holds it."""
    if isinstance(chunks, ChunkTable):
        return chunks.ranks_recorded
    return any(c.rank is not None for c in chunks)


def overlapping(tensor: TensorInfo, offsets, sizes) -> list[Chunk] | Sequence[Chunk]:
    """The chunks of ``tensor`` that a region overlaps (all chunks of a plain list: callers skip the rest)."""
    if isinstance(tensor.chunks, ChunkTable):
        return tensor.chunks.overlapping(offsets, sizes)
    return tensor.chunks


@dataclass
class TensorInfo:
    path: tuple[str | int, ...]  # nested path as saved; ints index into lists
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] | ChunkTable
    # Computes the values from source regions instead of reading the chunks' bytes (a ``Computed``:
    # dequantized weights, averages, merged adapters); the chunks give the layout.
    transform: Computed | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return join_path(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


class Computed:
    """How the regions of a computed tensor are made from regions of source tensors (``TensorInfo.transform``).

    ``read(checkpoint, offsets, sizes, out, scratch)`` fills ``out`` (an unsigned view of the tensor's item
    size, shape ``sizes``) with the region at ``offsets``; ``checkpoint`` is the one the tensor belongs to,
    ``scratch`` a read buffer it may use (``Checkpoint.read_region``'s). Copies plan such tensors as any
    other: in slabs of the pieces a writer asks for, split over threads and torchrun ranks
    (``dcptool.engine.transfer``), each slab's temporaries bounded by ``work_bytes`` per element. Sources read with
    ``passing=True`` hand in their records' CRC-32s as they pass; the copy finishes the checks of
    ``checkpoint`` and of the ``others`` a computation reads.
    """

    work_bytes: int = 16  # bytes of temporaries per output element of a read (transfer sizes slabs by them)

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        raise NotImplementedError

    def others(self) -> tuple[Checkpoint, ...]:
        """Checkpoints other than the tensor's own that ``read`` reads."""
        return ()


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


def float32_region(checkpoint: Checkpoint, tensor: TensorInfo, offsets, sizes, scratch: memoryview,
                   out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (float32, shape ``sizes``) with a region of a floating-point tensor (float64 rounded to
    nearest, float8 decoded exactly), read for a computation: its records' CRC-32s handed in as they pass
    (``Computed``). Returns ``out``."""
    if tensor.dtype == "float32":
        checkpoint.read_region(tensor, offsets, sizes, out.view(np.uint32), scratch, passing=True)
        return out
    bits = workspace("float32_region", sizes, dtypes.raw_view_type(dtypes.dtype(tensor.dtype).itemsize))
    checkpoint.read_region(tensor, offsets, sizes, bits, scratch, passing=True)
    if tensor.dtype == "bfloat16":  # its bits are the top half of the float32's
        np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif tensor.dtype in dtypes.FLOAT8:
        np.take(dtypes.float8_to_float32(np.arange(256, dtype=np.uint8), tensor.dtype), bits, out=out)
    else:  # float16, float64
        out[...] = bits.view(dtypes.dtype(tensor.dtype).numpy)
    return out


def join_path(path) -> str:
    """The flat key of a nested path, as DCP writes it: ``("optim", "param_groups", 0, "lr")`` -> ``optim.param_groups.0.lr``."""
    return ".".join(str(part) for part in path)


_UNSET: Any = object()


@dataclass
class ObjectInfo:
    """A non-tensor entry (step counter, scheduler or dataloader state), carried through unopened.

    ``blob`` locates a ``torch.save`` archive of the value (DCP's bytes entries); ``value`` holds it
    when the reader had to parse it anyway (entries of a ``torch.save`` state dict).
    """

    path: tuple[str | int, ...]
    blob: tuple[str, int, int] | None = None  # (file, offset, length)
    value: Any = field(default=_UNSET, repr=False)

    @property
    def key(self) -> str:
        return join_path(self.path)


@dataclass
class Checkpoint:
    """What a reader found: the format, the tensors and objects, and the files they live in."""

    format: str
    root: Path | str  # a local path, or the URL it was read from
    files: CheckpointFiles
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    info: dict[str, Any] = field(default_factory=dict)  # format facts worth showing (world size, ...)
    # Filled from several threads (dcptool.engine.transfer): a race resolves a chunk twice, to the same value.
    _resolved: dict[Chunk, RawBytes] = field(default_factory=dict, repr=False)
    # (encoding, dtype, sizes, record length) -> where the elements start in records of a uniform encoding
    _layouts: dict[tuple, int] = field(default_factory=dict, repr=False)
    # the same -> the layout such records share, which checks them a batch at a time (None: they are checked alone)
    _record_layouts: dict[tuple, RecordLayout | None] = field(default_factory=dict, repr=False)

    def with_entries(self, tensors: dict[str, TensorInfo], objects: dict[str, ObjectInfo]) -> Checkpoint:
        """The same checkpoint holding these entries (renamed or added views of its own), sharing what it has
        learned of where its chunks' bytes are."""
        return Checkpoint(self.format, self.root, self.files, tensors, objects, dict(self.info), self._resolved,
                          self._layouts, self._record_layouts)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def data_files(self) -> list[str]:
        """The files the entries' bytes live in, relative to ``root``."""
        used = {f for t in self.tensors.values() for f in
                (t.chunks.files if isinstance(t.chunks, ChunkTable) else [c.file for c in t.chunks])}
        used |= {self.files.stored_in(o.blob[0]) for o in self.objects.values() if o.blob}
        return sorted(used)

    def validate(self) -> None:
        """Check that every tensor's chunks lie inside it and cover it exactly once (``entry_problem``)."""
        for key, tensor in list(self.tensors.items()):
            try:
                check_cover(tensor, where=str(self.root))
            except CheckpointError as exc:
                entry_problem("cover", key, exc)
                del self.tensors[key]

    def raw_bytes(self, tensor: TensorInfo, chunk: Chunk) -> RawBytes:
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

    def record_of(self, tensor: TensorInfo, chunk: Chunk) -> StoredData | None:
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

    def check_record(self, tensor: TensorInfo, chunk: Chunk) -> None:
        """Check the record that holds ``chunk``'s bytes (once per record; ``record_of``)."""
        stored = self.record_of(tensor, chunk)
        if stored is not None:
            record_checks(self.files).check(stored, tensor.key)

    def _resolve(self, tensor: TensorInfo, chunk: Chunk) -> RawBytes:
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

    def object_value(self, obj: ObjectInfo) -> Any:
        """The object's value, unpickled with the allowlist (tensors inside come back as references)."""
        if obj.value is _UNSET:
            obj.value = self.object_archive(obj).load()
        return obj.value

    def object_blob(self, obj: ObjectInfo) -> bytes | None:
        """The object's ``torch.save`` bytes when the checkpoint stores them as such, else None."""
        if obj.blob is None:
            return None
        self.object_archive(obj)
        file, offset, length = obj.blob
        return self.files.read(file, offset, length)

    def object_archive(self, obj: ObjectInfo) -> Archive:
        """The ``torch.save`` archive of an object stored as one, checked whole (it is small) unless records
        are not checked."""
        archive = Archive(self.files, *obj.blob, label=obj.key)
        archive.check_storages()
        return archive

    def region_in(self, tensor: TensorInfo, offsets, sizes, buffer, scratch: memoryview,
                  passing: bool = False) -> np.ndarray:
        """A region read into the start of ``buffer`` (reused by the caller), as an unsigned view of shape ``sizes``."""
        values = np.frombuffer(buffer, dtype=dtypes.raw_view_type(dtypes.dtype(tensor.dtype).itemsize),
                               count=math.prod(sizes)).reshape(sizes)
        self.read_region(tensor, offsets, sizes, values, scratch, passing)
        return values

    def read_region(self, tensor: TensorInfo, offsets, sizes, out: np.ndarray, scratch: memoryview,
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

    def _read_records(self, tensor: TensorInfo, boxes: list, offsets, sizes, out: np.ndarray,
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

    def _read_batches(self, tensor: TensorInfo, batches: dict, offsets, out: np.ndarray) -> list:
        """``_read_batch`` of each layout's records, ``FRAME_BYTES`` of frames at a time."""
        left = []
        for layout, items in batches.values():
            rows = max(1, FRAME_BYTES // layout.width)
            for first in range(0, len(items), rows):
                left += self._read_batch(tensor, layout, items[first:first + rows], offsets, out)
        return left

    def _read_batch(self, tensor: TensorInfo, layout: RecordLayout, items: list, offsets, out: np.ndarray) -> list:
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

    def _storage_name(self, tensor: TensorInfo, base: Chunk, layout: RecordLayout) -> str:
        """How messages name the storage of ``base``'s record (as ``Archive.storage_data`` does)."""
        record = record_name(self.files, base.file, base.offset, chunk_label(tensor.key, base))
        return f"{record}: {layout.storage_name}"

    def _check_alone(self, tensor: TensorInfo, base: Chunk, boxes: list) -> list:
        """Check a record that differs from its layout on its own (raises, naming what is wrong, when it is
        damaged); its boxes are then read one by one, from where its own archive says its elements are."""
        encoding = encodings.get(base.encoding)
        stored = encoding.record(self.files, tensor, base, chunk_label(tensor.key, base))
        record_checks(self.files).record(base.file, base.offset, lambda: stored)
        self._resolved[base] = encoding.locate(self.files, tensor, base)
        return boxes

    def _record_layout(self, tensor: TensorInfo, chunk: Chunk) -> RecordLayout | None:
        """The layout of ``chunk``'s record and those of its dtype, shape and length (learned from it the first
        time: its record checked whole); None when its encoding has none."""
        shape = (chunk.encoding, tensor.dtype, chunk.sizes, chunk.length)
        layout = self._record_layouts.get(shape, _UNSET)
        if layout is _UNSET:
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


# What writers consume: output tensors and objects, and the pieces a writer stores them as.


@dataclass(eq=False)  # compared and hashed by identity: pieces of one tensor share it
class OutTensor:
    """A tensor as it will be written: output key and nested path, dtype, shape, and its source."""

    key: str
    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    source: TensorInfo

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


@dataclass
class OutObject:
    """A non-tensor entry as it will be written; ``value()`` and ``blob()`` fetch it from the source."""

    key: str
    path: tuple[str, ...]
    source: ObjectInfo
    checkpoint: Checkpoint = field(repr=False)
    merged: list[ObjectInfo] = field(default_factory=list)  # other source entries it is made of (all carried)

    def value(self) -> Any:
        return self.checkpoint.object_value(self.source)

    def blob(self) -> bytes | None:
        return self.checkpoint.object_blob(self.source)


@dataclass(frozen=True)
class Piece:
    """A rectangular region of an output tensor that a writer stores as one unit (a chunk, a shard)."""

    tensor: OutTensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * dtypes.dtype(self.tensor.dtype).itemsize



def check_cover(tensor: TensorInfo, where: str) -> None:
    """Raise unless the chunks of ``tensor`` lie within it and cover every element exactly once."""
    if isinstance(tensor.chunks, ChunkTable) and _table_covers(tensor, where):
        return
    shape = tensor.shape
    filled = 0
    boxes = []
    for chunk in tensor.chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            raise CheckpointError(f"{where}: {tensor.key}: chunk rank {len(chunk.sizes)} != tensor rank {len(shape)}")
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
            raise CheckpointError(
                f"{where}: {tensor.key}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} "
                f"lies outside the tensor's shape {list(shape)}"
            )
        if chunk.numel:
            boxes.append(chunk)
            filled += chunk.numel
    # Sweep along the dim that separates the chunks most: only chunks whose ranges there overlap can
    # overlap (sweeping dim 0 of 20,000 chunks of one row would compare every pair).
    dim = max(range(len(shape)), key=lambda d: len({c.offsets[d] for c in boxes}), default=0)
    boxes.sort(key=lambda c: c.offsets[dim:dim + 1])
    for i, a in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            if shape and b.offsets[dim] >= a.offsets[dim] + a.sizes[dim]:
                break
            if all(bo < ao + asz and ao < bo + bsz for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                raise CheckpointError(
                    f"{where}: {tensor.key}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap"
                )
    total = math.prod(shape)
    if filled != total:
        raise CheckpointError(
            f"{where}: {tensor.key}: chunks cover {filled} of its {total} elements (a chunk is missing)"
        )


def _table_covers(tensor: TensorInfo, where: str) -> bool:
    """The cover check of a chunk table in numpy: True when the chunks are within the tensor and cut one
    dim into consecutive ranges (as FSDP and TP save); False leaves the check to ``check_cover``."""
    table, shape = tensor.chunks, np.asarray(tensor.shape, np.int64)
    offsets, sizes = table.offsets, table.sizes
    if offsets.shape[1] != len(shape):
        return False
    outside = np.flatnonzero(np.any((offsets < 0) | (sizes < 0) | (offsets + sizes > shape), axis=1))
    if len(outside):
        chunk = table[int(outside[0])]
        raise CheckpointError(f"{where}: {tensor.key}: chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} "
                              f"lies outside the tensor's shape {list(tensor.shape)}")
    full = np.all((offsets == 0) & (sizes == shape), axis=0)  # dims no chunk cuts
    cut = np.flatnonzero(~full)
    nonempty = np.all(sizes > 0, axis=1)
    if len(cut) > 1 or not len(shape):
        return False
    if not len(cut):
        return int(nonempty.sum()) == 1  # one whole chunk (and empty ones)
    dim = int(cut[0])
    rows = np.flatnonzero(nonempty)
    if not np.all((offsets[rows][:, full] == 0) & (sizes[rows][:, full] == shape[full])):
        return False
    rows = rows[np.argsort(offsets[rows, dim], kind="stable")]
    starts, ends = offsets[rows, dim], offsets[rows, dim] + sizes[rows, dim]
    return len(rows) > 0 and starts[0] == 0 and ends[-1] == shape[dim] and bool(np.all(starts[1:] == ends[:-1]))
