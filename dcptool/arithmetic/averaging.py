"""``dcptool average``: the weighted mean of checkpoints of one model, in any formats, families and meshes.

Every source is paired with the first as ``verify`` pairs two checkpoints (``pairing.pair``: layouts,
naming families, model parts), so each output tensor knows its region in every source. A floating-point
tensor of the output is computed (``core.Computed``), region by region as a copy asks for it: the sources'
values in float32, ``w0*x0 + w1*x1 + ...`` summed in float32 in the order of the sources (each product and
sum rounded to float32, as torch computes it on float32 tensors), then rounded to the first source's dtype as
torch's ``.to(dtype)`` rounds. Integer, boolean and float8 tensors are no means: they must be equal in
every source (``check_equal``) and are copied from the first. Optimizer state is left out unless asked for;
its step counters (``step``, a float32 tensor in torch's Adam and AdamW) are counts, not means: taken from the
first, as its other counters are.

The output is the first source's format, laid out as the first source's chunks (a DCP checkpoint keeps its
ranks' chunks), unless a format or a mesh is given (``plan_average``).

>>> planned = plan_average(["step-800", "step-900", "step-1000"], [1, 1, 1])          # doctest: +SKIP
>>> planned.weights                                                                    # doctest: +SKIP
[0.3333333333333333, 0.3333333333333333, 0.3333333333333333]
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from dcptool import dtypes, formats, selection
from dcptool.engine import regions
from dcptool.planning import resharding
from dcptool.planning.conversion import Conversion, kept_config, plan_convert
from dcptool.engine.core import Checkpoint, Computed, TensorInfo, float32_region
from dcptool.engine.reading import workspace
from dcptool.errors import UsageError, counted, option
from dcptool.format_interface import Sharding, OutputRequest
from dcptool.options import MeshOptions
from dcptool.checks.pairing import pair

# Tensors of these dtypes are averaged; any other must be equal in every source.
AVERAGED = ("float64", *dtypes.CASTABLE)
# The last part of the key of torch.optim's per-parameter step count (optimizer.state.<param>.step): from the first.
STEP_COUNTER = "step"


@dataclass(frozen=True, eq=False)
class WeightedMean(Computed):
    """A region of the mean: ``sum(w_i * x_i)`` in float32 over ``terms`` (``(checkpoint, tensor, weight)``, the
    first term the output's own source), rounded to ``dtype``."""

    terms: tuple[tuple[Checkpoint, TensorInfo, float], ...]
    dtype: str
    work_bytes = 16  # per element: the float32 sum, a term's float32 values and its bits (``workspace``s), rounding

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        total, values = workspace("mean", sizes, np.float32), workspace("mean.term", sizes, np.float32)
        for number, (source, tensor, weight) in enumerate(self.terms):
            term = float32_region(source, tensor, offsets, sizes, scratch, total if number == 0 else values)
            term *= np.float32(weight)  # w0*x0 first, not 0 + w0*x0, which would turn -0.0 into 0.0
            if number:
                total += term
        dtypes.from_float32(total, self.dtype, out, values.view(np.uint32))

    def others(self) -> tuple[Checkpoint, ...]:
        return tuple(source for source, _, _ in self.terms[1:])


def parse_weights(weights, count: int) -> list[float]:
    """``weights`` (a list, or text ``"0.5,0.3,0.2"``; None: equal) as ``count`` floats that sum to 1.

    Weights that do not sum to 1 are divided by their sum (``--weights 1,1,2`` is ``0.25,0.25,0.5``); they
    must be finite, none negative, their sum positive.

    >>> parse_weights("1,1,2", 3)
    [0.25, 0.25, 0.5]
    """
    if weights is None:
        return [1.0 / count] * count
    given = weights.split(",") if isinstance(weights, str) else list(weights)
    try:
        numbers = [float(w) for w in given]
    except (TypeError, ValueError):
        raise UsageError(f"{option('weights', weights)}: give {count} numbers separated by commas") from None
    if len(numbers) != count:
        raise UsageError(f"{option('weights', weights)}: {counted(len(numbers), 'weight')} for "
                         f"{counted(count, 'checkpoint')}: give one weight per checkpoint")
    if not all(math.isfinite(w) and w >= 0 for w in numbers) or sum(numbers) <= 0:
        raise UsageError(f"{option('weights', weights)}: weights must be finite, not negative, and not all zero")
    total = math.fsum(numbers)
    return [w / total for w in numbers]


@dataclass
class Planned:
    """An average planned: the write (``conversion``, or ``reshard`` for a mesh), the weights as used, the
    tensors that must be equal in every source, and the sources (closed by the caller)."""

    sources: list[Checkpoint]
    weights: list[float]
    conversion: Conversion | None = None
    reshard: resharding.ReshardPlan | None = None
    equal: list[tuple[str, list[tuple[Checkpoint, TensorInfo]]]] = field(default_factory=list)
    averaged: int = 0


def plan_average(checkpoints: list[Checkpoint], weights, *, to: str | None = None, mesh: MeshOptions | None = None,
                 config_dir=None, include_optimizer: bool = False) -> Planned:
    """What ``dcptool average`` writes: the first checkpoint's entries, each floating-point tensor the mean of
    its pairs in all (``WeightedMean``), laid out as the first is, or as format ``to`` and ``mesh`` lay it out
    (with ``config_dir`` as reshard takes them; None: the first's own chunks). ``config_dir``'s config.json also
    maps names across naming families."""
    if len(checkpoints) < 2:
        raise UsageError("give at least two checkpoints to average, then the output")
    first = checkpoints[0]
    planned = Planned(checkpoints, parse_weights(weights, len(checkpoints)))
    pairs, pairing_notes = [], []
    for other in checkpoints[1:]:
        pairing = pair(first, other, config_dir=config_dir)
        pairs.append({id(tensor): pairing.b.tensors[name] for name, tensor in pairing.a.tensors.items()
                      if name in pairing.b.tensors})
        if pairing.note:  # names matched across families
            pairing_notes.append(f"{other.root}: {pairing.note}")
    model = {id(t) for t in selection.model_part(first).values()}
    tensors, notes, optimizer_left, others_left, counters = {}, [], [], [], []
    for key, tensor in first.tensors.items():
        optimizer = bool(selection.OPTIMIZER_ROOTS & {str(part) for part in tensor.path})
        if optimizer and not include_optimizer:
            optimizer_left.append(key)
            continue
        found = [paired.get(id(tensor)) for paired in pairs]
        missing = next((c for c, other in zip(checkpoints[1:], found) if other is None), None)
        if missing is not None:
            if id(tensor) in model or optimizer:
                what = "optimizer tensor" if optimizer else "model weight"
                hint = f" (leave out {option('include_optimizer', True)})" if optimizer else ""
                raise UsageError(f"{missing.root}: has no {what} {key} of {first.root}: the checkpoints are not "
                                 f"of one model{hint}")
            others_left.append(key)
            continue
        terms = [(first, tensor), *zip(checkpoints[1:], found)]
        for source, other in terms[1:]:
            if other.shape != tensor.shape:
                raise UsageError(f"{source.root}: {key} is {list(other.shape)}, {list(tensor.shape)} in {first.root}: "
                                 "the checkpoints are not of one model")
        if optimizer and key.rpartition(".")[2] == STEP_COUNTER:
            tensors[key] = tensor
            counters.append(key)
        elif all(t.dtype in AVERAGED for _, t in terms):
            mean = WeightedMean(tuple((c, t, w) for (c, t), w in zip(terms, planned.weights)), tensor.dtype)
            tensors[key] = dataclasses.replace(tensor, transform=mean)
            planned.averaged += 1
        else:
            planned.equal.append((key, terms))
            tensors[key] = tensor
    objects = {key: entry for key, entry in first.objects.items()
               if include_optimizer or not selection.OPTIMIZER_ROOTS & {str(part) for part in entry.path}}
    if optimizer_left:
        notes.append(f"left out {counted(len(optimizer_left), 'optimizer tensor')} and the optimizer's other entries: "
                     f"an average of weights; {option('include_optimizer', True)} averages the optimizer state too")
    if others_left:
        notes.append(f"left out {counted(len(others_left), 'tensor')} not in every checkpoint: "
                     f"{', '.join(others_left[:3])}" + (" ..." if len(others_left) > 3 else ""))
    if counters:
        notes.append(f"took {counted(len(counters), 'optimizer step counter')} from {first.root} as they are "
                     "(counts, not means)")
    if objects:
        notes.append(f"took {counted(len(objects), 'non-tensor entry', 'non-tensor entries')} from {first.root} "
                     "as they are (step counters, schedulers)")
    described = ", ".join(f"{w:.6g}" for w in planned.weights)
    notes.insert(0, f"averaged {counted(planned.averaged, 'tensor')} of {counted(len(checkpoints), 'checkpoint')} "
                    f"with weights {described} (float32 sums, rounded to each tensor's dtype); "
                    f"{counted(len(planned.equal), 'tensor')} of other dtypes equal in all, copied")
    notes += pairing_notes
    source = dataclasses.replace(first, tensors=tensors, objects=objects)
    _plan_output(planned, source, to, mesh, config_dir, notes)
    return planned


def _plan_output(planned: Planned, source: Checkpoint, to: str | None, mesh: MeshOptions | None, config_dir,
                 notes: list[str]) -> None:
    """The write of the average: as ``to`` and a mesh lay it out, else as the first source is laid out."""
    fmt = formats.get(to or source.format)
    if not fmt.writable:
        raise UsageError(f"{source.root}: the average is written as the first checkpoint's format, {fmt.name}, which "
                         f"dcptool does not write: choose one with {option('to')}")
    if mesh is not None:
        planned.reshard = resharding.plan_for(source, mesh, to=fmt.name, config_dir=config_dir)
        planned.reshard.conversion.notes[:0] = notes
        planned.conversion = planned.reshard.conversion
        return
    world_size = source.info.get("world_size")
    if fmt.name == source.format and fmt.sharding is Sharding.MESH and world_size:
        # the first source's own chunks, each in the file of the rank that saved it
        output = fmt.plan_output(source, OutputRequest())
        layout = OutputRequest(layout=lambda out: [(c.offsets, c.sizes, c.rank or 0) for c in out.source.chunks],
                               world_size=world_size)
        planned.conversion = Conversion(source, fmt.name, output.tensors, output.objects, fmt.writer_options(layout),
                                        [*notes, *output.notes], output.why_left_out, output.reasons)
        planned.conversion.keep_config(kept_config(source, config_dir))
        return
    per_rank = (world_size or 1) if fmt.sharding is Sharding.DATA_PARALLEL else None
    planned.conversion = plan_convert(source, fmt.name, OutputRequest(world_size=per_rank), config_dir=config_dir)
    planned.conversion.notes[:0] = notes


def check_equal(planned: Planned, max_memory: int) -> None:
    """Refuse, naming the key, a tensor not averaged (integers, booleans, float8) whose values differ between
    the sources; read region by region within ``max_memory``."""
    if not planned.equal:
        return
    size = regions.buffer_size(max_memory, [t for _, terms in planned.equal for _, t in terms], readers=2)
    buffers = bytearray(size), bytearray(size)
    for key, terms in planned.equal:
        (first, tensor), rest = terms[0], terms[1:]
        for source, other in rest:
            if other.dtype != tensor.dtype:
                raise UsageError(f"{source.root}: {key} is {other.dtype}, {tensor.dtype} in {first.root}: tensors of "
                                 f"dtypes other than {', '.join(AVERAGED)} must be equal in every checkpoint")
            reader_a = regions.RegionReader(first, buffers[0])
            reader_b = regions.RegionReader(source, buffers[1])
            limit = reader_a.max_elements(tensor)
            for (offsets, a), (_, b) in zip(reader_a.slabs(tensor, limit), reader_b.slabs(other, limit)):
                if not np.array_equal(a, b):
                    raise UsageError(f"{source.root}: {key} ({tensor.dtype}) differs from {first.root}'s: tensors of "
                                     f"dtypes other than {', '.join(AVERAGED)} must be equal in every checkpoint")
