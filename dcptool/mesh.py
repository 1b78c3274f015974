"""Device meshes and the chunks a job on one saves: which rank holds which region of each tensor.

A training job's mesh is data parallel (HSDP replicas x FSDP shards, with context parallel folded
into FSDP as torchtitan does), tensor parallel, and expert parallel, which borrows its ranks from
the data-parallel dims (and from tp when ``etp=1``). Every tensor is a DTensor over some of those
axes; this module computes, without torch, the local shape and global offset that
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` gives each rank, since
that is what ``dcp.save`` records. The rules are torch's, including torch.chunk-style uneven
shards, empty shards (recorded at offset = the dim's size) and ``_StridedShard``.

>>> mesh = Mesh(dp=2, tp=2)
>>> spec = (Axis("fsdp", 2, Strided(0, 2)), Axis("tp", 2, Shard(0)))   # FSDP2 over a colwise TP weight
>>> [local_chunk((8, 4), spec, mesh.coordinates(rank)) for rank in range(4)]
[((0, 0), (2, 4)), ((4, 0), (2, 4)), ((2, 0), (2, 4)), ((6, 0), (2, 4))]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

from dcptool.errors import UsageError, option


@dataclass(frozen=True)
class Shard:
    """torch ``Shard(dim)``: torch.chunk of the dim across the axis."""

    dim: int

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Strided:
    """torch ``_StridedShard(dim, split_factor)``: FSDP2's shard of a dim that a later axis (TP, EP) also
    shards. The dim is first cut into ``split_factor`` pieces, each piece into the axis's count,
    and a rank holds its part of every piece."""

    dim: int
    split_factor: int

    def __str__(self) -> str:
        return f"_StridedShard({self.dim}, sf={self.split_factor})"


class Axis(NamedTuple):
    """One mesh axis a tensor is placed on: its name, its size, and the placement on it (None: replicated)."""

    name: str
    size: int
    placement: Shard | Strided | None


@dataclass(frozen=True)
class Mesh:
    """A training mesh. ``dp`` is the FSDP shard degree (torchtitan's ``dp_shard``), ``dp_replicate`` the
    HSDP replica count, ``cp`` context parallel (FSDP shards over ``dp*cp``), ``tp`` tensor parallel,
    ``ep`` expert parallel and ``etp`` the TP degree of the experts (1 or ``tp``)."""

    dp: int = 1
    tp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp_replicate: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp * self.cp * self.tp

    @property
    def fsdp(self) -> int:
        """Size of the FSDP axis of dense tensors."""
        return self.dp * self.cp

    @property
    def efsdp(self) -> int:
        """Size of the FSDP axis of expert tensors: the data-parallel ranks EP leaves over."""
        borrowed = self.fsdp * (self.tp if self.etp == 1 else 1)
        return borrowed // self.ep

    def check(self) -> None:
        """Refuse meshes no job can build (torchtitan's and AReaL Archon's rules), naming the setting."""
        for name in ("dp", "tp", "ep", "etp", "cp", "dp_replicate"):
            if getattr(self, name) < 1:
                raise UsageError(f"{option(name, getattr(self, name))}: must be at least 1")
        if self.etp not in (1, self.tp):
            raise UsageError(f"{option('etp', self.etp)}: must be 1 or equal to {option('tp')} ({self.tp})")
        if self.ep == 1:
            return
        if self.etp == self.tp:
            if self.ep % self.cp or self.fsdp % self.ep:
                raise UsageError(f"{option('ep', self.ep)} with {option('etp', self.etp)}: ep must be a multiple of cp ({self.cp}) "
                                 f"and divide dp*cp ({self.fsdp}), the ranks it borrows")
        elif self.ep % (self.cp * self.tp) or (self.fsdp * self.tp) % self.ep:
            raise UsageError(f"{option('ep', self.ep)} with {option('etp', 1)}: ep must be a multiple of cp*tp ({self.cp * self.tp}) "
                             f"and divide dp*cp*tp ({self.fsdp * self.tp}), the ranks it borrows")

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's coordinate on every axis, as torchtitan lays ranks out: row-major over
        (dp_replicate, fsdp, tp) for dense tensors and over (dp_replicate, efsdp, ep, etp) for experts
        (with ``etp=1`` the ep axis spans the tp ranks too)."""
        replica, rest = divmod(rank, self.fsdp * self.tp)
        fsdp, tp = divmod(rest, self.tp)
        inner = self.tp if self.etp == self.tp else 1
        efsdp, rest = divmod(rest, self.ep * inner)
        ep, etp = divmod(rest, inner)
        return {"dp_replicate": replica, "fsdp": fsdp, "tp": tp, "efsdp": efsdp, "ep": ep, "etp": etp}

    def describe(self) -> str:
        """``8 ranks: dp=4 x tp=2; experts ep=2 (etp=1)``; sizes of 1 are left out."""
        dims = [f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp", "cp", "tp") if getattr(self, n) > 1]
        text = f"{self.world} rank{'s' if self.world > 1 else ''}: " + (" x ".join(dims) or "dp=1")
        if self.ep > 1:
            text += f"; experts ep={self.ep}" + (f" (etp={self.etp})" if self.tp > 1 else "")
        return text

    def as_dict(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in ("dp_replicate", "dp", "cp", "tp", "ep", "etp")}


SIZE_NAMES = tuple(f.name for f in fields(Mesh))  # what mesh text may set: dp, tp, ep, etp, cp, dp_replicate


def parse_mesh(text: str, keyword: str) -> dict[str, int]:
    """The sizes set by mesh text such as ``dp=2,tp=2,ep=2,etp=tp`` (``etp=tp``: the same size as tp).

    ``keyword`` is the option the text came with (``load_on``, ``mesh``); text that is not sizes is
    refused naming it.

    >>> parse_mesh("dp=2, tp=4, etp=tp", "mesh")
    {'dp': 2, 'tp': 4, 'etp': 4}
    >>> parse_mesh("dp=2,pp=2", "load_on")
    Traceback (most recent call last):
    dcptool.errors.UsageError: load_on='dp=2,pp=2': give sizes as name=N with names dp, tp, ep, etp, cp, dp_replicate
    """
    sizes: dict[str, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip().replace("-", "_")
        if name not in SIZE_NAMES or not (value.isdigit() or (name == "etp" and value == "tp")):
            raise UsageError(f"{option(keyword, text)}: give sizes as name=N with names {', '.join(SIZE_NAMES)}")
        sizes[name] = value if value == "tp" else int(value)
    if sizes.get("etp") == "tp":
        sizes["etp"] = sizes.get("tp", 1)
    return sizes  # type: ignore[return-value]


class NotRectangular(ValueError):
    """A rank's shard is not one rectangle, so ``dcp.save`` could not record it as a chunk."""


def _take(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Elements at positions ``[start, stop)`` of the concatenated index runs."""
    picked, position = [], 0
    for first, end in runs:
        length = end - first
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            picked.append((first + lo - position, first + hi - position))
        position += length
    return picked


def _chunk(runs, count: int, index: int):
    """torch.chunk of the index runs into ``count`` pieces (ceil-sized, trailing pieces empty): piece ``index``."""
    total = sum(end - first for first, end in runs)
    size = -(-total // count)
    return _take(runs, min(size * index, total), min(size * (index + 1), total))


def _strided(runs, count: int, index: int, split_factor: int):
    """``_StridedShard``: cut into ``split_factor`` pieces, each into ``count``; piece ``index`` of each."""
    picked = []
    for split in range(split_factor):
        picked += _chunk(_chunk(runs, split_factor, split), count, index)
    return picked


def local_chunk(shape: tuple[int, ...], spec: tuple[Axis, ...], coordinates: dict[str, int]):
    """``(offsets, sizes)`` that ``dcp.save`` records for the rank at ``coordinates`` (torch's rules).

    Raises ``NotRectangular`` when the rank's indices along a dim are not one contiguous range.
    """
    runs: dict[int, list[tuple[int, int]]] = {}
    for axis in spec:
        placement = axis.placement
        if placement is None or axis.size == 1:  # one piece: the whole dim
            continue
        current = runs.get(placement.dim, [(0, shape[placement.dim])])
        coordinate = coordinates[axis.name]
        if isinstance(placement, Strided):
            runs[placement.dim] = _strided(current, axis.size, coordinate, placement.split_factor)
        else:
            runs[placement.dim] = _chunk(current, axis.size, coordinate)
    offsets, sizes = [0] * len(shape), list(shape)
    for dim, dim_runs in runs.items():
        merged = []
        for first, end in dim_runs:
            if merged and merged[-1][1] == first:
                merged[-1] = (merged[-1][0], end)
            else:
                merged.append((first, end))
        if len(merged) > 1:
            raise NotRectangular(f"dim {dim} holds indices {merged}")
        offsets[dim], sizes[dim] = (merged[0][0], merged[0][1] - merged[0][0]) if merged else (shape[dim], 0)
    return tuple(offsets), tuple(sizes)


def spec_str(spec: tuple[Axis, ...]) -> str:
    """``fsdp=4:_StridedShard(0, sf=2) tp=2:Shard(0)``; replicated and size-1 axes left out."""
    shown = [f"{a.name}={a.size}:{a.placement}" for a in spec if a.placement is not None and a.size > 1]
    return " ".join(shown) or "replicated"


def fsdp_placement(dim: int, parallel: tuple[Axis, ...]) -> Shard | Strided:
    """FSDP2's placement on its axis: ``_StridedShard`` when TP/EP axes after it shard the same dim."""
    split = math.prod(a.size for a in parallel if a.placement is not None and a.placement.dim == dim)
    return Strided(dim, split) if split > 1 else Shard(dim)


def contiguous(spec: tuple[Axis, ...]) -> tuple[Axis, ...]:
    """``spec`` with every ``_StridedShard`` made a ``Shard`` of its dim: what a job that redistributes strided
    shards before ``dcp.save`` (transformers') holds and saves."""
    return tuple(Axis(a.name, a.size, Shard(a.placement.dim)) if isinstance(a.placement, Strided) else a for a in spec)
