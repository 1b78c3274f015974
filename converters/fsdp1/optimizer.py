"""The optimizer files in their four forms (``OPTIMIZER_FORMS``), read and written.

``named`` is ``FSDP.optim_state_dict`` keyed by parameter name. The others are the plain
``optimizer.state_dict()`` that verl's checkpoint manager saves, keyed by position: of FSDP1 with
``use_orig_params=False`` (``flat``: one entry per FSDP unit, each moment the rank's shard of the
unit's flat parameter, laid out by ``flat.flat_parameters``) or ``use_orig_params=True``
(``orig``: the rank's 1-D piece of each parameter), or of FSDP2 (``fsdp2``: verl's folder of
``fully_shard``, ``FSDP_version: 2``, keyed by parameter position, the moments DTensors like the
model values). ``read_optimizer`` reads any of them as ``optimizer.state.<param>.<moment>``;
``PlainOptimizer`` writes the positional ones.
"""

from __future__ import annotations

import math
from typing import Protocol

from dcptool import dtypes, models, selection
from dcptool.engine.chunks import Chunk
from dcptool.engine.core import ObjectInfo, OutObject, OutTensor, join_path
from dcptool.errors import CheckpointError, UsageError, printable, option
from dcptool.safe_pickle import TensorRef
from dcptool.state_dicts import nest
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive, Reduced, TensorOut
from dcptool.converters.fsdp1.codecs import is_dtensor
from dcptool.converters.fsdp1.flat import FlatParameter, alignment_of, flat_boxes, flat_parameters
from dcptool.converters.fsdp1.folder import OPTIMIZER, RankPiece, file_name
from dcptool.converters.fsdp1.gathering import Gathered, NotRead, read_part


OPTIMIZER_FORMS = {  # --optim-form: how the optimizer files hold the state
    "named": "FSDP.optim_state_dict under SHARDED_STATE_DICT, keyed by parameter name (FSDP.optim_state_dict_to_load "
             "loads it)",
    "flat": "optimizer.state_dict() of FSDP1 with use_orig_params=False (verl's default), a flat parameter per "
            "FSDP unit",
    "orig": "optimizer.state_dict() of FSDP1 with use_orig_params=True, a 1-D piece of each parameter per rank",
    "fsdp2": "optimizer.state_dict() of FSDP2 (fully_shard), each moment a DTensor laid out like its parameter",
}


def read_optimizer(files: CheckpointFiles, world_size: int, present: set[int], model_keys: list[tuple[str, str]],
                   tensors: dict, objects: dict, kinds: dict) -> tuple[list[str], str | None, int | None]:
    """The optimizer files, as ``optimizer.state.<param>.<moment>`` laid out like the parameter: lines for
    what is not read, the form read (one of ``OPTIMIZER_FORMS``) and the alignment of ``orig`` pieces.

    ``FSDP.optim_state_dict`` under SHARDED_STATE_DICT (``named``) keys the state by parameter name,
    each moment sharded like its parameter. The plain ``optimizer.state_dict()`` that verl's checkpoint
    manager saves keys it by position: under FSDP2 by the parameter's position among the model's
    parameters (the model file's sharded entries, in order), with DTensor moments; under FSDP1 with
    ``use_orig_params=False`` (``flat``) by the position of the FSDP unit, each moment the rank's
    shard of the unit's flat parameter (``flat_parameters``); with ``use_orig_params=True``
    (``orig``) by the parameter's position, with the rank's 1-D piece of it (a rank holding none of
    it has no entry; one rank holds whole moments).
    """
    missing = [r for r in range(world_size) if r not in present]
    if missing:
        return [f"{files.path(file_name('optim', world_size, missing[0]))}: missing ({len(missing)} of {world_size} "
                "ranks' optimizer files): the optimizer state is not read"], None, None
    params = [key for key, kind in model_keys if kind in ("ShardedTensor", "DTensor")]
    if world_size == 1 and not params:  # one rank saves its parameters as plain tensors, in the model's order
        params = [key for key, kind in model_keys if kind == "plain tensor"]
    shapes = {key: tensors[key].shape for key in params}
    archives = [Archive(files, file_name("optim", world_size, rank)) for rank in range(world_size)]
    roots = []
    for archive in archives:
        root = archive.load()
        if not isinstance(root, dict) or not isinstance(root.get("state"), dict) \
                or not isinstance(root.get("param_groups"), list):
            return [f"{archive.where}: holds no optimizer state dict (state and param_groups): the optimizer "
                    "state is not read"], None, None
        roots.append(root)
    gathered_tensors: dict[str, Gathered] = {}
    gathered_objects: dict[str, ObjectInfo] = {}
    by_position = [key for root in roots for key in root["state"] if type(key) is not str]
    if by_position and not all(type(key) is int for key in by_position):
        raise CheckpointError(f"{archives[0].where}: optimizer state keyed by something other than names and numbers")
    positions = sum(len(group.get("params") or ()) for group in roots[0]["param_groups"] if isinstance(group, dict))
    trainable = [key for key in params if models.peft_trainable(key)]
    if by_position and positions < len(params) and positions == len(trainable):  # peft froze the rest
        params, shapes = trainable, {key: shapes[key] for key in trainable}
    dtensor_moments = any(is_dtensor(v) for root in roots for entry in root["state"].values()
                          if isinstance(entry, dict) for v in entry.values())
    form = "named" if not by_position else "fsdp2" if dtensor_moments else "orig"
    owners = [(key,) for key in params]  # the parameters whose state each position holds
    units = flat_parameters(params, {key: math.prod(shape) for key, shape in shapes.items()})
    try:
        if form == "orig" and len(units) < len(params) and all(0 <= i < len(units) for i in by_position):
            form, owners = "flat", [unit.params for unit in units]
            gathered_tensors = _unit_moments(archives, roots, units, shapes)
        if by_position:
            roots = [_by_name(root, archive.where, owners) for root, archive in zip(roots, archives)]
        alignment = None
        if form == "orig" and not (world_size == 1 and _whole_moments(roots[0], shapes)):
            gathered_tensors = _flat_pieces(archives, roots, shapes)
            alignment = _orig_alignment(roots, params, shapes)
        if gathered_tensors:  # the moments are read: the state dicts keep the rest (step)
            roots = [{**root, "state": {name: {k: v for k, v in entry.items() if k not in _moments(root, name)}
                                        for name, entry in root["state"].items()}} for root in roots]
    except NotRead as exc:
        return [str(exc)], None, None
    read_part(files, "optim", (OPTIMIZER,), world_size, gathered_tensors, gathered_objects, kinds, roots,
              same_keys=form != "orig")
    for key, gathered in gathered_tensors.items():
        if not (len(gathered.path) == 4 and gathered.path[1] == "state"):
            raise CheckpointError(f"{archives[0].where}: {printable(key)} is not state.<parameter>.<name>")
    tensors.update(gathered_tensors)
    objects.update(gathered_objects)
    return [], form, alignment


def _orig_alignment(roots: list[dict], params: list[str], shapes: dict[str, tuple[int, ...]]) -> int | None:
    """The alignment (in elements) the saving job's use_orig_params flat parameters had, from the pieces its
    ranks saved (``flat.alignment_of``), or None."""
    observed = {}
    for rank, root in enumerate(roots):
        for name, entry in root["state"].items():
            lengths = [v.shape[0] for v in entry.values() if isinstance(v, TensorRef) and len(v.shape) == 1] \
                if isinstance(entry, dict) else []
            if lengths:
                observed[(name, rank)] = lengths[0]
    numels = {key: math.prod(shape) for key, shape in shapes.items()}
    return alignment_of(params, numels, observed, len(roots))


def _whole_moments(root: dict, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether one rank's state holds moments shaped like their parameters (FSDP1 on one rank shards
    nothing: with use_orig_params=True they are whole)."""
    return all(v.shape == shapes[name] for name, entry in root["state"].items() if isinstance(entry, dict)
               for v in entry.values() if isinstance(v, TensorRef) and v.shape)


def _by_name(root: dict, where: str, owners: list[tuple[str, ...]]) -> dict:
    """An optimizer state dict keyed by position, keyed by parameter name instead: position ``i`` holds the
    state of the parameters ``owners[i]`` (one, or the several of an FSDP unit's flat parameter)."""
    named = {}
    for index, entry in root["state"].items():
        if not 0 <= index < len(owners):
            raise NotRead(f"{where}: holds optimizer state of parameter {index}, but the model files hold "
                          f"{len(owners)} parameters: the optimizer state is not read")
        named.update(dict.fromkeys(owners[index], entry))
    groups = []
    for group in root["param_groups"]:
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < len(owners) for i in ids):
            raise CheckpointError(f"{where}: a param group without the positions of its parameters")
        groups.append({**group, "params": [name for i in ids for name in owners[i]]})
    return {**root, "state": named, "param_groups": groups}


_NOT_PIECES = ("it does not hold FSDP1's use_orig_params=True state (1-D pieces of each parameter): the optimizer "
               "state is not read")


def _unit_moments(archives: list[Archive], roots: list[dict], units: list[FlatParameter],
                  shapes: dict[str, tuple[int, ...]]) -> dict:
    """The moments of FSDP1's flat parameters (``use_orig_params=False``) as chunks of each parameter:
    position ``u`` of rank ``r`` holds the rank's shard of unit ``u``'s flat parameter. Shards of other
    sizes than ``flat_parameters`` computes leave the state unread (never a wrong mapping)."""
    world_size = len(archives)
    positions = sorted(roots[0]["state"])
    gathered: dict[str, Gathered] = {}
    for rank, (archive, root) in enumerate(zip(archives, roots)):
        if sorted(root["state"]) != positions:
            raise NotRead(f"{archive.where}: holds the state of other FSDP units than "
                          f"{file_name('optim', world_size, 0)}: the optimizer state is not read")
        for position in positions:
            unit = units[position]
            size = unit.shard_numel(world_size)
            for moment in sorted(_moments(root, position)):
                piece, at_key = root["state"][position][moment], f"state.{position}.{moment}"
                if piece.subclass or piece.shape != (size,) or (size > 1 and piece.stride != (1,)):
                    raise NotRead(
                        f"{archive.where}: {at_key} is {piece.dtype.name}{list(piece.shape)}, but the flat parameter "
                        f"of FSDP unit {position} ({unit.describe()}) holds {size:,} elements on each of {world_size} "
                        "ranks (use_orig_params=False, each decoder layer a unit of its own, no tied parameters): "
                        "the optimizer state is not read")
                raw = archive.raw_bytes(piece)
                for index, first, stop, at in unit.on_rank(rank, world_size):
                    name = unit.params[index]
                    path = (OPTIMIZER, "state", name, moment)
                    moments = gathered.setdefault(join_path(path), Gathered(path, piece.dtype.name, shapes[name],
                                                                            archive.where))
                    if moments.dtype != piece.dtype.name:
                        raise CheckpointError(f"{archive.where}: {at_key} is {piece.dtype.name}, other ranks' are "
                                              f"{moments.dtype}")
                    moments.add([Chunk(offsets, sizes, raw.file, raw.offset + (at + element - first) * raw.itemsize,
                                       math.prod(sizes) * raw.itemsize, "raw")
                                 for offsets, sizes, element in flat_boxes(first, stop, shapes[name])])
    return gathered


def _moments(root: dict, name: str) -> set[str]:
    """The names of a parameter's state entries that are pieces of a tensor (all but scalars such as ``step``)."""
    entry = root["state"][name]
    return {k for k, v in entry.items() if isinstance(v, TensorRef) and v.shape} if isinstance(entry, dict) else set()


def _flat_pieces(archives: list[Archive], roots: list[dict], shapes: dict[str, tuple[int, ...]]) -> dict:
    """Moments saved as 1-D pieces of the flattened parameter, one per rank in rank order, as chunks of the
    parameter's shape: each piece is a run of elements, cut into the boxes it covers."""
    gathered: dict[str, Gathered] = {}
    for name, shape in shapes.items():
        moment_names = sorted({m for root in roots if name in root["state"] for m in _moments(root, name)})
        for moment in moment_names:
            path = (OPTIMIZER, "state", name, moment)
            start, dtype = 0, None
            chunks = []
            for archive, root in zip(archives, roots):
                piece = root["state"].get(name, {}).get(moment)
                if piece is None:
                    continue
                if piece.subclass or len(piece.shape) != 1 or (piece.shape[0] > 1 and piece.stride != (1,)):
                    raise NotRead(f"{archive.where}: {join_path(path)} is not a run of elements: {_NOT_PIECES}")
                if dtype not in (None, piece.dtype.name):
                    raise CheckpointError(f"{archive.where}: {join_path(path)} is {piece.dtype.name}, other ranks' "
                                          f"are {dtype}")
                dtype, raw = piece.dtype.name, archive.raw_bytes(piece)
                stop = start + piece.shape[0]
                if stop > math.prod(shape):
                    raise NotRead(f"{archive.where}: {join_path(path)} holds more elements than its parameter "
                                  f"{list(shape)}: {_NOT_PIECES}")
                for offsets, sizes, first in flat_boxes(start, stop, shape):
                    where = raw.offset + (first - start) * raw.itemsize
                    chunks.append(Chunk(offsets, sizes, raw.file, where, math.prod(sizes) * raw.itemsize, "raw"))
                start = stop
            if start != math.prod(shape):
                raise NotRead(f"{archives[0].where}: the ranks' pieces of {join_path(path)} hold {start} of the "
                              f"{math.prod(shape)} elements of its parameter: {_NOT_PIECES}")
            gathered[join_path(path)] = Gathered(path, dtype, shape, archives[0].where)
            gathered[join_path(path)].add(chunks)
    return gathered


class RankFiles(Protocol):
    """Where ``PlainOptimizer.state_dict`` plans its tensors: the writer of the rank files (``writer.Writer``)."""

    def stored(self, file: str, dtype: str, shape, parts: list[tuple[RankPiece, int]]) -> TensorOut:
        """A contiguous tensor of ``file`` made of ``parts`` (a piece and the element it starts at)."""

    def whole(self, tensor: OutTensor, rank: int, file: str) -> TensorOut:
        """All of ``tensor`` as a plain tensor of ``file``."""

    def sharded(self, tensor: OutTensor, rank: int, file: str) -> Reduced:
        """Rank ``rank``'s rows of ``tensor`` as the ShardedTensor or DTensor its model values are."""


class PlainOptimizer:
    """The optimizer entries as FSDP's plain ``optimizer.state_dict()`` holds them on each rank, keyed by
    position among the optimizer's parameters (param group after param group, each in the model's order).

    ``flat`` (``use_orig_params=False``): a position per FSDP unit (``flat_parameters``), each moment
    the rank's shard of the unit's flat parameter, zeros where FSDP1 pads it; the unit's scalars
    (``step``) are its first parameter's, as FSDP1 keeps one per flat parameter. ``orig``
    (``use_orig_params=True``): a position per parameter, with an entry on each rank whose shard holds
    some of it, each moment that 1-D piece, the flat parameter aligned for the parameters' own dtype
    (FSDP1 without a MixedPrecision param_dtype); on one rank the moments are whole. ``fsdp2``
    (``fully_shard``): a position per parameter as with ``orig``, on every rank, each moment the DTensor
    of its parameter's rows (``Writer.sharded``), scalars as saved. ``param_groups`` keep the source's
    settings, their ``params`` numbered so.
    """

    def __init__(self, form: str, parameters: list[OutTensor], tensors, objects, world_size: int,
                 orig_alignment: int | None = None):

        self.form, self.world_size = form, world_size
        dtype_of = {t.key: t.dtype for t in parameters}
        aligned = (lambda unit: 0) if form != "orig" else (lambda unit: orig_alignment) if orig_alignment else \
            (lambda unit: 16 // dtypes.dtype(dtype_of[unit[0]]).itemsize)
        units = flat_parameters([t.key for t in parameters], {t.key: math.prod(t.shape) for t in parameters}, aligned)
        self.state: dict[str, dict[str, OutTensor | OutObject]] = {}
        for entry in [*tensors, *objects]:
            if entry.path[:2] == (OPTIMIZER, "state") and len(entry.path) == 4:
                self.state.setdefault(entry.path[2], {})[entry.path[3]] = entry
        groups = _param_groups_of(objects)
        group_of: dict[str, int] = {}
        for index, group in enumerate(groups):
            for name in group["params"]:
                group_of.setdefault(selection.unwrapped(name), index)
        # What each position holds, in the order of model.parameters(): flat parameters unit by unit (the
        # root's first); with use_orig_params=True the parameters themselves, as the model lists them.
        model_order = {t.key: number for number, t in enumerate(parameters)}
        members = [(unit, None) for unit in units] if form == "flat" else sorted(
            ((unit, index) for unit in units for index in range(len(unit.params))),
            key=lambda member: model_order[member[0].params[member[1]]])
        ordered = []
        for unit, index in members:
            names = unit.params if index is None else (unit.params[index],)
            found = {group_of.get(name) for name in names}
            if len(found) > 1:
                raise UsageError(f"optimizer.param_groups: the parameters of the FSDP unit of {unit.describe()} are "
                                 f"in several param groups, which one flat parameter cannot be ({option('optim_form', 'orig')} "
                                 "or named)")
            if found == {None}:
                stateful = next((name for name in names if name in self.state), None)
                if stateful:
                    raise UsageError(f"optimizer.state.{stateful}: its parameter is in no param group")
                continue  # not a parameter of the optimizer (frozen)
            if index is None:
                self._check_unit(unit)
            ordered.append((found.pop(), unit, index))
        ordered.sort(key=lambda member: member[0])  # stable: the model's order within a group
        self.positions = [(unit, index) for _, unit, index in ordered]
        self.groups = [{**{k: v for k, v in group.items() if k != "params"},
                        "params": [p for p, (g, _, _) in enumerate(ordered) if g == number]}
                       for number, group in enumerate(groups)]

    def _check_unit(self, unit: FlatParameter) -> None:
        """A flat parameter's moments: the same names and dtypes for each of its parameters, or none at all."""
        def moments(name):
            return {k: v.dtype for k, v in self.state.get(name, {}).items() if isinstance(v, OutTensor) and v.shape}

        first = moments(unit.params[0])
        for name in unit.params[1:]:
            if moments(name) != first:
                raise UsageError(f"optimizer.state.{name}: FSDP1 keeps one state per flat parameter, but the "
                                 f"parameters of the FSDP unit of {unit.describe()} have different state "
                                 f"({sorted(moments(name).items())} and {sorted(first.items())})")

    def state_dict(self, writer: RankFiles, rank: int, file: str) -> dict:
        """Rank ``rank``'s ``optimizer.state_dict()``; its tensors planned into ``file`` by ``writer``."""
        state = {}
        for position, (unit, index) in enumerate(self.positions):
            first = self.state.get(unit.params[0 if index is None else index])
            if self.form == "fsdp2":  # every rank holds every parameter's state, DTensors like the parameter
                if first:
                    state[position] = {name: value.value() if isinstance(value, OutObject) else
                                       writer.sharded(value, rank, file) if value.shape else
                                       writer.whole(value, rank, file) for name, value in first.items()}
                continue
            runs = [run for run in unit.on_rank(rank, self.world_size) if index is None or run[0] == index]
            if not first or (index is not None and not runs):  # a flat shard of padding only still has its state
                continue
            length = unit.shard_numel(self.world_size) if index is None else runs[0][2] - runs[0][1]
            base = 0 if index is None else runs[0][3]  # where the stored run starts in the rank's shard
            entry = {}
            for name, value in first.items():
                if isinstance(value, OutObject):
                    entry[name] = value.value()
                elif not value.shape or (index is not None and self.world_size == 1):  # scalars; orig on one rank
                    entry[name] = writer.whole(value, rank, file)
                else:
                    parts = []
                    for i, begin, stop, at in runs:
                        moment = self.state[unit.params[i]][name]
                        parts += [(RankPiece(moment, offsets, sizes, rank, file), at - base + element - begin)
                                  for offsets, sizes, element in flat_boxes(begin, stop, moment.shape)]
                    entry[name] = writer.stored(file, value.dtype, (length,), parts)
            state[position] = entry
        return {"state": state, "param_groups": self.groups}


def _param_groups_of(objects: list[OutObject]) -> list[dict]:
    """The optimizer's param_groups, each naming its parameters, from the objects under ``optimizer.param_groups``."""
    found = {obj.path[1:]: obj.value() for obj in objects if obj.path[:2] == (OPTIMIZER, "param_groups")}
    groups = nest(found)["param_groups"] if found else []
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list)
                                             and all(isinstance(n, str) for n in g["params"]) for g in groups)):
        raise UsageError("optimizer.param_groups: not a list of param groups naming their parameters, which the plain "
                         f"optimizer.state_dict() of {option('optim_form', 'flat')} and orig numbers")
    return groups
