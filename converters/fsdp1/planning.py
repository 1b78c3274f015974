"""What an fsdp1 output holds of any checkpoint (``entries``) and in which forms (``output_forms``).

Tied parameters are not laid out in ``flat``, ``orig`` and ``fsdp2`` (FSDP keeps a shared parameter
once among the optimizer's parameters): ``output_forms`` refuses them when the config says
``tie_word_embeddings`` or the input and output embeddings hold the same values.
"""

from __future__ import annotations

import math
import re
from typing import Any

from dcptool import dtypes, models, selection
from dcptool.engine.core import Checkpoint, ObjectInfo, OutObject, OutTensor, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError, printable, option
from dcptool.state_dicts import plain_data
from dcptool.converters.fsdp1.codecs import DEVICE_TYPE, VERL_MESH_DIM_NAMES
from dcptool.converters.fsdp1.folder import (CARRIED, DP_RANK, EXTRA_STATE, NAME, NO_SCHEDULER, OPTIMIZER, RANK_ENTRY,
                                             SCHEDULER_ROOTS)
from dcptool.converters.fsdp1.optimizer import OPTIMIZER_FORMS

HOLDS = "the model, its optimizer state, the lr scheduler and other entries of tensors or plain data"  # entries()
_NO_PLACE = "verl's files hold the model, the optimizer and the lr scheduler only"

_OPTIMIZER_ROOT = re.compile(r"(^|\.)(optim|optimizer)\.")
_PARAM_GROUPS = re.compile(r"(^|\.)(optim|optimizer)\.param_groups(\.(\d+)\.(.+))?$")
# torchtitan and AReaL flatten the optimizer state dict: param_groups.<param>.<setting>, one entry per parameter.
_FLAT_PARAM_GROUP = re.compile(r"(^|\.)(optim|optimizer)\.param_groups\.(?P<param>.+)\.(?P<setting>[^.]+)$")


def entries(checkpoint: Checkpoint, world_size: int | None = None, dtype: str | None = None,
            include: str | None = None, exclude: str | None = None,
            keep_rank_state: bool = False) -> tuple[list[OutTensor], list[OutObject], dict[str, str]]:
    """What a verl folder of ``world_size`` ranks holds of ``checkpoint``: output tensors and objects, and
    why each entry it leaves out is left out (key -> reason; the summary line groups them).

    The model part goes under its parameter names; optimizer state (``<optim>.state.<param>.<name>``
    of any format: FSDP1, DCP of accelerate, torchtitan or AReaL) under ``optimizer.state``, its
    ``param_groups`` under ``optimizer.param_groups``; the lr scheduler under
    ``extra_state.lr_scheduler``. State of one source rank (``extra_state.rank_<r>``, e.g. its RNG
    state) is left out unless ``keep_rank_state`` (then rank ``r`` of the output gets it, if there is
    one: ``world_size`` None keeps every rank's). ``include`` / ``exclude`` select model weights by name.
    What verl's files have no place for (torchtitan's ``train_state.*``, ``dataloader.*``) is carried
    under ``extra_state`` (``_carried``) where it is tensors or plain data.

    >>> tensors, objects, reasons = entries(open_checkpoint("global_step_10/actor"), 16)   # doctest: +SKIP
    >>> [t.key for t in tensors][-1], reasons                                             # doctest: +SKIP
    ('optimizer.state.lm_head.weight.exp_avg_sq', {'extra_state.rank_0.rng': 'state of single ranks of the source job ...'})
    """

    model = selection.select(selection.model_part(checkpoint), include, exclude)
    if not model:
        raise UsageError(f"{checkpoint.root}: no model weight matches the {option('include')}/{option('exclude')} filters")
    tensors = selection.out_tensors(model, dtype, keep_paths=False)
    model_objects = selection.model_part(checkpoint, entries=checkpoint.objects)
    objects = [OutObject(k, o.path if o.key == k else (k,), o, checkpoint)
               for k, o in selection.select(model_objects, include, exclude).items()]
    everything = selection.model_part(checkpoint)  # parameters left out by --include/--exclude keep their state out
    used = {id(entry) for entry in [*everything.values(), *model_objects.values()]}
    left_out: dict[str, list[str]] = {}
    flat_groups: dict[str, dict[str, Any]] = {}  # parameter -> its settings, from a flattened state dict
    merged: list[ObjectInfo] = []
    no_place: list = []  # entries carried under extra_state.dcptool_carried
    for key, entry in [*checkpoint.tensors.items(), *checkpoint.objects.items()]:
        if id(entry) in used:
            continue
        shape = entry.shape if isinstance(entry, TensorInfo) else None
        flat = _FLAT_PARAM_GROUP.search(key) if shape is None else None
        parameter = selection.unwrapped(flat.group("param")) if flat else None
        if parameter in everything:
            if parameter in model:
                flat_groups.setdefault(parameter, {})[flat.group("setting")] = checkpoint.object_value(entry)
                merged.append(entry)
            continue
        path, problem = _training_path(key, entry.path, everything, model, shape)
        own = RANK_ENTRY.match(str(path[1])) if path and path[0] == EXTRA_STATE else None
        if own and not keep_rank_state:
            path, problem = None, f"state of single ranks of the source job; {option('keep_rank_state', True)} keeps it"
        elif own and world_size is not None and int(own.group(1)) >= world_size:
            path, problem = None, f"state of source ranks that a world size of {world_size} does not have"
        if path is None and problem == _NO_PLACE:
            problem = _not_carried(checkpoint, entry)
            if problem is None:
                no_place.append(entry)
                continue
        if path is None:
            left_out.setdefault(problem, []).append(key)
        elif shape is None:
            objects.append(OutObject(join_path(path), path, entry, checkpoint))
        else:
            target = dtype if dtype and path[0] == OPTIMIZER and entry.dtype in dtypes.CASTABLE and shape else None
            tensors.append(OutTensor(join_path(path), path, target or entry.dtype, shape, entry))
    for entry, path in _carried(no_place, world_size):
        if isinstance(entry, TensorInfo):
            tensors.append(OutTensor(join_path(path), path, entry.dtype, entry.shape, entry))
        else:
            objects.append(OutObject(join_path(path), path, entry, checkpoint))
    if flat_groups:
        groups = _param_groups(flat_groups)
        objects.append(OutObject(f"{OPTIMIZER}.param_groups", (OPTIMIZER, "param_groups"),
                                 ObjectInfo((OPTIMIZER, "param_groups"), value=groups), checkpoint, merged))
    if not any(obj.path[:2] == (OPTIMIZER, "param_groups") for obj in objects):
        state = [t for t in tensors if t.path[0] == OPTIMIZER]
        if state:
            tensors = [t for t in tensors if t.path[0] != OPTIMIZER]
            left_out.setdefault("optimizer state without its param_groups, which loading it needs", []).extend(
                t.source.key for t in state)
    return tensors, objects, {key: why for why, keys in left_out.items() for key in keys}


def _not_carried(checkpoint: Checkpoint, entry) -> str | None:
    """Why an entry verl's files have no place for cannot be carried in them, or None when it can: a tensor,
    or an object of plain data (which torch's ``weights_only`` loading of verl's files reads back)."""
    if isinstance(entry, TensorInfo):
        return None
    try:
        value = checkpoint.object_value(entry)
    except CheckpointError:  # classes outside the restricted unpickler's allowlist
        return f"{_NO_PLACE}, and the restricted unpickler does not read it"
    return None if plain_data(value) else f"{_NO_PLACE}, and it is not plain data torch's weights_only loading reads"


def _carried(entries: list, world_size: int | None) -> list[tuple[Any, tuple]]:
    """Where the entries verl has no place for go: ``extra_state.dcptool_carried.<their path>`` in rank 0's
    extra-state file (the file the reader takes the scheduler from; a large one is kept once), but the
    state of one data-parallel rank (``dataloader.dp_rank_<r>``) in rank ``r``'s file where the source saved
    as many data-parallel ranks as the output has ranks; else all of them whole in rank 0's file."""
    dp_rank = {}
    for entry in entries:
        match = next((m for m in map(DP_RANK.match, map(str, entry.path)) if m), None)
        if match:
            dp_rank[entry.key] = int(match.group(1))
    by_rank = world_size is not None and sorted(set(dp_rank.values())) == list(range(world_size))
    return [(entry, (EXTRA_STATE, f"rank_{dp_rank.get(entry.key, 0) if by_rank else 0}", CARRIED, *entry.path))
            for entry in entries]


def source_layout(tensors: list[OutTensor], objects: list[OutObject]) -> dict[str, str]:
    """What ``entries`` restructured of the source's optimizer and scheduler for verl's files, for the reader
    to put back (``fsdp_config.json`` records it): ``param_groups`` ``"per_parameter"`` where they were
    flattened per parameter (torchtitan, AReaL), ``state`` likewise for the state's nesting (torch's
    flattened optimizer state dict keeps ``state.<param>.exp_avg`` as one entry under the optimizer),
    ``lr_scheduler`` the root the scheduler came from, or ``"none"`` where the source has none and the
    extra-state files hold only verl's placeholder (``lr_scheduler: None``, which verl's loader needs)."""
    layout = {}
    extra = [e for e in [*tensors, *objects] if e.path[0] == EXTRA_STATE]
    if extra and not any(e.path[:2] == (EXTRA_STATE, "lr_scheduler") for e in extra):
        layout["lr_scheduler"] = NO_SCHEDULER
    if any(t.path[:2] == (OPTIMIZER, "state") and isinstance(t.source, TensorInfo)
           and str(t.source.path[-1]).startswith("state.") for t in tensors):
        layout["state"] = "per_parameter"
    for obj in objects:
        if obj.path == (OPTIMIZER, "param_groups") and obj.merged:
            layout["param_groups"] = "per_parameter"
        elif obj.path[:2] == (EXTRA_STATE, "lr_scheduler") and obj.source.path[0] in SCHEDULER_ROOTS:
            layout["lr_scheduler"] = obj.source.path[0]
    return layout


def _param_groups(settings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """``FSDP.optim_state_dict``'s param_groups from per-parameter settings: parameters with equal
    settings form one group, in the order they come."""
    groups: list[dict[str, Any]] = []
    for parameter, values in settings.items():
        group = next((g for g in groups if {k: v for k, v in g.items() if k != "params"} == values), None)
        if group is None:
            group = {**values, "params": []}
            groups.append(group)
        group["params"].append(parameter)
    return groups


def _training_path(key: str, path: tuple, everything: dict, chosen: dict, shape) -> tuple[tuple | None, str]:
    """Where a non-model entry goes in verl's files (a nested path under ``optimizer`` or ``extra_state``),
    or None and why it has no place there. Parameter names lose their wrappers' prefixes (``_orig_mod.``)."""
    if path[0] == EXTRA_STATE and len(path) > 1 and (path[1] == "lr_scheduler" or RANK_ENTRY.match(str(path[1]))):
        return path, ""
    if path[0] in SCHEDULER_ROOTS:
        return (EXTRA_STATE, "lr_scheduler") + path[1:], ""
    root = _OPTIMIZER_ROOT.search(key)
    if root is None:
        return None, _NO_PLACE
    groups = _PARAM_GROUPS.fullmatch(key, root.start())
    if groups:
        rest = (int(groups.group(4)), groups.group(5)) if groups.group(3) else ()
        return (OPTIMIZER, "param_groups") + rest, ""
    state = key[root.end():]
    if shape is not None and state.startswith("state."):
        parameter, _, name = state[len("state."):].rpartition(".")
        parameter = selection.unwrapped(parameter)
        if parameter in everything and parameter not in chosen:
            return None, "its parameter is left out"
        if parameter in everything and shape in ((), everything[parameter].shape):
            return (OPTIMIZER, "state", parameter, name), ""
        if parameter in everything:
            return None, f"shape {list(shape)} is neither its parameter's {list(everything[parameter].shape)} nor a scalar"
    return None, "optimizer state verl's files cannot hold (only state.<parameter>.<name> and param_groups)"


def output_forms(checkpoint: Checkpoint, optim_form: str | None = None,
                 model_values: str | None = None) -> tuple[dict[str, Any], str]:
    """The ``Writer`` options that ``--optim-form`` and ``--model-values`` choose, and a line saying what they give.

    Each left out is the source's when the source is a verl folder (its reader records its forms in
    ``info``), else ``named`` and ``sharded-tensor``. ``model_values`` is ``sharded-tensor`` (FSDP1
    built without a device mesh) or ``dtensor[:DEVICE]`` (FSDP1 given verl's 1-D device mesh of the
    world). ``fsdp2`` writes an FSDP2 folder, whose model values are always DTensors (the default
    with it). FSDP loads a DTensor only on a mesh equal to its own (device type, dim names): the mesh
    is on DEVICE, else on the source mesh's device type, else ``cuda``; its dim names are the source
    mesh's, else verl's ``("fsdp",)``.
    """
    source = checkpoint.info if checkpoint.format == NAME else {}
    form = optim_form or source.get("optimizer_form") or "named"
    if form not in OPTIMIZER_FORMS:
        raise UsageError(f"{option('optim_form', form)}: choose {', '.join(OPTIMIZER_FORMS)}")
    values = model_values or ("dtensor" if form == "fsdp2" else source.get("model_values") or "sharded-tensor")
    kind, _, device = values.partition(":")
    if values != "sharded-tensor" and not (kind == "dtensor" and (not device or DEVICE_TYPE.fullmatch(device))):
        raise UsageError(f"{option('model_values', printable(values, 40))}: choose sharded-tensor, dtensor or dtensor:DEVICE "
                         "(e.g. dtensor:cuda)")
    if form == "fsdp2" and kind != "dtensor":
        raise UsageError(f"{option('model_values', values)}: FSDP2's model files hold DTensors, which "
                         f"{option('optim_form', 'fsdp2')} needs ({option('model_values', 'dtensor[:DEVICE]')})")
    config_dir = checkpoint.info.get("hf_config_dir")
    if form != "named":
        flags = models.tie_flags(selection.read_config(config_dir) if config_dir else None)
        tied = [flag for flag, value in flags.items() if value]
        tied_pair = None if flags and not tied else _looks_tied(checkpoint)  # a flag set false: untied
        if tied or tied_pair:
            said = f"{config_dir}/config.json: {tied[0]}" if tied else \
                f"{checkpoint.root}: {tied_pair[0]} and {tied_pair[1]} hold the same values (tied embeddings)"
            raise UsageError(f"{said}: FSDP holds a tied parameter once among the optimizer's parameters, which "
                             f"{option('optim_form', form)} does not lay out ({option('optim_form', 'named')} does)")
    options: dict[str, Any] = {"optim_form": form}
    optimizer = OPTIMIZER_FORMS[form]
    if form == "orig":
        options["orig_alignment"] = source.get("orig_alignment")
        optimizer += (f", parameters aligned to {options['orig_alignment']} elements as in the source"
                      if options["orig_alignment"] else
                      ", parameters aligned for their own dtype (a MixedPrecision param_dtype would move them: resume "
                      "from a use_orig_params=True save of 2+ ranks to take the alignment from it)")
    said = "ShardedTensor"
    if kind == "dtensor":
        mesh = source.get("mesh")
        names = (tuple(mesh["dim_names"]) if mesh["dim_names"] else None) if mesh else VERL_MESH_DIM_NAMES
        options.update(mesh_device=device or (mesh or {}).get("device_type") or "cuda", mesh_dim_names=names)
        said = f"DTensor on a 1-D {options['mesh_device']} mesh named {names}"
    return options, f"model values: {said}; optimizer: {optimizer}"


def _looks_tied(checkpoint: Checkpoint) -> tuple[str, str] | None:
    """The input and output embeddings when they hold the same first MiB of values, as tied ones do (the
    files do not record a tie: a tied model saves the one tensor under both names); else None."""
    params = selection.model_part(checkpoint)
    for a, b in models.embedding_pairs(params):
        first, second = params[a], params[b]
        if first.shape != second.shape or first.dtype != second.dtype or not first.shape:
            continue
        row = math.prod(first.shape[1:]) * dtypes.dtype(first.dtype).itemsize
        sizes = (max(1, min(first.shape[0], 2**20 // max(row, 1))),) + tuple(first.shape[1:])
        nbytes = math.prod(sizes) * dtypes.dtype(first.dtype).itemsize
        scratch = memoryview(bytearray(max(nbytes, 2**16)))
        values = [checkpoint.region_in(t, (0,) * len(sizes), sizes, bytearray(nbytes), scratch).tobytes()
                  for t in (first, second)]
        if values[0] == values[1]:
            return a, b
    return None
