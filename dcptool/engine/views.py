"""Tensors computed from other tensors' chunks: renamed, selected, narrowed, stacked, concatenated, rows permuted.

Each result is a ``TensorInfo`` whose chunks are views (``chunks.ChunkView``) of the source's chunks:
an affine map from the view chunk's elements to a stored chunk's. Nothing is read until the view
is, and then every byte is read once, from where it is stored, so renaming between families (``dcptool.renaming``)
costs planning, not copies, and keeps kernel copies, ``--max-memory`` and torchrun scale-out working.

>>> import numpy as np
>>> from dcptool.engine.chunks import Chunk
>>> from dcptool.engine.core import TensorInfo
>>> w = TensorInfo(("w",), "float32", (4, 2, 3), [Chunk((0, 0, 0), (4, 2, 3), "f", 0, 96, "raw")])
>>> expert = select(w, 0, 2, ("expert2",))
>>> expert.shape, expert.chunks[0].view.start
((2, 3), (2, 0, 0))
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool import dtypes
from dcptool.engine.chunks import Chunk, ChunkView
from dcptool.engine.core import Checkpoint, Computed, TensorInfo
from dcptool.errors import UsageError

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class Part:
    """A box of a view, ``[offsets, offsets + sizes)``, whose element ``i`` (counted from ``offsets``) is
    element ``origin + sum(i[d] * steps[d])`` of ``source``."""

    source: TensorInfo
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    origin: tuple[int, ...]
    steps: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, eq=False)
class ComputedView(Computed):
    """A view of tensors of which some are computed (``core.Computed``): the chunks, views of the stored ones,
    give the layout; the values are read box by box through each source's own reading, so a view of a
    dequantized or averaged tensor holds the computed values, not the stored bytes under them."""

    parts: tuple[Part, ...]

    @property
    def work_bytes(self) -> int:
        """The hull a part reads (rows ``step`` apart: ``step`` times the box) and what its source computes."""
        return max((dtypes.dtype(p.source.dtype).itemsize * max([1, *(max(s) for s in p.steps)])
                    + (p.source.transform.work_bytes if p.source.transform else 0)
                    for p in self.parts),
                   default=0)

    def others(self) -> tuple[Checkpoint, ...]:
        """The other checkpoints its computed sources read (a view of an average reads the average's)."""
        found = {id(c): c for p in self.parts if p.source.transform is not None
                 for c in p.source.transform.others()}
        return tuple(found.values())

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        for part in self.parts:
            lo = [max(o, p) for o, p in zip(offsets, part.offsets)]
            hi = [min(o + s, p + n) for o, s, p, n in zip(offsets, sizes, part.offsets, part.sizes)]
            if any(h <= l for l, h in zip(lo, hi)):
                continue
            local, extent = [l - p for l, p in zip(lo, part.offsets)], [h - l for l, h in zip(lo, hi)]
            first = [o + sum(i * step[k] for i, step in zip(local, part.steps)) for k, o in enumerate(part.origin)]
            hull = [1 + sum((n - 1) * step[k] for n, step in zip(extent, part.steps)) for k in range(len(first))]
            values = np.empty(hull, dtype=out.dtype)
            checkpoint.read_region(part.source, tuple(first), tuple(hull), values, scratch, passing=True)
            strides = [sum(step[k] * values.strides[k] for k in range(len(hull))) for step in part.steps]
            target = out[tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets)) + (Ellipsis,)]
            target[...] = np.lib.stride_tricks.as_strided(values, shape=extent, strides=strides)


def _with_values(view: TensorInfo, tensors: list[TensorInfo], parts) -> TensorInfo:
    """``view`` reading its values through ``parts`` (``Part`` arguments) when any of ``tensors`` is computed."""
    if all(tensor.transform is None for tensor in tensors):
        return view
    view.transform = ComputedView(tuple(Part(source, tuple(offsets), tuple(sizes), tuple(origin), tuple(map(tuple, steps)))
                                        for source, offsets, sizes, origin, steps in parts))
    return view


def _unit(dim: int, ndim: int) -> tuple[int, ...]:
    return tuple(1 if k == dim else 0 for k in range(ndim))


def renamed(tensor: TensorInfo, path: Path) -> TensorInfo:
    """The same tensor under another name (its chunks, and how its values are computed, are shared)."""
    return TensorInfo(path, tensor.dtype, tensor.shape, tensor.chunks, tensor.transform)


def select(tensor: TensorInfo, dim: int, index: int, path: Path) -> TensorInfo:
    """``tensor[..., index, ...]`` along ``dim``, which disappears (one expert of grouped experts)."""
    lo = [0] * len(tensor.shape)
    lo[dim] = index
    sizes = list(tensor.shape)
    sizes[dim] = 1
    axes = [d for d in range(len(tensor.shape)) if d != dim]
    shape = tuple(tensor.shape[d] for d in axes)
    view = TensorInfo(path, tensor.dtype, shape, _box(tensor, lo, sizes, axes, (0,) * len(shape)))
    ndim = len(tensor.shape)
    return _with_values(view, [tensor], [(tensor, (0,) * len(shape), shape, lo, [_unit(a, ndim) for a in axes])])


def narrow(tensor: TensorInfo, dim: int, start: int, length: int, path: Path) -> TensorInfo:
    """``tensor`` limited to ``[start, start + length)`` along ``dim`` (one half of a fused weight)."""
    lo = [0] * len(tensor.shape)
    lo[dim] = start
    sizes = list(tensor.shape)
    sizes[dim] = length
    axes = list(range(len(tensor.shape)))
    view = TensorInfo(path, tensor.dtype, tuple(sizes), _box(tensor, lo, sizes, axes, (0,) * len(sizes)))
    return _with_values(view, [tensor], [(tensor, (0,) * len(sizes), sizes, lo, [_unit(a, len(axes)) for a in axes])])


def stack(tensors: list[TensorInfo], path: Path) -> TensorInfo:
    """The tensors stacked along a new dim 0 (per-expert weights into grouped experts)."""
    first = _same(tensors, path, dims=None)
    chunks = []
    for index, tensor in enumerate(tensors):
        ndim = len(tensor.shape)
        chunks += _box(tensor, [0] * ndim, list(tensor.shape), [None, *range(ndim)], (index,) + (0,) * ndim)
    view = TensorInfo(path, first.dtype, (len(tensors), *first.shape), chunks)
    ndim = len(first.shape)
    return _with_values(view, tensors, [(tensor, (index,) + (0,) * ndim, (1, *tensor.shape), (0,) * ndim,
                                         [(0,) * ndim, *(_unit(d, ndim) for d in range(ndim))])
                                        for index, tensor in enumerate(tensors)])


def cat(tensors: list[TensorInfo], dim: int, path: Path) -> TensorInfo:
    """The tensors concatenated along ``dim`` (gate and up projections into a fused ``gate_up_proj``)."""
    first = _same(tensors, path, dims=dim)
    chunks, parts, start = [], [], 0
    for tensor in tensors:
        ndim = len(tensor.shape)
        place = tuple(start if d == dim else 0 for d in range(ndim))
        chunks += _box(tensor, [0] * ndim, list(tensor.shape), list(range(ndim)), place)
        parts.append((tensor, place, tensor.shape, (0,) * ndim, [_unit(d, ndim) for d in range(ndim)]))
        start += tensor.shape[dim]
    shape = tuple(start if d == dim else n for d, n in enumerate(first.shape))
    return _with_values(TensorInfo(path, first.dtype, shape, chunks), tensors, parts)


def transpose(tensor: TensorInfo, dim0: int, dim1: int, path: Path) -> TensorInfo:
    """``tensor`` with dims ``dim0`` and ``dim1`` swapped (GPT-OSS's experts ``[E, in, out]`` as ``[E, out, in]``)."""
    ndim = len(tensor.shape)
    axes = list(range(ndim))
    axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
    shape = tuple(tensor.shape[a] for a in axes)
    view = TensorInfo(path, tensor.dtype, shape, _box(tensor, [0] * ndim, list(tensor.shape), axes, (0,) * ndim))
    return _with_values(view, [tensor], [(tensor, (0,) * ndim, shape, (0,) * ndim, [_unit(a, ndim) for a in axes])])


def strided(tensor: TensorInfo, dim: int, start: int, step: int, path: Path) -> TensorInfo:
    """``tensor[..., start::step, ...]`` along ``dim`` (one of gate and up where they alternate)."""
    ndim = len(tensor.shape)
    count = max(0, -(-(tensor.shape[dim] - start) // step))
    steps = [tuple(step if k == dim else 0 for k in range(ndim)) if d == dim else _unit(d, ndim) for d in range(ndim)]
    chunks = []
    for chunk in tensor.chunks:
        if not chunk.numel:
            continue
        low, high = chunk.offsets[dim], chunk.offsets[dim] + chunk.sizes[dim]
        # the picked elements start + i*step that lie in [low, high)
        first, stop = max(0, -(-(low - start) // step)), min(count, -(-(high - start) // step))
        if first >= stop:
            continue
        offsets = tuple(first if d == dim else o for d, o in enumerate(chunk.offsets))
        sizes = tuple(stop - first if d == dim else n for d, n in enumerate(chunk.sizes))
        within = tuple(start + first * step - low if d == dim else 0 for d in range(ndim))
        chunks.append(_viewed(chunk, offsets, sizes, within, steps))
    shape = tuple(count if d == dim else n for d, n in enumerate(tensor.shape))
    origin = tuple(start if d == dim else 0 for d in range(ndim))
    return _with_values(TensorInfo(path, tensor.dtype, shape, chunks), [tensor],
                        [(tensor, (0,) * ndim, shape, origin, steps)])


def interleave(tensors: list[TensorInfo], dim: int, path: Path) -> TensorInfo:
    """Element ``i`` along ``dim`` is element ``i // n`` of ``tensors[i % n]`` (GPT-OSS's gate and up columns,
    alternating). No affine map of stored chunks makes it, so its values are computed as they are read
    (``Interleaved``); its chunks, the first tensor's stretched along ``dim``, give the layout."""
    first = _same(tensors, path, dims=None)
    count = len(tensors)
    chunks = []
    for chunk in first.chunks:
        base = chunk.view.base if chunk.view is not None else chunk
        chunks.append(Chunk(tuple(o * count if d == dim else o for d, o in enumerate(chunk.offsets)),
                            tuple(n * count if d == dim else n for d, n in enumerate(chunk.sizes)),
                            base.file, base.offset, base.length, base.encoding, None, base.rank))
    shape = tuple(n * count if d == dim else n for d, n in enumerate(first.shape))
    return TensorInfo(path, first.dtype, shape, chunks, Interleaved(tuple(tensors), dim))


@dataclass(frozen=True, eq=False)
class Interleaved(Computed):
    """The values of ``interleave``: each source's share of a region read into its place, every n-th along ``dim``."""

    tensors: tuple[TensorInfo, ...]
    dim: int

    @property
    def work_bytes(self) -> int:
        """A source's share read apart before it is placed, and what the source computes."""
        return dtypes.dtype(self.tensors[0].dtype).itemsize + max(
            (t.transform.work_bytes for t in self.tensors if t.transform is not None), default=0)

    def others(self) -> tuple[Checkpoint, ...]:
        found = {id(c): c for t in self.tensors if t.transform is not None for c in t.transform.others()}
        return tuple(found.values())

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        count, dim = len(self.tensors), self.dim
        begin, end = offsets[dim], offsets[dim] + sizes[dim]
        for which, tensor in enumerate(self.tensors):
            first = begin + (which - begin) % count  # the region's first element of this source
            if first >= end:
                continue
            picked = len(range(first, end, count))
            part_offsets = tuple(first // count if d == dim else o for d, o in enumerate(offsets))
            part_sizes = tuple(picked if d == dim else n for d, n in enumerate(sizes))
            values = np.empty(part_sizes, dtype=out.dtype)
            checkpoint.read_region(tensor, part_offsets, part_sizes, values, scratch, passing=True)
            out[(slice(None),) * dim + (slice(first - begin, None, count),)] = values


def permute_rows(tensor: TensorInfo, rows: list[int], path: Path) -> TensorInfo:
    """Row ``i`` of the view is row ``rows[i]`` of ``tensor`` (dim 0; Llama's RoPE permutation of q and k).

    Rows are grouped into runs of a constant step, so a view chunk covers as many rows as one
    affine map can: half a head when un-interleaving, two rows when interleaving.
    """
    if sorted(rows) != list(range(tensor.shape[0])):
        raise ValueError("rows must be a permutation of the first dim")
    chunks, parts, ndim = [], [], len(tensor.shape)
    for first, source, count, step in _runs(rows):
        parts.append((tensor, (first, *[0] * (ndim - 1)), (count, *tensor.shape[1:]), (source, *[0] * (ndim - 1)),
                      [tuple(step if k == 0 else 0 for k in range(ndim))] + [_unit(d, ndim) for d in range(1, ndim)]))
        for chunk in tensor.chunks:
            if not chunk.numel:
                continue
            low, high = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            # the run's rows source + j*step that lie in [low, high)
            j_lo = max(0, -(-(low - source) // step))
            j_hi = min(count, -(-(high - source) // step))
            if j_lo >= j_hi:
                continue
            ndim = len(tensor.shape)
            start = (source + j_lo * step - low,) + (0,) * (ndim - 1)
            steps = [tuple(step if k == 0 else 0 for k in range(ndim))] + [_unit(d, ndim) for d in range(1, ndim)]
            offsets = (first + j_lo, *chunk.offsets[1:])
            chunks.append(_viewed(chunk, offsets, (j_hi - j_lo, *chunk.sizes[1:]), start, steps))
    return _with_values(TensorInfo(path, tensor.dtype, tensor.shape, chunks), [tensor], parts)


def _runs(rows: list[int]):
    """``(first view row, first source row, count, step)`` of maximal runs with a constant positive step."""
    i = 0
    while i < len(rows):
        step = rows[i + 1] - rows[i] if i + 1 < len(rows) else 1
        if step <= 0:
            step, count = 1, 1
        else:
            count = 2
            while i + count < len(rows) and rows[i + count] - rows[i + count - 1] == step:
                count += 1
            count = min(count, len(rows) - i)
        yield i, rows[i], count, step
        i += count


def _same(tensors: list[TensorInfo], path: Path, dims: int | None) -> TensorInfo:
    """The first tensor, after checking every tensor has its dtype and shape (but along ``dims``)."""
    if not tensors:
        raise ValueError("nothing to combine")
    first = tensors[0]
    for tensor in tensors[1:]:
        other = [n for d, n in enumerate(tensor.shape) if d != dims]
        if tensor.dtype != first.dtype or len(tensor.shape) != len(first.shape) or \
                other != [n for d, n in enumerate(first.shape) if d != dims]:
            raise UsageError(f"{'.'.join(map(str, path))}: cannot combine {first.key} ({first.dtype}"
                             f"{list(first.shape)}) with {tensor.key} ({tensor.dtype}{list(tensor.shape)})")
    return first


def _box(tensor: TensorInfo, lo: list[int], sizes: list[int], axes: list[int | None], place) -> list[Chunk]:
    """View chunks of the box ``[lo, lo + sizes)`` of ``tensor``: view dim ``d`` runs along tensor dim
    ``axes[d]`` (None: a new dim of size 1), and the box's first element sits at view offsets ``place``.
    Tensor dims left out of ``axes`` have size 1 in the box."""
    ndim = len(tensor.shape)
    steps = [_unit(a, ndim) if a is not None else (0,) * ndim for a in axes]
    chunks = []
    for chunk in tensor.chunks:
        inner_lo = [max(l, o) for l, o in zip(lo, chunk.offsets)]
        inner_hi = [min(l + s, o + n) for l, s, o, n in zip(lo, sizes, chunk.offsets, chunk.sizes)]
        if any(h <= l for l, h in zip(inner_lo, inner_hi)) or not chunk.numel:
            continue
        offsets = tuple(p + (inner_lo[a] - lo[a] if a is not None else 0) for p, a in zip(place, axes))
        extent = tuple(inner_hi[a] - inner_lo[a] if a is not None else 1 for a in axes)
        start = tuple(l - o for l, o in zip(inner_lo, chunk.offsets))
        chunks.append(_viewed(chunk, offsets, extent, start, steps))
    return chunks


def _viewed(chunk: Chunk, offsets, sizes, start, steps) -> Chunk:
    """A view chunk of ``chunk``; a view of a view maps straight to the stored chunk (maps compose)."""
    if chunk.view is not None:
        inner = chunk.view
        start = tuple(b + sum(s * step[k] for s, step in zip(start, inner.steps)) for k, b in enumerate(inner.start))
        steps = [tuple(sum(m * step[k] for m, step in zip(outer, inner.steps)) for k in range(len(inner.start)))
                 for outer in steps]
        chunk = inner.base
    return Chunk(tuple(offsets), tuple(sizes), chunk.file, chunk.offset, chunk.length, "view", None, chunk.rank,
                 ChunkView(chunk, tuple(start), tuple(tuple(s) for s in steps)))
