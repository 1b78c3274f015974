"""Compare two checkpoints of any formats and layouts: keys, dtypes, shapes and values, region by region.

Both sides read each tensor in the same row-major slabs through fixed buffers, so comparing two
100 GB checkpoints needs ``max_memory``, not 200 GB. Values compare bitwise on their raw bits (NaN
payloads included) unless tolerances are given; then floating-point tensors, also of different float
dtypes (a float32 checkpoint and its bfloat16 export), pass where ``|a - b| <= atol + rtol * |a|``
(NaN in both places counts as equal), and the largest absolute and relative difference of every
tensor is reported. A is the reference: "missing" means missing from B.

A training state against a model-only checkpoint (its HF export) compares the model parts, the rest
left out; two checkpoints that keep their model at different places (``model.``, the top level) compare
entry for entry and report the layout difference (``sides``).

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
from typing import Any, Callable, Iterator

import numpy as np

from dcptool import conversion, dtypes, families, formats, models, selection, transfer
from dcptool.core import Checkpoint, ObjectInfo, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError, counted, option, printable
from dcptool.format_interface import Layout, OutputRequest
from dcptool.sizes import DEFAULT_MAX_MEMORY, check_memory_budget
from dcptool.state_dicts import plain_data, split_object
from dcptool.torch_archive import Unpicklable
from dcptool.torch_archive.records import record_checks

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
            # Records' CRC-32s are taken from the bytes as they are read (``passing``), not by reading them again.
            yield offsets, self.checkpoint.region_in(tensor, offsets, sizes, self.slab_buffer, self.read_buffer,
                                                     passing=True)
        checks = record_checks(self.checkpoint.files)
        if checks is not None:
            checks.finish(tensor.key)  # the tensor's records the slabs read only in part


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
                   include: str | None = None, exclude: str | None = None,
                   config_dir: str | Path | None = None) -> tuple[Side, Side, str | None]:
    """Sides whose model weights use different naming families (an Archon checkpoint and its HF
    export): both reduced to their model parts, B's mapped to A's names (``dcptool.families``, with the
    config.json of ``config_dir``, else of the folder either reader found), and a line saying so. Sides
    of one family come back as they are, with no line."""
    params_a, params_b = selection.model_part(a.checkpoint), selection.model_part(b.checkpoint)
    found_a = families.detect(params_a) if family_a == AUTO else families.get(family_a)
    found_b = families.detect(params_b) if family_b == AUTO else families.get(family_b)
    if found_a is None or found_b is None or found_a is found_b:
        return a, b, None
    if found_a.more_than_others:  # A's tensors hold more than B's: map A onto B's names instead
        if not any(tensor.chunks for tensor in params_a.values()):  # a manifest's description, no bytes
            raise UsageError(f"{a.checkpoint.root}: a manifest in {found_a.name} names cannot check {found_b.name} "
                             f"names ({found_a.more_than_others}): write the manifest of {b.checkpoint.root} "
                             f"(checksum with {option('write', True)}) and check the {found_a.name} checkpoint against it")
        side_b, side_a, note = _mapped_onto(b, a, found_b, found_a, "A", include, exclude, config_dir)
        return side_a, side_b, note
    return _mapped_onto(a, b, found_a, found_b, "B", include, exclude, config_dir)


def _mapped_onto(kept: Side, mapped: Side, kept_family, mapped_family, label: str, include: str | None,
                 exclude: str | None, config_dir: str | Path | None) -> tuple[Side, Side, str]:
    """Both sides' model parts, ``mapped``'s (side ``label``, A or B) renamed to ``kept``'s family; a line saying so."""
    params_kept, params_mapped = selection.model_part(kept.checkpoint), selection.model_part(mapped.checkpoint)
    config_dir = config_dir or mapped.checkpoint.info.get("hf_config_dir") or kept.checkpoint.info.get("hf_config_dir")
    renamed = families.rename(params_mapped, kept_family.name, source=mapped_family.name,
                              config=selection.read_config(config_dir) if config_dir is not None else None,
                              run=mapped.checkpoint.info, where=str(mapped.checkpoint.root),
                              hint=f"check {option('family_a')} / {option('family_b')}", compare_with=params_kept)
    kind = renamed.mapping.kind
    # Weights of the kept side that the mapped side's family has no place for (Qwen3-MoE's expert_bias in HF
    # names) cannot be in it; nor can a tied output where the kept side's family may leave it out.
    no_place = families.untranslatable(params_kept, kind, kept_family, mapped_family, renamed.config)
    if kept_family.may_omit_tied_output:
        no_place += models.tied_outputs(renamed.config, kept_family.name)
    params_kept = {k: v for k, v in params_kept.items() if k not in no_place}
    side_kept = Side(kept.checkpoint, selection.select(params_kept, include, exclude), {}, f"{kept.label}, model weights")
    side_mapped = Side(mapped.checkpoint, selection.select(renamed.entries, include, exclude), {},
                       f"{mapped.label}, model weights as {kept_family.name}")
    note = f"comparing model weights across families: {label}'s {mapped_family.name} names ({kind}) as {kept_family.name}"
    if no_place:
        note += f"; not compared, {mapped_family.name} names have no place for them: {', '.join(no_place[:4])}" + \
            (f" and {len(no_place) - 4} more" if len(no_place) > 4 else "")
    return side_kept, side_mapped, note


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


@dataclass
class KeyLayout:
    """Where a checkpoint keeps its model part and its optimizer state: the path parts above each
    (``("dcp", "model")``, ``()`` for the top level), and whether it holds anything beside the model."""

    model: tuple[str, ...]
    optimizer: tuple[str, ...] | None
    model_only: bool

    def describe(self, parts: str = "model optimizer") -> str:
        def at(path):
            return f"`{join_path(path)}.`" if path else "top level"

        said = [f"model at {at(self.model)}"] if "model" in parts else []
        if "optimizer" in parts and self.optimizer is not None:
            said.append(f"optimizer at {at(self.optimizer)}")
        return " and ".join(said)


_TRAINING_ROOTS = selection.OPTIMIZER_ROOTS | selection.NON_MODEL_ROOTS


def layout_of(checkpoint: Checkpoint) -> KeyLayout:
    """``checkpoint``'s layout (``selection.model_part`` finds the model part)."""
    # A flat torch.save of a whole training state ({"dcp.optim.state.w.exp_avg": ...}) is no model only.
    training_keys = any(_TRAINING_ROOTS & set(key.split(".")) for key in checkpoint.tensors)
    return KeyLayout(selection.model_wrapper(checkpoint) or (), selection.optimizer_root(checkpoint),
                     not _outside_model(checkpoint) and not training_keys)


def _layout_difference(a: KeyLayout, b: KeyLayout) -> str | None:
    """"A has model at `model.`, B at top level": the parts of two layouts that differ, or None."""
    parts = " ".join(p for p, differs in (("model", a.model != b.model), ("optimizer", a.optimizer != b.optimizer))
                     if differs and (p == "model" or None not in (a.optimizer, b.optimizer)))
    if not parts:
        return None
    said_b = b.describe(parts).removeprefix("model ") if parts == "model" else f"has {b.describe(parts)}"
    return f"A has {a.describe(parts)}, B {said_b}"  # "A has model at `model.`, B at top level"


def _normalized(checkpoint: Checkpoint, layout: KeyLayout) -> tuple[dict[str, TensorInfo], dict[str, ObjectInfo]]:
    """Every entry under the name it would have in a torchtitan layout: model weights at the top level, the
    optimizer under ``optimizer.``, the rest as it is (less a wrapper shared with the model, AReaL's ``dcp.``);
    two training checkpoints of different layouts compare entry for entry under these names."""
    tensors = selection.model_part(checkpoint)
    objects = selection.model_part(checkpoint, entries=checkpoint.objects)
    model = {id(e) for e in [*tensors.values(), *objects.values()]}
    parent = layout.model[:-1]
    for entries, named in ((checkpoint.tensors, tensors), (checkpoint.objects, objects)):
        for entry in entries.values():
            if id(entry) in model:
                continue
            path = entry.path[len(parent):] if entry.path[:len(parent)] == parent else entry.path
            if layout.optimizer is not None and tuple(entry.path[:len(layout.optimizer)]) == layout.optimizer:
                path = ("optimizer", *entry.path[len(layout.optimizer):])
            named[join_path(path)] = entry
    return tensors, objects


@dataclass
class Pairing:
    """The two sides of ``dcptool verify A B``, named alike, and what the comparison should say of how:
    ``note`` (how the names were matched), ``left_out`` (entries of a training state that a model-only
    side cannot hold) and ``layout`` (how two layouts differ, when they do)."""

    a: Side
    b: Side
    note: str | None = None
    left_out: list[str] = field(default_factory=list)
    left_out_why: str | None = None
    layout: str | None = None


def sides(a: str | Path, b: str | Path, *, format_a: str | None = None, format_b: str | None = None,
          prefix_a: str | None = None, prefix_b: str | None = None, include: str | None = None,
          exclude: str | None = None, family_a: str = AUTO, family_b: str = AUTO,
          config_dir: str | Path | None = None) -> Pairing:
    """The two sides of ``dcptool verify A B``, named alike.

    With no prefix given, the layouts decide: a training state against a model-only checkpoint (its
    HF export) compares the model parts and lists the rest as left out (in one format, two DCP
    checkpoints, a model at another place is a layout difference too); two training states (or two
    models) nested differently compare entry for entry under ``_normalized`` names, and the layout
    difference is reported (not between two models in different formats: an export), where those
    names match more entries than the keys as given (a flat
    torch.save of the state, ``{"dcp.model.w": ...}``, has no nesting to tell: its keys are compared).
    Weights of different naming families are matched by ``align_families`` (with ``config_dir``'s config.json).
    """
    return pair(formats.open_checkpoint(a, format_a), formats.open_checkpoint(b, format_b), prefix_a=prefix_a,
                prefix_b=prefix_b, include=include, exclude=exclude, family_a=family_a, family_b=family_b,
                config_dir=config_dir)


def pair(checkpoint_a: Checkpoint, checkpoint_b: Checkpoint, *, prefix_a: str | None = None,
         prefix_b: str | None = None, include: str | None = None, exclude: str | None = None,
         family_a: str = AUTO, family_b: str = AUTO, config_dir: str | Path | None = None) -> Pairing:
    """``sides`` of two open checkpoints (``average`` pairs every source with the first this way, with the
    config.json of ``config_dir`` where names are mapped across families)."""
    pairing = Pairing(select_side(checkpoint_a, prefix_a, include, exclude),
                      select_side(checkpoint_b, prefix_b, include, exclude))
    if not (prefix_a or prefix_b):
        layout_a, layout_b = layout_of(checkpoint_a), layout_of(checkpoint_b)
        if layout_a.model_only != layout_b.model_only:  # a training state against its export: its model part
            training_a = layout_b.model_only
            pairing.a = select_side(checkpoint_a, AUTO if training_a else None, include, exclude)
            pairing.b = select_side(checkpoint_b, None if training_a else AUTO, include, exclude)
            pairing.left_out = _outside_model(checkpoint_a if training_a else checkpoint_b)
            pairing.left_out_why = f"{'B' if training_a else 'A'} holds a model only"
            if checkpoint_a.format == checkpoint_b.format:  # not an export: a job loads both, the model where it sits
                pairing.layout = _layout_difference(layout_a, layout_b)
        elif layout_a != layout_b:
            normalized_a = _side(checkpoint_a, *_normalized(checkpoint_a, layout_a), include, exclude)
            normalized_b = _side(checkpoint_b, *_normalized(checkpoint_b, layout_b), include, exclude)
            if _shared(normalized_a, normalized_b) > _shared(pairing.a, pairing.b):
                pairing.a, pairing.b = normalized_a, normalized_b
                exported = layout_a.model_only and checkpoint_a.format != checkpoint_b.format  # {"model": ...} vs HF
                pairing.layout = None if exported else _layout_difference(layout_a, layout_b)
    else:
        pairing.left_out = [*(_outside_model(checkpoint_a, prefix_a) if prefix_a else []),
                            *(_outside_model(checkpoint_b, prefix_b) if prefix_b else [])]
        pairing.left_out_why = "outside the prefixes given" if pairing.left_out else None
    pairing.a, pairing.b, pairing.note = align_families(pairing.a, pairing.b, family_a, family_b, include, exclude,
                                                        config_dir)
    if pairing.note and not pairing.left_out:  # across families only the model weights are compared
        pairing.left_out = [*_outside_model(checkpoint_a), *_outside_model(checkpoint_b)]
        pairing.left_out_why = "across naming families only the model weights compare"
    return pairing


def _shared(a: Side, b: Side) -> int:
    """How many names are on both sides."""
    return len(a.tensors.keys() & b.tensors.keys()) + len(a.objects.keys() & b.objects.keys())


def _side(checkpoint: Checkpoint, tensors: dict, objects: dict, include: str | None, exclude: str | None) -> Side:
    """A side of these entries under these names, as ``select_side`` makes one."""
    _split_out_tensors(checkpoint, tensors, objects)
    return Side(checkpoint, selection.select(tensors, include, exclude), selection.select(objects, include, exclude),
                f"{checkpoint.root} ({checkpoint.format})")


def _outside_model(checkpoint: Checkpoint, prefix: str | None = None) -> list[str]:
    """The keys of ``checkpoint`` outside its model part (or outside ``prefix``)."""
    by_hand = None if prefix in (None, AUTO) else prefix
    inside = {id(e) for e in [*selection.model_part(checkpoint, by_hand).values(),
                              *selection.model_part(checkpoint, by_hand, entries=checkpoint.objects).values()]}
    return [k for k, e in [*checkpoint.tensors.items(), *checkpoint.objects.items()] if id(e) not in inside]


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
        if dtype_a != dtype_b and not castable and not cast:
            cast_to = None
            if {dtype_a, dtype_b} <= set(dtypes.CASTABLE):  # cast the wider to the narrower: exact where they agree
                cast_to = "a" if dtypes.dtype(dtype_a).itemsize < dtypes.dtype(dtype_b).itemsize else "b"
            by_tolerance = f"{option('atol')}/{option('rtol')}"
            hint = f" ({option('dtype_as', cast_to.upper())} or {by_tolerance} compare the values)" if cast_to else \
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
        source_objects = _normalized(checkpoint, layout_of(checkpoint))[1]
        expected = Side(checkpoint, {t.key: t.source for t in tensors},
                        {k: e for k, e in source_objects.items() if id(e) in carried}, f"{checkpoint.root} ({checkpoint.format})")
        result = Side(back, dict(back.tensors), _normalized(back, layout_of(back))[1],
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
    per_rank = formats.get(to).layout is Layout.DATA_PARALLEL
    return OutputRequest(include=include, exclude=exclude,
                         world_size=(checkpoint.info.get("world_size") or 2) if per_rank else None)


def _output_path(folder: Path, name: str, to: str) -> Path:
    return folder / name if formats.get(to).writes_folder else folder / f"{name}.pt"
