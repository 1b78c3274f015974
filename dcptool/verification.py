"""Compare two checkpoints of any formats and layouts: keys, dtypes, shapes and values, region by region.

Both sides read each tensor in the same row-major slabs through fixed buffers, so comparing two
100 GB checkpoints needs ``max_memory``, not 200 GB. Values compare bitwise on their raw bits (NaN
payloads included) unless tolerances are given; then floating-point tensors, also of different float
dtypes (a float32 checkpoint and its bfloat16 export), pass where ``|a - b| <= atol + rtol * |a|``
(NaN in both places counts as equal), and the largest absolute and relative difference of every
tensor is reported. A is the reference: "missing" means missing from B.

>>> side_a, side_b, note = sides("step-1000", "hf-out", prefix_a="dcp.model")   # doctest: +SKIP
>>> report = compare_sides(side_a, side_b)                                      # doctest: +SKIP
>>> report.equal, [d.key for d in report.differences]                           # doctest: +SKIP
(True, [])
>>> roundtrip("step-1000", "hf").left_out[:2]                            # doctest: +SKIP
['dcp.optim.state.model.norm.weight.exp_avg', 'dcp.optim.state.model.norm.weight.exp_avg_sq']
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from dcptool import adapters, conversion, dtypes, formats, models, selection, transfer
from dcptool.core import Checkpoint, ObjectInfo, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError, counted, option
from dcptool.format_interface import Layout, OutputRequest
from dcptool.sizes import check_memory_budget
from dcptool.state_dicts import split_object
from dcptool.torch_archive import Unpicklable

# Elements handled at once by comparisons and scans: bounds their temporaries (a few MB), beside the budget.
BLOCK = 1 << 16
# Tolerances apply to these; other dtypes (integers, bool, float8) always compare exactly.
TOLERANT = ("float64",) + dtypes.CASTABLE
AUTO = "auto"  # as a prefix: the model part, found as export-hf finds it


class RegionReader:
    """A tensor's global values as row-major slabs, read into halves of one reused ``buffer``.

    ``dcptool.transfer`` does the same for the pieces a writer asks for; this one reads a
    ``TensorInfo`` and says where each slab starts (comparisons report the first differing index).

    >>> reader = RegionReader(checkpoint, bytearray(2**20))                      # doctest: +SKIP
    >>> for offsets, values in reader.slabs(checkpoint.tensors["model.norm.weight"]): ...   # doctest: +SKIP
    """

    def __init__(self, checkpoint: Checkpoint, buffer: bytearray):
        half = len(buffer) // 2
        self.checkpoint = checkpoint
        self.slab_buffer = memoryview(buffer)[:half]
        self.read_buffer = memoryview(buffer)[half:]

    def max_elements(self, tensor: TensorInfo) -> int:
        return max(1, len(self.slab_buffer) // dtypes.dtype(tensor.dtype).itemsize)

    def slabs(self, tensor: TensorInfo, max_elements: int | None = None) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """``(offsets, values)`` in row-major order; ``values`` is an unsigned view, valid until the next slab."""
        for offsets, sizes in transfer.slabs(tensor.shape, max_elements or self.max_elements(tensor)):
            yield offsets, self.checkpoint.region_in(tensor, offsets, sizes, self.slab_buffer, self.read_buffer)


def buffer_size(max_memory: int, tensors, readers: int = 1) -> int:
    """Bytes for each of ``readers`` ``RegionReader``s sharing ``max_memory``: no more than the largest of
    ``tensors`` needs, since fresh memory costs time to touch."""
    check_memory_budget(max_memory)
    largest = max((t.nbytes for t in tensors), default=0)
    return min(max_memory // readers, max(2 * largest, 2**15))


@dataclass
class Side:
    """One checkpoint of a comparison: its tensors and objects under the names they are compared by."""

    checkpoint: Checkpoint
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    label: str


def select_side(checkpoint: Checkpoint, prefix: str | None = None, include: str | None = None,
                exclude: str | None = None) -> Side:
    """The entries of ``checkpoint`` to compare, named as the other side names them.

    ``prefix`` keeps only the keys under that wrapper, with it stripped (``"dcp.model"``), as
    ``export-hf --prefix`` does; ``"auto"`` takes the model part that export-hf finds by itself.
    ``include``/``exclude`` are regular expressions on the resulting names.

    >>> select_side(open_checkpoint("recover_checkpoint"), "dcp.model").tensors.keys()   # doctest: +SKIP
    dict_keys(['model.embed_tokens.weight', ...])
    """
    if prefix:
        by_hand = None if prefix == AUTO else prefix
        tensors = selection.model_part(checkpoint, by_hand)
        objects = selection.model_part(checkpoint, by_hand, entries=checkpoint.objects)
    else:
        tensors, objects = dict(checkpoint.tensors), dict(checkpoint.objects)
    _split_out_tensors(checkpoint, tensors, objects)
    label = f"{checkpoint.root} ({checkpoint.format}" + (f", prefix {prefix})" if prefix else ")")
    return Side(checkpoint, selection.select(tensors, include, exclude), selection.select(objects, include, exclude), label)


def _split_out_tensors(checkpoint: Checkpoint, tensors: dict[str, TensorInfo], objects: dict[str, ObjectInfo]) -> None:
    """Objects that hold tensors (a Trainer's RNG state) as their other parts and tensors of their own, as the
    torch writer stores them, so that a conversion compares entry for entry with its source."""

    for key, obj in list(objects.items()):
        try:
            parts, inside = split_object(checkpoint, obj, tuple(obj.path))
        except Unpicklable:  # a tensor that cannot be read on its own: the object is compared whole
            continue
        if inside:
            def renamed(path: tuple, key=key, depth=len(obj.path)) -> str:  # the side's name (a prefix stripped)
                return join_path((key, *path[depth:]))

            del objects[key]
            objects.update({renamed(path): ObjectInfo(path, value=value) for path, value in parts.items()})
            tensors.update({renamed(tensor.path): tensor for tensor in inside})


def align_families(a: Side, b: Side, family_a: str = "auto", family_b: str = "auto",
                   include: str | None = None, exclude: str | None = None) -> tuple[Side, Side, str | None]:
    """Sides whose model weights use different naming families (an Archon checkpoint and its HF
    export): both reduced to their model parts, B's mapped to A's names (``dcptool.adapters``), and a
    line saying so. Sides of one family come back as they are, with no line."""
    params_a, params_b = selection.model_part(a.checkpoint), selection.model_part(b.checkpoint)
    found_a = adapters.detect_family(params_a) if family_a == AUTO else family_a
    found_b = adapters.detect_family(params_b) if family_b == AUTO else family_b
    if found_a is None or found_b is None or found_a == found_b:
        return a, b, None
    config_dir = b.checkpoint.info.get("hf_config_dir") or a.checkpoint.info.get("hf_config_dir")
    config = selection.read_config(config_dir) if config_dir is not None else None
    mapping, _ = adapters.mapping_for(params_b, found_a, found_b, config)
    result = mapping.convert(params_b)
    adapters.refuse_unmatched(result.unmatched, mapping, f"check {option('adapter_a')} / {option('adapter_b')}")
    mapped = {name: entry for name, (entry, _) in result.entries.items()}
    # A's tensors that B's family has no place for (Qwen3-MoE's expert_bias in HF names) cannot be in B.
    no_place = adapters.Mapping(mapping.kind, found_a, found_b, config).untranslatable(params_a)
    if found_a == "hf":
        no_place += models.tied_outputs(config)
    params_a = {k: v for k, v in params_a.items() if k not in no_place}
    side_a = Side(a.checkpoint, selection.select(params_a, include, exclude), {}, f"{a.label}, model weights")
    side_b = Side(b.checkpoint, selection.select(mapped, include, exclude), {}, f"{b.label}, model weights as {found_a}")
    note = f"comparing model weights across families: B's {found_b} names ({mapping.kind}) as {found_a}"
    if no_place:
        note += f"; not compared, {found_b} names have no place for them: {', '.join(no_place[:4])}" + \
            (f" and {len(no_place) - 4} more" if len(no_place) > 4 else "")
    return side_a, side_b, note


@dataclass
class Difference:
    """One way the two sides differ at one key."""

    key: str
    kind: str  # "missing" (from B), "extra" (in B only), "dtype", "shape", "value", "object"
    detail: str
    first_index: list[int] | None = None  # kind "value": the first differing element (global, row-major)
    count: int | None = None  # kind "value": how many elements differ


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
    not_compared: list[str] = field(default_factory=list)  # non-tensor entries that are not plain data
    left_out: list[str] = field(default_factory=list)  # --roundtrip: what the intermediate format cannot hold
    roundtrip: str | None = None
    note: str | None = None  # how the sides were matched, when not key for key (across naming families)

    @property
    def equal(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        mode = "bitwise" if self.tolerances is None else "within atol {:g}, rtol {:g}".format(*self.tolerances)
        what = (f"{counted(self.tensors, 'tensor')} ({self.bytes:,} bytes) compared {mode}, "
                f"{counted(self.objects, 'non-tensor entry', 'non-tensor entries')}")
        if self.equal:
            return f"equal: {what}"
        kinds: dict[str, int] = {}
        for difference in self.differences:
            kinds[difference.kind] = kinds.get(difference.kind, 0) + 1
        return f"{counted(len(self.differences), 'difference')} ({', '.join(f'{n} {k}' for k, n in kinds.items())}): {what}"

    def to_json(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "a": self.a, "b": self.b, "roundtrip": self.roundtrip, "equal": self.equal,
            "mode": "bitwise" if self.tolerances is None else "tolerance",
            "tensors_compared": self.tensors, "bytes_compared": self.bytes, "objects_compared": self.objects,
            "differences": [{k: v for k, v in vars(d).items() if v is not None} for d in self.differences],
            "objects_not_compared": self.not_compared, "left_out": self.left_out,
        }
        if self.tolerances is not None:
            report["atol"], report["rtol"] = self.tolerances
            report["tensors"] = {k: {"max_abs": _number(a), "max_rel": _number(r)} for k, (a, r) in self.closeness.items()}
        return report


def check_arguments(b: str | Path | None, roundtrip: str | None, load_on: str | dict | None,
                    prefix_a: str | None = None, prefix_b: str | None = None, from_b: str | None = None) -> None:
    """Refuse what ``dcptool verify`` cannot do together: A against B, A's round trip, or A's load on a mesh."""
    if load_on:
        if b is not None or roundtrip:
            raise UsageError(f"{option('load_on')} checks A alone: give no B or {option('roundtrip')}")
    elif roundtrip:
        if b is not None or prefix_a or prefix_b or from_b:
            raise UsageError(f"{option('roundtrip')} compares A with its own round trip: give no B, {option('prefix_a')}, "
                             f"{option('prefix_b')} or {option('from_b')}")
    elif b is None:
        raise UsageError(f"give the checkpoint B to compare A with, or {option('roundtrip')}")


def sides(a: str | Path, b: str | Path, *, format_a: str | None = None, format_b: str | None = None,
          prefix_a: str | None = None, prefix_b: str | None = None, include: str | None = None,
          exclude: str | None = None, family_a: str = AUTO, family_b: str = AUTO) -> tuple[Side, Side, str | None]:
    """The two sides of ``dcptool verify A B``, named alike (``align_families``), and the line saying how."""
    checkpoint_a, checkpoint_b = formats.open_checkpoint(a, format_a), formats.open_checkpoint(b, format_b)

    def aligned(prefix_a, prefix_b):
        side_a = select_side(checkpoint_a, prefix_a, include, exclude)
        side_b = select_side(checkpoint_b, prefix_b, include, exclude)
        return align_families(side_a, side_b, family_a, family_b, include, exclude)

    side_a, side_b, note = aligned(prefix_a, prefix_b)
    if prefix_a or prefix_b or side_a.tensors.keys() & side_b.tensors.keys():
        return side_a, side_b, note
    # No tensor name on both sides as given: one side nests the model (a checkpoint against its export).
    for auto_a, auto_b, name in ((AUTO, None, "prefix_a"), (None, AUTO, "prefix_b")):
        side_a, side_b, note = aligned(auto_a, auto_b)
        if side_a.tensors.keys() & side_b.tensors.keys():
            said = f"no tensor name is on both sides as given: comparing the model part ({option(name, AUTO)})"
            return side_a, side_b, said + (f"; {note}" if note else "")
    return aligned(prefix_a, prefix_b)


def compare_sides(a: Side, b: Side, *, atol: float | None = None, rtol: float | None = None,
                  max_memory: int = transfer.DEFAULT_MAX_MEMORY,
                  progress: Callable[[int], None] | None = None) -> Report:
    """Compare two sides key by key; half of ``max_memory`` buffers each side's reads.

    Without ``atol``/``rtol`` values must be bitwise equal; with either, floating-point tensors
    may differ within the tolerances and their largest differences are reported.
    """
    tolerances = None if atol is None and rtol is None else (float(atol or 0.0), float(rtol or 0.0))
    report = Report(a.label, b.label, tolerances)
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
        castable = tolerances is not None and dtype_a in TOLERANT and dtype_b in TOLERANT
        if dtype_a != dtype_b and not castable:
            hint = f" ({option('atol')}/{option('rtol')} compare the values)" if dtype_a in TOLERANT and dtype_b in TOLERANT else ""
            report.differences.append(Difference(key, "dtype", f"A {dtype_a}, B {dtype_b}{hint}"))
        elif tensor_a.shape != tensor_b.shape:
            report.differences.append(Difference(key, "shape", f"A {list(tensor_a.shape)}, B {list(tensor_b.shape)}"))
        else:
            comparison = _ValueComparison(dtype_a, dtype_b, tolerances)
            limit = min(reader_a.max_elements(tensor_a), reader_b.max_elements(tensor_b))
            for (offsets, values_a), (_, values_b) in zip(reader_a.slabs(tensor_a, limit), reader_b.slabs(tensor_b, limit)):
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
        a, b = _to_float64(bits_a, self.dtype_a), _to_float64(bits_b, self.dtype_b)
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


def _to_float64(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float64":
        return bits.view(np.float64)
    return dtypes.cast(bits, dtype, "float32").view(np.float32).astype(np.float64)


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
            leaves[name] = value if _plain(value) else _OPAQUE

    for name, entry in side.objects.items():
        try:
            expand(name, side.checkpoint.object_value(entry))
        except CheckpointError:  # e.g. a dataloader state of classes outside the allowlist: left unopened
            leaves[name] = _OPAQUE
    return leaves


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def roundtrip(source: str | Path, via: str, *, source_format: str | None = None, include: str | None = None,
              exclude: str | None = None, max_memory: int = transfer.DEFAULT_MAX_MEMORY, **options) -> Report:
    """Convert ``source`` to format ``via`` and back to its own format in a temporary folder, then compare.

    Only what ``via`` holds is compared (``convert --to VIA`` and back: ``hf`` holds no non-tensor
    entries, ``fsdp1`` the model and its optimizer state); ``report.left_out`` lists the rest. The
    temporary folder is made under ``$TMPDIR``. ``options`` (tolerances, progress) go to ``compare_sides``.

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
        expected = Side(checkpoint, {t.key: t.source for t in tensors}, {o.key: o.source for o in objects},
                        f"{checkpoint.root} ({checkpoint.format})")
        result = Side(back, dict(back.tensors), dict(back.objects), f"{checkpoint.format} -> {via} -> {checkpoint.format}")
        try:
            report = compare_sides(expected, result, max_memory=max_memory, **options)
        finally:
            middle.files.close()
            back.files.close()
    carried = {t.source.key for t in tensors} | {o.source.key for o in objects}
    report.left_out = [k for k in [*checkpoint.tensors, *checkpoint.objects] if k not in carried]
    report.roundtrip = via
    return report


def _request(checkpoint: Checkpoint, to: str, include: str | None = None,
             exclude: str | None = None) -> OutputRequest:
    """A round trip's output options: formats of per-rank files are written for the source's own world
    size where it records one, else for 2 ranks."""
    per_rank = formats.get(to).layout is Layout.DATA_PARALLEL
    return OutputRequest(include=include, exclude=exclude,
                         world_size=(checkpoint.info.get("world_size") or 2) if per_rank else None)


def _output_path(folder: Path, name: str, to: str) -> Path:
    return folder / name if formats.get(to).writes_folder else folder / f"{name}.pt"
