"""Chunks: the rectangular pieces of a tensor a checkpoint stores, and where their bytes are.

A chunk has global offsets and sizes in its tensor and the place of its bytes (a file, an offset, a
length and how those bytes hold the elements). A tensor's chunks are a list, or for checkpoints of
thousands of ranks a ``ChunkTable`` (columns, a million chunks). ``check_cover`` checks that they cover
their tensor exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dcptool.errors import CheckpointError

RAW = "raw"  # the encoding of a chunk whose elements are stored as they are


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


def check_cover(tensor, where: str) -> None:
    """Raise unless the chunks of ``tensor`` (a ``core.TensorInfo``) lie within it and cover every element exactly once."""
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


def _table_covers(tensor, where: str) -> bool:
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
