"""FSDP1's flat parameters: the layout of its plain ``optimizer.state_dict()`` (checked on torch 2.13).

FSDP1 flattens the parameters of each unit it wraps into one flat parameter and shards that; its plain
optimizer state is laid out by it. ``flat_parameters`` computes the units as verl wraps the model,
``FlatParameter`` where each parameter lies in one and on each rank, ``flat_boxes`` the boxes of a
parameter that a run of its elements fills, ``alignment_of`` the alignment a saving job used.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dcptool import models


# verl wraps each decoder layer in an FSDP unit of its own; which layers those are is model-kind knowledge
# (dcptool.models). A parameter belongs to the unit of the outermost such layer its key passes through.
_WRAPPED_LAYER = re.compile(r"(?:.*?\.)?(?:" + "|".join(models.fsdp_units()) + r")\.")


@dataclass(frozen=True)
class FlatParameter:
    """One FSDP unit's flat parameter: its parameters in order, where each starts, and its length.

    As ``FlatParamHandle._init_flat_param_and_metadata`` (torch/distributed/fsdp/_flat_param.py)
    builds it: the unit's parameters flattened and concatenated in module order (the model file's
    order). With ``use_orig_params=True`` each parameter starts at a multiple of ``aligned_numel``
    (``_get_aligned_numel``: 16 bytes of the dtype FSDP1 computes in), the gaps zero padding.
    Sharding pads it with zeros to ``world_size`` equal shards: rank ``r`` holds elements
    ``[r*s, (r+1)*s)``, ``s = ceil(numel / world_size)`` (``_get_shard``); on one rank it is whole.
    """

    params: tuple[str, ...]
    starts: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int  # with the alignment padding, without the padding of the last shard

    @staticmethod
    def of(params: tuple[str, ...], numels: list[int], aligned_numel: int = 0) -> FlatParameter:
        """The flat parameter of ``params`` (of ``numels`` elements each), each aligned to ``aligned_numel``."""
        starts, total = [], 0
        for numel in numels:
            if aligned_numel:
                total += -total % aligned_numel
            starts.append(total)
            total += numel
        return FlatParameter(tuple(params), tuple(starts), tuple(numels), total)

    def shard_numel(self, world_size: int) -> int:
        """The elements of each rank's shard, the last one padded."""
        return -(-self.numel // world_size)

    def on_rank(self, rank: int, world_size: int):
        """``(index, first, stop, at)`` for each parameter rank ``rank`` holds elements of: its elements
        ``[first, stop)`` lie at element ``at`` of the rank's shard."""
        size = self.shard_numel(world_size)
        low, high = rank * size, (rank + 1) * size
        for index, (start, numel) in enumerate(zip(self.starts, self.numels)):
            first, stop = max(low, start), min(high, start + numel)
            if first < stop:
                yield index, first - start, stop - start, first - low

    def describe(self) -> str:
        """Its first parameter and how many more it holds, for messages."""
        more = f" and {len(self.params) - 1} more parameters" if len(self.params) > 1 else ""
        return f"{self.params[0]}{more}"


def flat_parameters(params: list[str], numels: dict[str, int], aligned_numel=lambda unit: 0) -> list[FlatParameter]:
    """The flat parameters of FSDP1 wrapped as verl wraps it, in the optimizer's order: the root unit's
    (parameters under no layer ``models.fsdp_units`` names) first, then each layer's, as the model lists them.
    ``aligned_numel(unit parameters)``: the alignment of a unit (0: ``use_orig_params=False``)."""
    units: dict[str, list[str]] = {"": []}
    for key in params:
        layer = _WRAPPED_LAYER.match(key)
        units.setdefault(layer.group(0) if layer else "", []).append(key)
    return [FlatParameter.of(tuple(keys), [numels[k] for k in keys], aligned_numel(keys))
            for keys in units.values() if keys]


def flat_boxes(start: int, stop: int, shape: tuple[int, ...]):
    """The boxes ``(offsets, sizes, first element)`` that elements ``[start, stop)`` of a row-major
    ``shape`` fill, each a contiguous run: a partial first row, whole rows, a partial last row (recursively)."""
    if start >= stop:
        return
    if len(shape) <= 1:
        yield (start,) * len(shape), (stop - start,) * len(shape), start
        return
    inner = math.prod(shape[1:])
    row, column = divmod(start, inner)
    last_row, last_column = divmod(stop, inner)
    if row == last_row:
        for offsets, sizes, first in flat_boxes(column, last_column, shape[1:]):
            yield (row,) + offsets, (1,) + sizes, row * inner + first
        return
    if column:
        for offsets, sizes, first in flat_boxes(column, inner, shape[1:]):
            yield (row,) + offsets, (1,) + sizes, row * inner + first
        row += 1
    if last_row > row:
        yield (row,) + (0,) * (len(shape) - 1), (last_row - row,) + tuple(shape[1:]), row * inner
    if last_column:
        for offsets, sizes, first in flat_boxes(0, last_column, shape[1:]):
            yield (last_row,) + offsets, (1,) + sizes, last_row * inner + first


# FSDP1 aligns use_orig_params parameters to 16 bytes of the dtype it computes in (_get_aligned_numel):
# float32, a MixedPrecision param_dtype of 2 bytes (verl's bf16), or of 1 byte.
_ALIGNMENTS = (4, 8, 16)


def alignment_of(params: list[str], numels: dict[str, int], pieces: dict[tuple[str, int], int],
                 world_size: int) -> int | None:
    """The alignment (in elements) of use_orig_params flat parameters whose layout gives every rank exactly
    the pieces it saved (``pieces``: ``(parameter, rank)`` -> its length; a MixedPrecision param_dtype
    changes the alignment), or None."""
    for aligned in _ALIGNMENTS:
        units = flat_parameters(params, numels, lambda unit: aligned)
        expected = {(unit.params[index], rank): stop - first for unit in units for rank in range(world_size)
                    for index, first, stop, _ in unit.on_rank(rank, world_size)}
        if expected == pieces:
            return aligned
    return None
