"""``dcptool diff``: what changed between two checkpoints, per tensor and in total, read region by region.

The two sides are paired as ``verify`` pairs them (``pairing.sides``: formats, layouts, naming
families). For every tensor on both sides of one shape, both are read in the same row-major slabs within
``max_memory`` and compared element by element: an element is *changed* when its values differ (NaN and NaN
are the same value; -0.0 and 0.0 too), *bit-identical* when the two sides have one dtype and its bits are
equal. Values are compared in float64 (bfloat16, float16, float32 and float8 are exact there; integers as
integers). Per tensor: elements changed, bit-identical, the largest absolute change ``max |b - a|`` and the
relative L2 change ``||b - a|| / ||a||`` (sums of squares in float64); a block-scaled float8 weight with its scales
(an ``export-hf --quantize`` output) counts as its dequantized values, so against its source these are the
quantization's error. A report, not a check: ``verify`` is
the gate. In JSON (strict: JSON has no inf or NaN) a change that is no finite number is null, and the entry's
``non_finite`` names it (``{"max_abs_change": "inf"}``).

>>> report = diff_sides(*sides("step-100", "step-200"))           # doctest: +SKIP
>>> report.summary()                                                # doctest: +SKIP
'99.1% of 7.6e9 parameters bit-identical; 14 of 723 tensors changed'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dcptool import dtypes
from dcptool.checks import pairing, stats, verification
from dcptool.engine import regions
from dcptool.errors import counted
from dcptool.planning import quant

BLOCK = regions.BLOCK  # elements compared at once: bounds the float64 temporaries


@dataclass
class Change:
    """What changed in one tensor, or in a group of them (``merged``)."""

    key: str
    dtype: str  # "float32", or "float32 -> bfloat16" where the dtypes differ
    numel: int = 0
    changed: int = 0
    identical: int = 0  # bit-identical elements (none where the dtypes differ)
    max_abs: float = 0.0
    squares_a: float = 0.0  # sum of a**2 (float64)
    squares_change: float = 0.0  # sum of (b - a)**2
    tensors: int = 1

    @property
    def relative(self) -> float:
        """``||b - a|| / ||a||``: 0 where nothing changed, inf where a is all zeros and something did."""
        if self.squares_change == 0:
            return 0.0
        return math.sqrt(self.squares_change) / math.sqrt(self.squares_a) if self.squares_a else math.inf

    def to_json(self) -> dict[str, Any]:
        """Strict JSON: a change that is inf (a NaN on one side, opposite infinities; A all zeros) or NaN is
        null, and ``non_finite`` names it with its value as text."""
        changes = {"max_abs_change": self.max_abs, "relative_l2_change": self.relative}
        return {"key": self.key, "dtype": self.dtype, "tensors": self.tensors, "elements": self.numel,
                "changed": self.changed, "changed_fraction": self.changed / self.numel if self.numel else 0.0,
                "bit_identical": self.identical,
                "bit_identical_fraction": self.identical / self.numel if self.numel else 1.0,
                **{name: value if math.isfinite(value) else None for name, value in changes.items()},
                "non_finite": {name: str(value) for name, value in changes.items() if not math.isfinite(value)}}


def merged(name: str, changes: list[Change]) -> Change:
    """The changes of several tensors as one (a folded group of layers)."""
    kinds = list(dict.fromkeys(c.dtype for c in changes))
    return Change(name, kinds[0] if len(kinds) == 1 else "mixed", sum(c.numel for c in changes),
                  sum(c.changed for c in changes), sum(c.identical for c in changes),
                  max((c.max_abs for c in changes), default=0.0), math.fsum(c.squares_a for c in changes),
                  math.fsum(c.squares_change for c in changes), len(changes))


@dataclass
class Report:
    """``dcptool diff``'s report: ``changes`` per tensor compared, in A's order; what could not be compared."""

    a: str
    b: str
    changes: list[Change] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    reshaped: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (key, shape in A, shape in B)
    note: str | None = None  # how the names were paired, when not key for key
    left_out: list[str] = field(default_factory=list)
    left_out_why: str | None = None

    @property
    def total(self) -> Change:
        return merged("total", self.changes)

    def summary(self) -> str:
        """``99.1% of 7.6e9 parameters bit-identical; 14 of 723 tensors changed``; elements unchanged in value
        but not in bits (-0.0 for 0.0, another dtype) counted after the bit-identical ones."""
        total = self.total
        share = f"{100 * total.identical / total.numel:.1f}%" if total.numel else "100%"
        changed = sum(1 for c in self.changes if c.changed)
        line = f"{share} of {_count(total.numel)} parameters bit-identical"
        if total.numel and total.identical != total.numel - total.changed:
            line += f", {_count(total.numel - total.changed - total.identical)} more equal in value, not in bits"
        line += f"; {changed} of {counted(len(self.changes), 'tensor')} changed"
        others = [f"{len(self.only_a)} only in A" if self.only_a else "", f"{len(self.only_b)} only in B" if self.only_b else "",
                  f"{len(self.reshaped)} of another shape" if self.reshaped else ""]
        others = [o for o in others if o]
        return line + (f"; not compared: {', '.join(others)}" if others else "")

    def grouped(self) -> list[Change]:
        """The changes with numbered layers folded into one row each, as ``inspect`` folds them."""
        by_key = {c.key: c for c in self.changes}
        return [by_key[keys[0]] if len(keys) == 1 else merged(name, [by_key[k] for k in keys])
                for name, keys in stats.folded_rows(list(by_key), lambda key: (by_key[key].dtype,))]

    def top(self, count: int) -> list[Change]:
        """The ``count`` tensors of the largest relative change (those that changed)."""
        return sorted((c for c in self.changes if c.changed), key=lambda c: -c.relative)[:count]

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        report = {"a": self.a, "b": self.b, "summary": self.summary(), "total": self.total.to_json(),
                  "tensors_changed": sum(1 for c in self.changes if c.changed), "tensors_compared": len(self.changes),
                  "tensors": [c.to_json() for c in self.changes], "only_in_a": self.only_a, "only_in_b": self.only_b,
                  "shape_changed": [{"key": k, "a": list(a), "b": list(b)} for k, a, b in self.reshaped],
                  "note": self.note, "left_out": self.left_out, "left_out_why": self.left_out_why}
        if top is not None:
            report["top"] = [c.key for c in self.top(top)]
        return report


def diff_sides(a: pairing.Side, b: pairing.Side, *, max_memory: int,
               progress: Callable[[int], None] | None = None) -> Report:
    """Compare every tensor on both sides, slab by slab; ``progress(n)`` after each slab of A's bytes."""
    report = Report(a.label, b.label)
    pairs = []
    for key, tensor in a.tensors.items():
        other = b.tensors.get(key)
        if other is None:
            report.only_a.append(key)
        elif other.shape != tensor.shape:
            report.reshaped.append((key, tensor.shape, other.shape))
        else:
            pairs.append((key, tensor, other))
    report.only_b = [key for key in b.tensors if key not in a.tensors]
    size = regions.buffer_size(max_memory, [t for _, t, _ in pairs], readers=2)
    reader_a = regions.RegionReader(a.checkpoint, bytearray(size))
    reader_b = regions.RegionReader(b.checkpoint, bytearray(size))
    for key, tensor_a, tensor_b in pairs:
        shown_a, shown_b = _shown(tensor_a), _shown(tensor_b)
        tensor_a, tensor_b = _values(tensor_a), _values(tensor_b)
        dtype_a, dtype_b = dtypes.dtype(tensor_a.dtype).name, dtypes.dtype(tensor_b.dtype).name
        change = Change(key, shown_a if shown_a == shown_b else f"{shown_a} -> {shown_b}", math.prod(tensor_a.shape))
        limit = min(reader_a.max_elements(tensor_a), reader_b.max_elements(tensor_b))
        for (_, values_a), (_, values_b) in zip(reader_a.slabs(tensor_a, limit), reader_b.slabs(tensor_b, limit)):
            _add(change, values_a.reshape(-1), values_b.reshape(-1), dtype_a, dtype_b)
            if progress:
                progress(values_a.nbytes)
        report.changes.append(change)
    return report


def _values(tensor):
    """The tensor whose values are compared: a block-scaled float8 weight's dequantized (codes times scales, float32:
    against its source, the quantization's error), any other as it is."""
    stored = isinstance(tensor.transform, (quant.Fp8Stored, quant.Mxfp4Stored))
    return tensor.transform.dequantized_view() if stored else tensor


def _shown(tensor) -> str:
    """The dtype a tensor is stored in; a block-scaled float8 weight's with ``x scales``, MXFP4's ``mxfp4``."""
    if isinstance(tensor.transform, quant.Mxfp4Stored):
        return "mxfp4"
    name = dtypes.dtype(tensor.dtype).name
    return f"{name} x scales" if isinstance(tensor.transform, quant.Fp8Stored) else name


def _add(change: Change, bits_a: np.ndarray, bits_b: np.ndarray, dtype_a: str, dtype_b: str) -> None:
    """Count one slab of both sides (unsigned views of their dtypes) into ``change``, a block at a time."""
    same = dtype_a == dtype_b
    integers = same and dtype_a not in verification.TOLERANT and dtype_a not in dtypes.FLOAT8
    for start in range(0, bits_a.size, BLOCK):
        block_a, block_b = bits_a[start:start + BLOCK], bits_b[start:start + BLOCK]
        if same:
            identical = int(np.count_nonzero(block_a == block_b))
            change.identical += identical
            if identical == block_a.size:
                a = dtypes.to_float64(block_a, dtype_a)
                with np.errstate(over="ignore"):
                    change.squares_a += float(np.dot(a, a))
                continue
        a, b = dtypes.to_float64(block_a, dtype_a), dtypes.to_float64(block_b, dtype_b)
        if integers:  # compared by their bits: float64 holds no int64 exactly
            moved = block_a != block_b
        else:
            with np.errstate(invalid="ignore"):
                moved = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        change.changed += int(np.count_nonzero(moved))
        with np.errstate(invalid="ignore", over="ignore"):
            step = np.where(moved, np.abs(b - a), 0.0)
            step[moved & np.isnan(step)] = math.inf  # a NaN on one side, or opposite infinities
            change.squares_a += float(np.dot(a, a))
            change.squares_change += float(np.dot(step, step))
        if step.size:
            change.max_abs = max(change.max_abs, float(step.max()))


def _count(number: int) -> str:
    """``7.6e9`` for large counts, the number itself below 10,000."""
    return f"{number:,}" if number < 10_000 else f"{number:.2g}".replace("e+0", "e").replace("e+", "e")

