"""Compare two checkpoints of any formats and layouts: keys, dtypes, shapes and values, region by region.

Both sides read each tensor in the same row-major slabs through fixed buffers (``dcptool.engine.regions``), so
comparing two 100 GB checkpoints needs ``max_memory``, not 200 GB. Values compare bitwise on their raw bits
(NaN payloads included) unless tolerances are given; then floating-point tensors, also of different float
dtypes (a float32 checkpoint and its bfloat16 export), pass where ``|a - b| <= atol + rtol * |a|``
(NaN in both places counts as equal), and the largest absolute and relative difference of every
tensor is reported. A is the reference: "missing" means missing from B. The two sides come paired by
``dcptool.checks.pairing`` (a training state against its export, other layouts, other naming families).

>>> pairing = sides("step-1000", "hf-out")                                      # doctest: +SKIP
>>> report = compare_sides(pairing.a, pairing.b, dtype_as="b")                  # doctest: +SKIP
>>> report.equal, [d.key for d in report.differences], pairing.left_out[:1]     # doctest: +SKIP
(True, [], ['optimizer.state.model.norm.weight.exp_avg'])
>>> roundtrip("step-1000", "hf").left_out[:2]                            # doctest: +SKIP
['dcp.optim.state.model.norm.weight.exp_avg', 'dcp.optim.state.model.norm.weight.exp_avg_sq']
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dcptool import dtypes, formats
from dcptool.planning import conversion, quant
from dcptool.engine.core import Checkpoint
from dcptool.errors import CheckpointError, UsageError, counted, option, printable
from dcptool.format_interface import Sharding, OutputRequest
from dcptool.checks.pairing import Side, normalized, roots_of
from dcptool.engine.regions import BLOCK, RegionReader, buffer_size
from dcptool.sizes import DEFAULT_MAX_MEMORY
from dcptool.state_dicts import plain_data

# Tolerances apply to these; other dtypes (integers, bool, float8) always compare exactly.
TOLERANT = ("float64",) + dtypes.CASTABLE


@dataclass
class Difference:
    """One way the two sides differ at one key."""

    key: str
    kind: str  # "missing" (from B), "extra" (in B only), "dtype", "shape", "value", "object"
    detail: str
    first_index: list[int] | None = None  # kind "value": the first differing element (global, row-major)
    count: int | None = None  # kind "value": how many elements differ
    cast_to: str | None = None  # kind "dtype" of two float types: the side whose dtype dtype_as should cast to


@dataclass
class Report:
    """What a comparison found. ``closeness`` (with tolerances) holds ``(max abs, max rel)`` per tensor."""

    a: str
    b: str
    tolerances: tuple[float, float] | None = None
    tensors: int = 0  # compared by value
    bytes: int = 0
    objects: int = 0
    differences: list[Difference] = field(default_factory=list)
    closeness: dict[str, tuple[float, float]] = field(default_factory=dict)
    # block-scaled float8 tensors compared with the other side quantized with their scales (``dtype_as``): the
    # dequantized error, (max abs, relative L2: ||a - codes x scales|| / ||a||)
    quantized: dict[str, tuple[float, float]] = field(default_factory=dict)
    not_compared: list[str] = field(default_factory=list)  # non-tensor entries that are not plain data
    left_out: list[str] = field(default_factory=list)  # what one side holds and the comparison cannot (left_out_why)
    left_out_why: str = "the round trip's format cannot hold them"
    roundtrip: str | None = None
    note: str | None = None  # how the sides were matched, when not key for key (across naming families)
    layout: str | None = None  # how the layouts differ ("A has model at `model.`, B at top level")
    values_only: bool = False  # a layout difference alone does not make the two unequal
    dtype_as: str | None = None  # "a" or "b": floating-point values cast to that side's dtypes before comparing

    @property
    def equal(self) -> bool:
        return not self.differences and (self.layout is None or self.values_only)

    @property
    def dtype_hint(self) -> str | None:
        """``"a"`` or ``"b"`` when every difference is one of dtype between floating-point types that
        ``dtype_as`` casts: the side to cast to (the narrower dtype's); else None."""
        sides = {d.cast_to if d.kind == "dtype" else None for d in self.differences}
        if not sides or None in sides:
            return None
        return sides.pop() if len(sides) == 1 else "b"

    def summary(self) -> str:
        mode = "bitwise" if self.tolerances is None else "within atol {:g}, rtol {:g}".format(*self.tolerances)
        if self.dtype_as:
            mode += f" after casting {'A' if self.dtype_as == 'b' else 'B'} to {self.dtype_as.upper()}'s dtypes"
            if self.quantized:
                mode += f" ({len(self.quantized)} quantized with {self.dtype_as.upper()}'s scales)"
        what = (f"{counted(self.tensors, 'tensor')} ({self.bytes:,} bytes) compared {mode}, "
                f"{counted(self.objects, 'non-tensor entry', 'non-tensor entries')}")
        layout = f"layout differs: {self.layout}" + (f" ({option('values_only')})" if self.values_only else "") if self.layout else ""
        if not self.differences:
            return f"values equal; {layout}: {what}" if layout else f"equal: {what}"
        kinds: dict[str, int] = {}
        for difference in self.differences:
            kinds[difference.kind] = kinds.get(difference.kind, 0) + 1
        return (f"{counted(len(self.differences), 'difference')} ({', '.join(f'{n} {k}' for k, n in kinds.items())})"
                + (f"; {layout}" if layout else "") + f": {what}")

    def to_json(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "a": self.a, "b": self.b, "roundtrip": self.roundtrip, "equal": self.equal,
            "mode": "bitwise" if self.tolerances is None else "tolerance",
            "tensors_compared": self.tensors, "bytes_compared": self.bytes, "objects_compared": self.objects,
            "differences": [{k: v for k, v in vars(d).items() if v is not None} for d in self.differences],
            "objects_not_compared": self.not_compared, "left_out": self.left_out,
            "left_out_why": self.left_out_why if self.left_out else None, "layout": self.layout,
            "values_only": self.values_only, "dtype_as": self.dtype_as,
        }
        if self.quantized:
            report["quantized"] = {k: {"max_abs_error": _number(a), "relative_l2_error": _number(r)}
                                   for k, (a, r) in self.quantized.items()}
        if self.tolerances is not None:
            report["atol"], report["rtol"] = self.tolerances
            report["tensors"] = {k: {"max_abs": _number(a), "max_rel": _number(r)} for k, (a, r) in self.closeness.items()}
        return report


def check_dtype_as(dtype_as: str | None) -> str | None:
    """``dtype_as`` as ``"a"`` or ``"b"`` (either case), or None."""
    if dtype_as is None:
        return None
    if str(dtype_as).lower() not in ("a", "b"):
        raise UsageError(f"{option('dtype_as', printable(str(dtype_as), 20))}: choose A or B (the side whose dtypes the other is cast to)")
    return str(dtype_as).lower()


def check_arguments(b: str | Path | None, roundtrip: str | None, load_on: object | None,
                    prefix_a: str | None = None, prefix_b: str | None = None, format_b: str | None = None) -> None:
    """Refuse what ``dcptool verify`` cannot do together: A against B, A's round trip, or A's load on a mesh."""
    if load_on:
        if b is not None or roundtrip:
            raise UsageError(f"{option('load_on')} checks A alone: give no B or {option('roundtrip')}")
    elif roundtrip:
        if b is not None or prefix_a or prefix_b or format_b:
            raise UsageError(f"{option('roundtrip')} compares A with its own round trip: give no B, {option('prefix_a')}, "
                             f"{option('prefix_b')} or {option('format_b')}")
    elif b is None:
        raise UsageError(f"give the checkpoint B to compare A with, or {option('roundtrip')}")


def compare_sides(a: Side, b: Side, *, atol: float | None = None, rtol: float | None = None,
                  dtype_as: str | None = None, max_memory: int = DEFAULT_MAX_MEMORY,
                  progress: Callable[[int], None] | None = None) -> Report:
    """Compare two sides key by key; half of ``max_memory`` buffers each side's reads.

    Without ``atol``/``rtol`` values must be bitwise equal; with either, floating-point tensors
    may differ within the tolerances and their largest differences are reported. ``dtype_as`` ``"b"``
    casts A's floating-point tensors to B's dtypes first (rounding as torch's ``.to(dtype)``: to
    nearest, ties to even), ``"a"`` B's to A's; the cast values then compare as any others.
    """
    tolerances = None if atol is None and rtol is None else (float(atol or 0.0), float(rtol or 0.0))
    dtype_as = check_dtype_as(dtype_as)
    report = Report(a.label, b.label, tolerances, dtype_as=dtype_as)
    pairs = []
    for key, tensor in a.tensors.items():
        if key not in b.tensors:
            report.differences.append(Difference(key, "missing", "tensor only in A"))
        else:
            pairs.append((key, tensor, b.tensors[key]))
    report.differences += [Difference(k, "extra", "tensor only in B") for k in b.tensors if k not in a.tensors]

    size = buffer_size(max_memory, [t for _, t, _ in pairs], readers=2)
    reader_a, reader_b = RegionReader(a.checkpoint, bytearray(size)), RegionReader(b.checkpoint, bytearray(size))
    for key, tensor_a, tensor_b in pairs:
        dtype_a, dtype_b = dtypes.dtype(tensor_a.dtype).name, dtypes.dtype(tensor_b.dtype).name
        cast = dtype_as is not None and dtype_a != dtype_b and {dtype_a, dtype_b} <= set(dtypes.CASTABLE)
        castable = tolerances is not None and dtype_a in TOLERANT and dtype_b in TOLERANT
        quantized = _quantized_side(tensor_a, tensor_b)
        if quantized and dtype_as == quantized and tensor_a.shape == tensor_b.shape:
            readers = (reader_a, reader_b) if quantized == "b" else (reader_b, reader_a)
            tensors = (tensor_a, tensor_b) if quantized == "b" else (tensor_b, tensor_a)
            _compare_quantized(key, *tensors, *readers, report, progress)
        elif dtype_a != dtype_b and not castable and not cast:
            cast_to = quantized
            if {dtype_a, dtype_b} <= set(dtypes.CASTABLE):  # cast the wider to the narrower: exact where they agree
                cast_to = "a" if dtypes.dtype(dtype_a).itemsize < dtypes.dtype(dtype_b).itemsize else "b"
            by_tolerance = f"{option('atol')}/{option('rtol')}"
            other = "A" if cast_to == "b" else "B"
            hint = f" ({option('dtype_as', cast_to.upper())} compares {other} quantized with " \
                   f"{cast_to.upper()}'s scales)" if quantized else \
                f" ({option('dtype_as', cast_to.upper())} or {by_tolerance} compare the values)" if cast_to else \
                f" ({by_tolerance} compare the values)" if dtype_a in TOLERANT and dtype_b in TOLERANT else ""
            report.differences.append(Difference(key, "dtype", f"A {dtype_a}, B {dtype_b}{hint}", cast_to=cast_to))
        elif tensor_a.shape != tensor_b.shape:
            report.differences.append(Difference(key, "shape", f"A {list(tensor_a.shape)}, B {list(tensor_b.shape)}"))
        else:
            compared_as = (dtype_b, dtype_b) if cast and dtype_as == "b" else (dtype_a, dtype_a) if cast else (dtype_a, dtype_b)
            comparison = _ValueComparison(*compared_as, tolerances)
            limit = min(reader_a.max_elements(tensor_a), reader_b.max_elements(tensor_b))
            for (offsets, values_a), (_, values_b) in zip(reader_a.slabs(tensor_a, limit), reader_b.slabs(tensor_b, limit)):
                if cast:
                    values_a = dtypes.cast(values_a, dtype_a, compared_as[0])
                    values_b = dtypes.cast(values_b, dtype_b, compared_as[1])
                comparison.add(offsets, values_a, values_b)
                if progress:
                    progress(values_a.nbytes)
            report.tensors += 1
            report.bytes += tensor_a.nbytes
            if tolerances is not None:
                report.closeness[key] = (comparison.max_abs, comparison.max_rel)
            if comparison.count:
                report.differences.append(comparison.difference(key, math.prod(tensor_a.shape)))
    _compare_objects(a, b, report)
    return report


def _quantized_side(tensor_a, tensor_b) -> str | None:
    """``"b"`` when B's tensor is a block-scaled float8 weight with its scales (``quant.folded``) and A's a float
    one, ``"a"`` the other way round; else None."""
    stored = (quant.Fp8Stored, quant.Mxfp4Stored)
    for side, quantized, other in (("b", tensor_b, tensor_a), ("a", tensor_a, tensor_b)):
        if isinstance(quantized.transform, stored) and other.dtype in TOLERANT \
                and not isinstance(other.transform, stored):
            return side
    return None


def _compare_quantized(key: str, tensor, stored, reader, stored_reader, report: Report, progress) -> None:
    """A float tensor against its quantized form: block-scaled float8 (``quant.Fp8Stored``: the float one quantized
    with its scales must give its codes, bitwise) or MXFP4 (``quant.Mxfp4Stored``: quantized with its scale
    exponents, the same values); the dequantized error goes in ``report.quantized``."""
    transform = stored.transform
    fp8 = isinstance(transform, quant.Fp8Stored)
    comparison = _ValueComparison(quant.FP8, quant.FP8, None) if fp8 else _ValueComparison("float32", "float32",
                                                                                           (0.0, 0.0))
    largest, squares_error, squares = 0.0, 0.0, 0.0
    limit = min(reader.max_elements(tensor), stored_reader.max_elements(stored))
    scratch = memoryview(bytearray(2**16))
    for (offsets, values), (_, held) in zip(reader.slabs(tensor, limit), stored_reader.slabs(stored, limit)):
        floats = dtypes.to_float64(values, dtypes.dtype(tensor.dtype).name).astype(np.float32)
        if fp8:
            scales = transform.scales_for(stored_reader.checkpoint, offsets, values.shape, scratch)
            expected, most, error, total = quant.fp8_error(floats, held, scales)
        else:  # values: -0 and 0 are one (a release may keep a zero's sign or not)
            exponents = transform.exponents_for(stored_reader.checkpoint, offsets, values.shape, scratch)
            expected, most, error, total = quant.mxfp4_error(floats, held.view(np.float32), exponents)
            expected = expected.view(np.uint32)
        comparison.add(offsets, expected, held)
        largest, squares_error, squares = max(largest, most), squares_error + error, squares + total
        if progress:
            progress(values.nbytes)
    report.tensors += 1
    report.bytes += tensor.nbytes
    report.quantized[key] = (largest, math.sqrt(squares_error / squares) if squares else
                             (0.0 if squares_error == 0 else math.inf))
    if comparison.count:
        report.differences.append(comparison.difference(key, math.prod(tensor.shape)))


class _ValueComparison:
    """The running result of comparing one tensor's values, fed slab by slab."""

    def __init__(self, dtype_a: str, dtype_b: str, tolerances: tuple[float, float] | None):
        self.dtype_a, self.dtype_b = dtype_a, dtype_b  # equal unless both are floating point and tolerances are given
        self.tolerances = tolerances if dtype_a in TOLERANT else None
        self.count = 0
        self.first: tuple[list[int], str, str] | None = None
        self.max_abs = self.max_rel = 0.0

    def add(self, offsets: tuple[int, ...], values_a: np.ndarray, values_b: np.ndarray) -> None:
        flat_a, flat_b = values_a.reshape(-1), values_b.reshape(-1)
        for start in range(0, flat_a.size, BLOCK):
            block_a, block_b = flat_a[start:start + BLOCK], flat_b[start:start + BLOCK]
            if self.tolerances is None:
                if np.array_equal(block_a, block_b):
                    continue
                bad = np.flatnonzero(block_a != block_b)
            else:
                bad = self._outside_tolerance(block_a, block_b)
            if bad.size and self.first is None:
                index = np.unravel_index(start + int(bad[0]), values_a.shape)
                at = [int(o) + int(i) for o, i in zip(offsets, index)]
                element = slice(int(bad[0]), int(bad[0]) + 1)
                self.first = (at, _show(block_a[element], self.dtype_a), _show(block_b[element], self.dtype_b))
            self.count += int(bad.size)

    def _outside_tolerance(self, bits_a: np.ndarray, bits_b: np.ndarray) -> np.ndarray:
        atol, rtol = self.tolerances
        a, b = dtypes.to_float64(bits_a, self.dtype_a), dtypes.to_float64(bits_b, self.dtype_b)
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        with np.errstate(invalid="ignore", over="ignore"):
            diff = np.abs(a - b)
            diff[a == b] = 0.0  # equal infinities (inf - inf is NaN)
            diff[nan_a & nan_b] = 0.0
            diff[nan_a ^ nan_b] = np.inf
            magnitude = np.abs(a)
            with np.errstate(divide="ignore"):
                rel = diff / magnitude
            rel[diff == 0] = 0.0
            rel[np.isinf(diff)] = np.inf
            bad = np.flatnonzero((diff > atol + rtol * magnitude) | np.isinf(diff))
        if diff.size:
            self.max_abs = max(self.max_abs, float(diff.max()))
            self.max_rel = max(self.max_rel, float(rel.max()))
        return bad

    def difference(self, key: str, numel: int) -> Difference:
        at, shown_a, shown_b = self.first
        detail = f"{self.count:,} of {numel:,} elements differ, first at {at} (A {shown_a}, B {shown_b})"
        if self.tolerances is not None:
            detail += f"; max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"
        return Difference(key, "value", detail, first_index=at, count=self.count)


def _show(bits: np.ndarray, dtype: str) -> str:
    """One element (a one-element unsigned view) as its value, with the bits for floats; bits alone where numpy has no such type."""
    info = dtypes.dtype(dtype)
    raw = f"0x{int(bits[0]):0{2 * info.itemsize}x}"
    if info.numpy:
        value = bits.view(info.numpy)[0]
    elif dtype == "bfloat16":  # every bfloat16 value is a float32 value
        value = dtypes.cast(bits, dtype, "float32").view(np.float32)[0]
    else:
        return raw
    return f"{value!s} [{raw}]" if dtype in TOLERANT else str(value)


def _number(value: float) -> float | str:
    """JSON has no Infinity or NaN: those become strings."""
    return value if math.isfinite(value) else str(value)


def _compare_objects(a: Side, b: Side, report: Report) -> None:
    """Non-tensor entries, compared as leaves of plain data (see ``_leaves``)."""
    leaves_a, leaves_b = _leaves(a), _leaves(b)
    report.differences += [Difference(k, "missing", "non-tensor entry only in A") for k in leaves_a if k not in leaves_b]
    report.differences += [Difference(k, "extra", "non-tensor entry only in B") for k in leaves_b if k not in leaves_a]
    for key, value_a in leaves_a.items():
        if key not in leaves_b:
            continue
        value_b = leaves_b[key]
        if value_a is _OPAQUE or value_b is _OPAQUE:
            report.not_compared.append(key)
            continue
        report.objects += 1
        if value_a != value_b and not (_is_nan(value_a) and _is_nan(value_b)):
            report.differences.append(Difference(key, "object", f"A {value_a!r:.80}, B {value_b!r:.80}"))


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


_OPAQUE = object()  # a value that is not compared: outside the unpickler's allowlist, or not plain data


def _leaves(side: Side) -> dict[str, Any]:
    """A side's non-tensor entries split into leaves, so that one nesting compares equal however a format split it.

    DCP stores ``optim.param_groups.0.lr`` as an entry of its own, while a torch.save file keeps the list
    ``optim.param_groups`` whole; both become the leaf ``optim.param_groups.0.lr``.
    """
    leaves: dict[str, Any] = {}

    def expand(name: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                expand(f"{name}.{key}", item)
        elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
            for index, item in enumerate(value):
                expand(f"{name}.{index}", item)
        else:
            leaves[name] = value if plain_data(value) else _OPAQUE

    for name, entry in side.objects.items():
        try:
            expand(name, side.checkpoint.object_value(entry))
        except CheckpointError:  # e.g. a dataloader state of classes outside the allowlist: left unopened
            leaves[name] = _OPAQUE
    return leaves


def roundtrip(source: str | Path, via: str, *, source_format: str | None = None, include: str | None = None,
              exclude: str | None = None, max_memory: int = DEFAULT_MAX_MEMORY, **options) -> Report:
    """Convert ``source`` to format ``via`` and back to its own format in a temporary folder, then compare.

    Only what ``via`` holds is compared (``convert --to VIA`` and back: ``hf`` holds no non-tensor
    entries, ``fsdp1`` the model, its optimizer state, the scheduler and other entries of tensors or
    plain data); ``report.left_out`` lists the rest. The temporary folder is made under ``$TMPDIR``.
    ``options`` (tolerances, progress) go to ``compare_sides``.

    >>> roundtrip("step-1000", "torch").equal                              # doctest: +SKIP
    True
    """
    formats.get(via)  # an unknown format is refused before anything is read
    checkpoint = formats.open_checkpoint(source, source_format)
    there = conversion.plan_convert(checkpoint, via, _request(checkpoint, via, include, exclude))
    tensors, objects = there.tensors, there.objects
    with tempfile.TemporaryDirectory(prefix="dcptool-roundtrip-") as folder:
        middle_path = _output_path(Path(folder), "there", via)
        unheld = set(there.write(middle_path, max_memory=max_memory, fsync=False).left_out)
        objects = [obj for obj in objects if obj.key not in unheld]  # what the format cannot hold is not compared
        middle = formats.open_checkpoint(middle_path, via)
        back_path = _output_path(Path(folder), "back", checkpoint.format)
        conversion.plan_convert(middle, checkpoint.format, _request(checkpoint, checkpoint.format)).write(
            back_path, max_memory=max_memory, fsync=False)
        back = formats.open_checkpoint(back_path, checkpoint.format)
        # Non-tensor entries compare as the source has them (a format that restructures them must give them
        # back), under names that do not depend on where the model sits (an fsdp1 folder keeps no `dcp.`).
        carried = {id(entry) for obj in objects for entry in (obj.source, *obj.merged)}
        source_objects = normalized(checkpoint, roots_of(checkpoint))[1]
        expected = Side(checkpoint, {t.key: t.source for t in tensors},
                        {k: e for k, e in source_objects.items() if id(e) in carried}, f"{checkpoint.root} ({checkpoint.format})")
        result = Side(back, dict(back.tensors), normalized(back, roots_of(back))[1],
                      f"{checkpoint.format} -> {via} -> {checkpoint.format}")
        try:
            report = compare_sides(expected, result, max_memory=max_memory, **options)
        finally:
            middle.files.close()
            back.files.close()
    carried |= {id(t.source) for t in tensors}
    report.left_out = [k for k, e in [*checkpoint.tensors.items(), *checkpoint.objects.items()] if id(e) not in carried]
    report.roundtrip = via
    return report


def _request(checkpoint: Checkpoint, to: str, include: str | None = None,
             exclude: str | None = None) -> OutputRequest:
    """A round trip's output options: formats of per-rank files are written for the source's own world
    size where it records one, else for 2 ranks."""
    per_rank = formats.get(to).sharding is Sharding.DATA_PARALLEL
    return OutputRequest(include=include, exclude=exclude,
                         world_size=(checkpoint.info.get("world_size") or 2) if per_rank else None)


def _output_path(folder: Path, name: str, to: str) -> Path:
    return folder / name if formats.get(to).writes_folder else folder / f"{name}.pt"
