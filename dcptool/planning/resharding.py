"""Reshard: lay a checkpoint out for another mesh, chunk for chunk as a job on that mesh saves it.

Planning gives every tensor its placement on the target mesh (from the plan's rule for its
parameter; optimizer state follows its parameter; other tensors are replicated), computes the
chunk each rank holds (``dcptool.mesh``), keeps each distinct chunk once and gives it to the
least-loaded rank holding it, as ``dcp.save`` deduplicates. A format of per-rank data-parallel
files (fsdp1) lays out its ranks itself. Execution is the ordinary streamed conversion with the
format's writer putting each chunk in its rank's file; ``dcptool.api.reshard`` runs the whole.

>>> result = plan_for(formats.open_checkpoint("step-1000"), MeshOptions(tp=4))   # doctest: +SKIP
>>> result.mesh.describe(), result.problems                                        # doctest: +SKIP
('8 ranks: dp=2 x tp=4', [])
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dcptool import dtypes, formats, models
from dcptool.planning import plans
from dcptool.planning.conversion import Conversion, Report, adapted, kept_config
from dcptool.engine.chunks import ChunkTable
from dcptool.engine.core import Checkpoint, OutObject, OutTensor
from dcptool.errors import UsageError, counted, option
from dcptool.format_interface import FormatOptions, Sharding, OutputRequest
from dcptool.mesh import Axis, Mesh, NotRectangular, Shard, Strided, contiguous, fsdp_placement, local_chunk, spec_str
from dcptool.options import MeshOptions
from dcptool.selection import config_folder, model_part, read_config
from dcptool.storage import CheckpointFiles

# Entries that belong to one data-parallel rank of the saving job (torchtitan's dataloader state):
# they have no meaning on another mesh.
RANK_STATE_PATTERNS = [re.compile(p) for p in (r"(^|\.)dp_rank_\d+(\.|$)", r"(^|\.)rank_\d+(\.|$)")]

DEFAULT_RULE = plans.Rule(r"", "replicate")  # a parameter no rule names: whole on tp, FSDP on dim 0


@dataclass
class ReshardReport(Report):
    """A reshard's report: the mesh and plan, warnings, and with ``dry_run`` the plan's ``summary`` and problems."""

    mesh: Mesh | None = None
    plan: str = ""
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    description: str = ""  # the mesh and how it is laid out, one line


class Refused(Exception):
    """A tensor the target mesh cannot lay out; the message names it."""


@dataclass
class TensorLayout:
    tensor: OutTensor
    spec: tuple[Axis, ...]  # as dcp.save records it; () for a plain tensor every rank holds whole
    follows: str | None  # the parameter whose rule placed it
    placed: tuple[Axis, ...] = ()  # as the job places it while training, where that is not ``spec``
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)  # (offsets, sizes, rank)


@dataclass
class ReshardPlan:
    """A reshard planned: the mesh, each tensor's chunks on it (``layouts``; empty for a format that lays
    out its own data-parallel ranks), and ``conversion``, the write that puts them in place."""

    checkpoint: Checkpoint  # the source, under the names it is written with
    mesh: Mesh
    plan: plans.Plan | None  # None where the format lays out its ranks itself
    layouts: list[TensorLayout]
    objects: list[OutObject]
    rank_bytes: list[int]
    problems: list[str] = field(default_factory=list)  # any of these refuses the reshard
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what renaming the entries to a naming family made or left out
    entry_counts: list[int] = field(default_factory=list)  # per entry of the plan, the parameters it places
    conversion: Conversion | None = None  # set by ``plan_for``

    def layout_of(self):
        """The writer's ``layout`` callable: a tensor's chunks as ``(offsets, sizes, rank)``."""
        by_tensor = {layout.tensor: layout.chunks for layout in self.layouts}
        return by_tensor.__getitem__

    def describe(self) -> str:
        """The mesh and how it is laid out, in one line."""
        how = f"plan {self.plan.name} ({self.plan.description})" if self.plan else \
            f"{self.conversion.to} lays out its data-parallel ranks itself"
        return f"{self.mesh.describe()}; {how}"

    def plan_entries(self) -> list[dict]:
        """The plan's entries (``pattern``, what it does, ``parameters``: how many of the checkpoint's it places)."""
        if self.plan is None:
            return []
        counts = self.entry_counts or [0] * len(self.plan.entries)
        return [{"entry": pattern, "style": style, "parameters": count}
                for (pattern, style), count in zip(self.plan.entries, counts)]

    def summary(self, files: dict[str, int]) -> dict:
        """What ``--dry-run --json`` prints: the mesh, every tensor's placement and chunks, ``files`` (those the
        writer plans, with their bytes: ``Conversion.planned_files``), problems and warnings."""
        layouts = {layout.tensor.key: layout for layout in self.layouts}
        tensors = {}
        for tensor in self.conversion.tensors if self.conversion else [l.tensor for l in self.layouts]:
            layout = layouts.get(tensor.key)
            tensors[tensor.key] = {
                "shape": list(tensor.shape), "dtype": tensor.dtype, "source_chunks": len(tensor.source.chunks),
                "placement": spec_str(layout.spec) if layout else "per-rank files",
                **({"placed": spec_str(layout.placed)} if layout and layout.placed else {}),
                "follows": layout.follows if layout else None,
                "chunks": [[list(o), list(s), r] for o, s, r in layout.chunks] if layout else []}
        return {
            "mesh": self.mesh.as_dict() | {"world_size": self.mesh.world, "description": self.mesh.describe()},
            "plan": self.plan.name if self.plan else None,
            "plan_description": self.plan.description if self.plan else None,
            "plan_entries": self.plan_entries(),
            "format": self.conversion.to if self.conversion else None,
            "tensors": tensors,
            "objects": [obj.key for obj in (self.conversion.objects if self.conversion else self.objects)],
            "files": {} if self.problems else files,
            "problems": self.problems,
            "warnings": self.warnings,
        }


def resolve_mesh(checkpoint: Checkpoint, options: MeshOptions) -> Mesh:
    """The target mesh; ``dp`` left out keeps the world size the source was saved with (or ``world_size``)."""
    sizes = options.sizes()
    dp, world_size = sizes.pop("dp"), sizes.pop("world_size")
    world = world_size or checkpoint.info.get("world_size")
    others = sizes["dp_replicate"] * sizes["cp"] * sizes["tp"]
    if dp is None:
        if world is None:
            dp = 1
        elif world % others:
            source = option("world_size") if world_size else f"the source's world size ({world} ranks)"
            raise UsageError(f"dp_replicate*cp*tp = {others} does not divide {source}; give {option('dp')}")
        else:
            dp = world // others
    mesh = Mesh(dp=dp, **sizes)
    mesh.check()
    if world_size and mesh.world != world_size:
        raise UsageError(f"{option('world_size', world_size)} != dp_replicate*dp*cp*tp = {mesh.world} ({mesh.describe()})")
    return mesh


def tensor_spec(key: str, rule: plans.Rule | None, shape: tuple[int, ...], mesh: Mesh,
                engine: str = "torch") -> tuple[Axis, ...]:
    """The axes and placements of a tensor on ``mesh`` under ``rule``, as FSDP2 + TP + EP place it in a job of
    ``engine``'s conventions (``plans.ENGINES``); ``saved`` gives what its ``dcp.save`` records."""
    if rule is None or not shape:
        return ()
    ndim = len(shape)
    if rule.experts and ndim < 2:
        raise Refused(f"{key}: the plan calls it grouped experts [E, ...], but it is {ndim}-D")
    tp_dim = rule.tp_dim(ndim)
    packed = rule.packed if tp_dim is not None and ndim >= 2 else 1  # a packed bias is split as one part
    split = Strided(tp_dim, packed) if packed > 1 else Shard(tp_dim)
    fsdp_dim = rule.fsdp
    if rule.experts and mesh.ep > 1:
        parallel = (Axis("ep", mesh.ep, Shard(0)),)
        if mesh.etp > 1 and tp_dim is not None:
            parallel += (Axis("etp", mesh.etp, split),)
        fsdp_axis, fsdp_size = "efsdp", mesh.efsdp
        if engine == "torch" and fsdp_dim == 0 and mesh.efsdp * mesh.ep > shape[0]:
            fsdp_dim = 1  # torchtitan shards experts on dim 1 when there are more ranks than experts
    else:
        parallel = (Axis("tp", mesh.tp, split),) if tp_dim is not None else ()
        fsdp_axis, fsdp_size = "fsdp", mesh.fsdp
    for axis in parallel:
        dim = axis.placement.dim
        parts = axis.size * (axis.placement.split_factor if isinstance(axis.placement, Strided) else 1)
        if shape[dim] % parts:
            what = "experts" if axis.name == "ep" else f"dim {dim}"
            by = f"{axis.name}={axis.size}" + (f" in each of its {parts // axis.size} packed parts" if parts > axis.size
                                               else "")
            raise Refused(f"{key}: {what} of size {shape[dim]} cannot be split by {by}")
    if fsdp_dim is None:
        return parallel
    if fsdp_dim >= ndim:
        raise Refused(f"{key}: the plan shards dim {fsdp_dim} with FSDP, but the tensor is {ndim}-D")
    fsdp = Axis(fsdp_axis, fsdp_size, fsdp_placement(fsdp_dim, parallel))
    return (Axis("dp_replicate", mesh.dp_replicate, None), fsdp) + parallel


def saved(spec: tuple[Axis, ...], engine: str) -> tuple[Axis, ...]:
    """The placements ``dcp.save`` records of a tensor placed by ``spec`` in a job of ``engine``'s conventions:
    torch's save them as they are; transformers redistributes every strided shard to a contiguous one first
    (``_redistribute_state_dict``), since dcp.save records one region per rank."""
    return contiguous(spec) if engine == "transformers" else spec


class _ChunkTable:
    """Distinct chunks of a (shape, spec) on a mesh with the ranks holding each; cached, since layers repeat."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.coordinates = [mesh.coordinates(rank) for rank in range(mesh.world)]
        self.cache: dict = {}

    def __call__(self, shape, spec):
        found = self.cache.get((shape, spec))
        if found is None:
            holders: dict[tuple[int, ...], tuple[tuple[int, ...], list[int]]] = {}
            for rank, coordinates in enumerate(self.coordinates):
                offsets, sizes = local_chunk(shape, spec, coordinates)
                holders.setdefault(offsets, (sizes, []))[1].append(rank)
            found = self.cache[(shape, spec)] = [(o, s, r) for o, (s, r) in holders.items()]
        return found


def _owner(key: str, params: dict, shape) -> str | None:
    """The parameter an optimizer entry belongs to: the longest run of its key's parts naming a
    parameter of the same shape (``optimizer.state.<param>.exp_avg``)."""
    parts = key.split(".")
    for start in range(len(parts)):
        for stop in range(len(parts), start, -1):
            name = ".".join(parts[start:stop])
            if name in params and params[name].shape == shape:
                return name
    return None


def is_rank_state(key: str) -> bool:
    return any(p.search(key) for p in RANK_STATE_PATTERNS)


def plan_reshard(checkpoint: Checkpoint, mesh: Mesh, plan: plans.Plan, *, keep_rank_state: bool = False,
                 config: dict | None = None, config_path=None, dtype: str | None = None,
                 to: str = "dcp") -> ReshardPlan:
    """Every tensor's chunks on ``mesh`` (of what format ``to`` holds of the checkpoint), the objects carried
    over, and the problems found (none raised); ``config``: the model's config.json (read from ``config_path``)."""
    output = formats.get(to).plan_output(checkpoint, OutputRequest(dtype=dtype))
    tensors, objects = output.tensors, output.objects
    problems, warnings = _config_problems(config, config_path, mesh, "ep"), [plan.warning] if plan.warning else []
    if plan.engine == "transformers" and mesh.ep > 1 and mesh.etp > 1:
        problems.append(f"{option('etp', mesh.etp)}: {plan.description} splits experts by ep alone (transformers "
                        f"has no expert tensor parallelism): give {option('etp', 1)}")
    rank_state = [t.key for t in tensors if is_rank_state(t.key)] + [o.key for o in objects if is_rank_state(o.key)]
    if rank_state:
        shown = ", ".join(rank_state[:3]) + (" ..." if len(rank_state) > 3 else "")
        if keep_rank_state:
            warnings.append(f"kept {counted(len(rank_state), 'entry', 'entries')} of single data-parallel ranks as saved ({shown}); "
                            "they describe the source job's ranks")
        else:
            warnings.append(f"dropped {counted(len(rank_state), 'entry', 'entries')} of single data-parallel ranks ({shown}): they "
                            f"cannot be resharded; {option('keep_rank_state', True)} keeps them as saved")
            tensors = [t for t in tensors if not is_rank_state(t.key)]
            objects = [o for o in objects if not is_rank_state(o.key)]

    params = model_part(checkpoint)
    name_of = {info.key: name for name, info in params.items()}
    table = _ChunkTable(mesh)
    rank_bytes = [0] * mesh.world
    layouts = []
    entry_counts = [0] * len(plan.entries)
    rule_index = functools.cache(plan.rule_index)  # optimizer state asks again for its parameter's
    for tensor in tensors:
        follows = name_of.get(tensor.source.key) or _owner(tensor.source.key, params, tensor.shape)
        index = rule_index(follows) if follows else None
        rule = (DEFAULT_RULE if index is None else plan.rules[index]) if follows else None
        if index is not None and tensor.source.key in name_of:
            entry_counts[plan.rule_entries[index]] += 1
        try:
            placed = tensor_spec(follows or tensor.key, rule, tensor.shape, mesh, plan.engine)
            spec = saved(placed, plan.engine)
            chunks = table(tensor.shape, spec)
        except Refused as exc:
            problems.append(str(exc))
            continue
        except NotRectangular as exc:
            problems.append(f"{tensor.key}: on {mesh.describe()} a rank's shard is not a rectangle ({exc}); "
                            "dcp.save cannot record it")
            continue
        layout = TensorLayout(tensor, spec, follows, placed if placed != spec else ())
        itemsize = dtypes.dtype(tensor.dtype).itemsize
        for offsets, sizes, holders in chunks:
            rank = min(holders, key=lambda r: (rank_bytes[r], r))  # dcp.save's dedup: the least-loaded holder
            rank_bytes[rank] += math.prod(sizes) * itemsize or 1
            layout.chunks.append((offsets, sizes, rank))
        layouts.append(layout)
    # Heads first: their line names the config and the tp that fits, where a tensor's own names only its dim.
    problems[:0] = head_problems([layout for layout in layouts if layout.tensor.source.key in name_of], mesh, config,
                              config_path, {name: info.shape for name, info in params.items()},
                              saved_tp=lambda: (infer_mesh(checkpoint) or (Mesh(),))[0].tp)
    if mesh.ep > 1 and not any(a.name == "ep" for layout in layouts for a in layout.spec):
        problems.append(f"{option('ep', mesh.ep)}: plan {plan.name!r} finds no grouped expert tensors in this checkpoint")
    # A plan chosen with a warning (a model with no plan anywhere, replicated over tp) has said why it splits nothing.
    if mesh.tp > 1 and not plan.warning and not any(a.name in ("tp", "etp") for layout in layouts for a in layout.spec):
        problems.append(f"{option('tp', mesh.tp)}: plan {plan.name!r} splits no tensor of this checkpoint; "
                        f"choose a plan with {option('plan')}")
    # Optimizer state repeats its parameter's problem: report each once.
    return ReshardPlan(checkpoint, mesh, plan, layouts, objects, rank_bytes, list(dict.fromkeys(problems)), warnings,
                       entry_counts=entry_counts)


def _config_problems(config: dict | None, path, mesh: Mesh, *settings: str) -> list[str]:
    """Counts of the model config (experts; heads) that the mesh's ``settings`` (ep; tp) do not divide."""
    problems = []
    for setting, name, count, what in models.parallel_divisors(config) if config else ():
        size = getattr(mesh, setting)
        if setting in settings and count % size:
            problems.append(f"{option(setting, size)} does not divide the {count} {what} ({name} in {path})")
    return problems


def head_problems(weights: list[TensorLayout], mesh: Mesh, config: dict | None, config_path,
                  shapes: dict[str, tuple[int, ...]], saved_tp: Callable[[], int] = lambda: 1) -> list[str]:
    """Attention weights that the tp split would cut inside a head, which no job on the mesh can hold.

    The head counts come from the config (``num_attention_heads``, ``num_key_value_heads``), else from the
    tensors (a per-head key norm gives the head size). A count tp does not divide is refused, as a count
    nobody gives is: without it no split of a head's rows is known to be safe, unless the job that saved
    the checkpoint split them as finely (``saved_tp``, its tp, a multiple of this one). Models whose
    attention names no table knows are checked against the config's counts alone.
    """
    if mesh.tp == 1:
        return []
    counts = {what: (count, f"{name} in {config_path}")
              for setting, name, count, what in reversed(models.parallel_divisors(config)) if setting == "tp"}
    if "key/value heads" not in counts and "attention heads" in counts:  # HF: no field means one per query head
        counts["key/value heads"] = counts["attention heads"]
    from_tensors = models.head_dim(shapes)
    saved_tp_once = functools.cache(saved_tp)  # infers the saving mesh only when a count is unknown
    found: dict[tuple, list[str]] = {}
    attention = [(layout, split) for layout in weights if (split := models.head_split(layout.follows or ""))]
    for layout, (what, dim) in attention:
        if dim not in [axis.placement.dim for axis in layout.spec if axis.name == "tp"]:
            continue
        count, source = counts.get(what, (None, None))
        if count is None and from_tensors and layout.tensor.shape[dim] % from_tensors[1] == 0:
            count = layout.tensor.shape[dim] // from_tensors[1]
            source = (f"{layout.tensor.shape[dim]} {'rows' if dim == 0 else 'columns'} of head size {from_tensors[1]}, "
                      f"the size of {from_tensors[0]}")
        if count is None and saved_tp_once() % mesh.tp == 0:
            continue  # the saving job held the heads split so
        if count is None or count % mesh.tp:
            found.setdefault((what, count, source), []).append(layout.tensor.key)
    problems = []
    for (what, count, source), keys in found.items():
        more = f" (and {counted(len(keys) - 1, 'more weight')} like it)" if len(keys) > 1 else ""
        if count is None:
            problems.append(f"{keys[0]}{more}: {option('tp', mesh.tp)} splits its {what}, and neither a config.json "
                            "nor the tensors give their number, so the split may cut a head: give "
                            f"{option('config_dir')} (the model's config.json)")
        else:
            problems.append(f"{keys[0]}{more}: {option('tp', mesh.tp)} does not divide the {count} {what} ({source}), "
                            f"so tp ranks would hold parts of a head: give a {option('tp')} that divides {count}, "
                            f"or a {option('plan')} file whose rule keeps it whole (tp: replicate)")
    if not attention:  # attention under names no table knows: the config's counts still hold
        problems += _config_problems(config, config_path, mesh, "tp")
    return problems


def plan_for(checkpoint: Checkpoint, mesh: MeshOptions, *, to: str = "dcp", family: str | None = None,
             config_dir: str | Path | None = None, keep_rank_state: bool = False, dtype: str | None = None,
             format_options: FormatOptions | None = None, family_options=None) -> ReshardPlan:
    """What ``dcptool reshard`` and ``import-hf`` write: the entries under naming family ``family``'s names and
    in its layout, laid out for the mesh (by its plan) as format ``to`` lays out ranks; problems are listed, not
    raised (``raise_problems``).

    A format with mesh layouts (dcp) gets each tensor's chunks as FSDP2 + TP + EP place them; a format of
    per-rank data-parallel files (fsdp1) lays them out itself, on a mesh of data parallelism only.
    ``format_options`` are the options of format ``to``; ``family_options``: the options of ``family``
    (``families.options_for``: what Megatron names are written for, their vocabulary padding).
    """
    fmt = formats.get(to)
    if fmt.sharding is Sharding.NONE:
        laid_out = [f.name for f in formats.all_formats().values() if f.writable and f.sharding is not Sharding.NONE]
        raise UsageError(f"{option('to', to)}: reshard writes formats laid out over ranks: {', '.join(laid_out)}")
    formats.check_options(fmt, format_options)
    request = OutputRequest(dtype=dtype, keep_rank_state=keep_rank_state, format_options=format_options)
    renamed, notes, made = adapted(checkpoint, family, config_dir=config_dir, options=family_options)
    if fmt.sharding is Sharding.DATA_PARALLEL:
        result = _plan_data_parallel(renamed, fmt, resolve_mesh(renamed, mesh), request)
    else:
        result = prepare(renamed, mesh, config_dir=config_dir, keep_rank_state=keep_rank_state, dtype=dtype,
                         to=to)
        writer_options = fmt.writer_options(OutputRequest(layout=result.layout_of(), world_size=result.mesh.world,
                                                          format_options=format_options))
        result.conversion = Conversion(result.checkpoint, to, [layout.tensor for layout in result.layouts],
                                       result.objects, writer_options)
    result.notes = notes + result.conversion.notes
    result.conversion.notes = result.notes
    result.conversion.keep_config(kept_config(checkpoint, config_dir, made, dtype))
    return result


def _plan_data_parallel(checkpoint: Checkpoint, fmt, mesh: Mesh, request: OutputRequest) -> ReshardPlan:
    """A format of per-rank data-parallel files plans its own ranks: the mesh must be data parallel only."""
    if mesh.world != mesh.dp:
        laid_out = [f.name for f in formats.all_formats().values() if f.sharding is Sharding.MESH and f.writable]
        raise UsageError(f"{option('to', fmt.name)} holds data-parallel shards only; {mesh.describe()} needs "
                         f"{' or '.join(option('to', name) for name in laid_out)}")
    request.world_size = mesh.world
    output = fmt.plan_output(checkpoint, request)
    result = ReshardPlan(checkpoint, mesh, None, [], output.objects, [])
    result.conversion = Conversion.of(checkpoint, fmt.name, output)
    return result


def prepare(checkpoint: Checkpoint, options: MeshOptions, *, config_dir: str | Path | None = None,
            **planning) -> ReshardPlan:
    """Resolve the mesh, choose its plan (``auto``, a built-in name, ``transformers`` or a file; by the model's
    config.json from ``config_dir`` or beside the checkpoint) and plan every tensor."""
    mesh = resolve_mesh(checkpoint, options)
    config_dir = config_dir or config_folder(checkpoint)
    config = read_config(config_dir) if config_dir is not None else None
    config_path = CheckpointFiles(config_dir).path("config.json") if config_dir is not None else None
    chosen = plans.choose(options.plan, list(model_part(checkpoint)), config, tp=mesh.tp, ep=mesh.ep)
    return plan_reshard(checkpoint, mesh, chosen, config=config, config_path=config_path, **planning)


def write_plan(result: ReshardPlan, destination, **options) -> ReshardReport:
    """Write the planned layout (streamed, atomic); ``options`` go to ``write_checkpoint``."""
    report = result.conversion.write(destination, **options)
    return ReshardReport(**vars(report), mesh=result.mesh, plan=result.plan.name if result.plan else "",
                         warnings=result.warnings)


def raise_problems(result: ReshardPlan) -> None:
    if result.problems:
        more = f" (and {len(result.problems) - 1} more problems; {option('dry_run', True)} lists them)" if len(result.problems) > 1 else ""
        raise UsageError(result.problems[0] + more)


def _box_keys(boxes: list | np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunks ``offsets + sizes`` (a list of them, or an array with one row each) as sorted comparable
    keys, and the order that sorts them."""
    rows = np.zeros((len(boxes), 2 * ndim + 1), np.int64)  # a leading 0 column: 0-d tensors have keys too
    if len(boxes):
        rows[:, 1:] = np.asarray(boxes, np.int64).reshape(len(boxes), 2 * ndim)
    keys = rows.view(np.dtype((np.void, rows.shape[1] * 8))).ravel()
    order = np.argsort(keys, kind="stable")
    return keys[order], order


def _saved_layout(chunks, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """The saved chunks as sorted keys (``_box_keys``) and the rank whose file holds each (-1: not recorded)."""
    no_layout = np.zeros(0, np.dtype((np.void, 8))), np.zeros(0, np.int64)  # matches no layout
    if isinstance(chunks, ChunkTable):  # straight from the columns: no Chunk objects
        if chunks.offsets.shape[1] != ndim:
            return no_layout
        boxes = np.concatenate([chunks.offsets, chunks.sizes], axis=1)
        ranks = np.array([-1 if r is None else r for r in chunks.ranks], np.int64)[chunks.file_index]
    else:
        boxes = [c.offsets + c.sizes for c in chunks]
        ranks = np.array([-1 if c.rank is None else c.rank for c in chunks], np.int64)
        if any(len(box) != 2 * ndim for box in boxes):
            return no_layout
    keys, order = _box_keys(boxes, ndim)
    return keys, ranks[order]


def infer_mesh(checkpoint: Checkpoint) -> tuple[Mesh, plans.Plan] | None:
    """The mesh (and plan) whose layout reproduces the saved chunks and the ranks whose files hold them,
    simplest mesh first; None if none does.

    Context parallelism looks like data parallelism on disk, so it is reported as dp.
    """
    world = checkpoint.info.get("world_size")
    params = model_part(checkpoint)
    if not world or not params:
        return None
    plan = plans.choose("auto", list(params))
    saved: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per name, made when first compared
    # Layers repeat: tensors of one rule and shape have one layout per mesh, so each group is laid out once.
    groups: dict[tuple[plans.Rule, tuple[int, ...]], list[str]] = {}
    for name, info in params.items():
        groups.setdefault((plan.rule_for(name) or DEFAULT_RULE, info.shape), []).append(name)
    experts = {shape[0] for rule, shape in groups if rule.experts}
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    candidates = [Mesh(dp=world // (r * t), tp=t, ep=e, etp=et, dp_replicate=r)
                  for r in divisors for t in divisors if world % (r * t) == 0
                  for e in (divisors if experts else [1]) if all(n % e == 0 for n in experts)
                  for et in sorted({1, t})]
    candidates.sort(key=lambda m: (m.dp_replicate, m.ep, m.tp, m.etp))

    def reproduces(table: _ChunkTable, rule: plans.Rule, shape: tuple[int, ...], names: list[str]) -> bool:
        spec = tensor_spec(names[0], rule, shape, table.mesh)
        layout = table(shape, spec)
        keys, order = _box_keys([o + s for o, s, _ in layout], len(shape))
        widest = max(len(h) for _, _, h in layout)
        holders = np.array([h + [-1] * (widest - len(h)) for _, _, h in layout], np.int64)[order]
        for name in names:
            if name not in saved:
                saved[name] = _saved_layout(params[name].chunks, len(shape))
            saved_keys, ranks = saved[name]
            # the same chunks, each in the file of a rank that holds it on this mesh
            if len(saved_keys) != len(keys) or not np.all(saved_keys == keys) or \
                    not np.all(np.any(holders == ranks[:, None], axis=1)):
                return False
        return True

    for mesh in candidates:
        try:
            mesh.check()
            table = _ChunkTable(mesh)
            if all(reproduces(table, rule, shape, names) for (rule, shape), names in groups.items()):
                return mesh, plan
        except (UsageError, Refused, NotRectangular):
            continue
    return None
