"""Two checkpoints paired for a comparison: their entries under the names they are compared by.

``verify``, ``diff``, ``average`` and ``checksum --against`` pair checkpoints of any formats, layouts and naming
families this way. A training state against a model-only checkpoint (its HF export) pairs the model parts, the
rest left out; two checkpoints that keep their model at different places (``model.``, the top level) pair entry
for entry and say how the layouts differ; weights of different naming families are renamed to one family
(``dcptool.families``).

>>> pairing = sides("step-1000", "hf-out")                      # doctest: +SKIP
>>> pairing.left_out[:1], pairing.note                          # doctest: +SKIP
(['optimizer.state.model.norm.weight.exp_avg'], None)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dcptool import families, formats, models, selection
from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo, join_path
from dcptool.errors import UsageError, option
from dcptool.planning import quant
from dcptool.state_dicts import split_object
from dcptool.torch_archive import Unpicklable

AUTO = "auto"  # as a prefix: the model part, found as export-hf finds it


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
    # A's tensors hold more than B's, or B's are quantized (a stack of them in A's names would lose their scales):
    # map A onto B's names instead
    if found_a.more_than_others or (_quantized(params_b) and not _quantized(params_a)):
        if not any(tensor.chunks for tensor in params_a.values()):  # a manifest's description, no bytes
            raise UsageError(f"{a.checkpoint.root}: a manifest in {found_a.name} names cannot check {found_b.name} "
                             f"names ({found_a.more_than_others}): write the manifest of {b.checkpoint.root} "
                             f"(checksum with {option('write', True)}) and check the {found_a.name} checkpoint against it")
        side_b, side_a, note = _mapped_onto(b, a, found_b, found_a, "A", include, exclude, config_dir)
        return side_a, side_b, note
    return _mapped_onto(a, b, found_a, found_b, "B", include, exclude, config_dir)


def _quantized(tensors: dict) -> bool:
    """Whether any of ``tensors`` is a quantized one folded with its scales (``quant.folded``)."""
    stored = (quant.Fp8Stored, quant.Mxfp4Stored)
    return any(isinstance(getattr(t, "transform", None), stored) for t in tensors.values())


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
class StateRoots:
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


def roots_of(checkpoint: Checkpoint) -> StateRoots:
    """Where ``checkpoint`` keeps its model part and optimizer state (``selection.model_part`` finds the model part)."""
    # A flat torch.save of a whole training state ({"dcp.optim.state.w.exp_avg": ...}) is no model only.
    training_keys = any(_TRAINING_ROOTS & set(key.split(".")) for key in checkpoint.tensors)
    return StateRoots(selection.model_wrapper(checkpoint) or (), selection.optimizer_root(checkpoint),
                     not _outside_model(checkpoint) and not training_keys)


def _roots_difference(a: StateRoots, b: StateRoots) -> str | None:
    """"A has model at `model.`, B at top level": the parts of two layouts that differ, or None."""
    parts = " ".join(p for p, differs in (("model", a.model != b.model), ("optimizer", a.optimizer != b.optimizer))
                     if differs and (p == "model" or None not in (a.optimizer, b.optimizer)))
    if not parts:
        return None
    said_b = b.describe(parts).removeprefix("model ") if parts == "model" else f"has {b.describe(parts)}"
    return f"A has {a.describe(parts)}, B {said_b}"  # "A has model at `model.`, B at top level"


def normalized(checkpoint: Checkpoint, roots: StateRoots) -> tuple[dict[str, TensorInfo], dict[str, ObjectInfo]]:
    """Every entry under the name it would have in a torchtitan layout: model weights at the top level, the
    optimizer under ``optimizer.``, the rest as it is (less a wrapper shared with the model, AReaL's ``dcp.``);
    two training checkpoints of different layouts compare entry for entry under these names."""
    tensors = selection.model_part(checkpoint)
    objects = selection.model_part(checkpoint, entries=checkpoint.objects)
    model = {id(e) for e in [*tensors.values(), *objects.values()]}
    parent = roots.model[:-1]
    for entries, named in ((checkpoint.tensors, tensors), (checkpoint.objects, objects)):
        for entry in entries.values():
            if id(entry) in model:
                continue
            path = entry.path[len(parent):] if entry.path[:len(parent)] == parent else entry.path
            if roots.optimizer is not None and tuple(entry.path[:len(roots.optimizer)]) == roots.optimizer:
                path = ("optimizer", *entry.path[len(roots.optimizer):])
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
    models) nested differently compare entry for entry under ``normalized`` names, and the layout
    difference is reported (not between two models in different formats: an export), where those
    names match more entries than the keys as given (a flat
    torch.save of the state, ``{"dcp.model.w": ...}``, has no nesting to tell: its keys are compared).
    Weights of different naming families are matched by ``align_families`` (with ``config_dir``'s config.json).
    A block-scaled float8 weight and its ``X_scale_inv`` are one tensor (``quant.folded``): verify quantizes the
    other side with its scales, diff dequantizes it.
    """
    checkpoint_a, _ = quant.folded(formats.open_checkpoint(a, format_a))
    checkpoint_b, _ = quant.folded(formats.open_checkpoint(b, format_b))
    return pair(checkpoint_a, checkpoint_b, prefix_a=prefix_a, prefix_b=prefix_b, include=include, exclude=exclude,
                family_a=family_a, family_b=family_b, config_dir=config_dir)


def pair(checkpoint_a: Checkpoint, checkpoint_b: Checkpoint, *, prefix_a: str | None = None,
         prefix_b: str | None = None, include: str | None = None, exclude: str | None = None,
         family_a: str = AUTO, family_b: str = AUTO, config_dir: str | Path | None = None) -> Pairing:
    """``sides`` of two open checkpoints (``average`` pairs every source with the first this way, with the
    config.json of ``config_dir`` where names are mapped across families)."""
    pairing = Pairing(select_side(checkpoint_a, prefix_a, include, exclude),
                      select_side(checkpoint_b, prefix_b, include, exclude))
    if not (prefix_a or prefix_b):
        layout_a, layout_b = roots_of(checkpoint_a), roots_of(checkpoint_b)
        if layout_a.model_only != layout_b.model_only:  # a training state against its export: its model part
            training_a = layout_b.model_only
            pairing.a = select_side(checkpoint_a, AUTO if training_a else None, include, exclude)
            pairing.b = select_side(checkpoint_b, None if training_a else AUTO, include, exclude)
            pairing.left_out = _outside_model(checkpoint_a if training_a else checkpoint_b)
            pairing.left_out_why = f"{'B' if training_a else 'A'} holds a model only"
            if checkpoint_a.format == checkpoint_b.format:  # not an export: a job loads both, the model where it sits
                pairing.layout = _roots_difference(layout_a, layout_b)
        elif layout_a != layout_b:
            normalized_a = _side(checkpoint_a, *normalized(checkpoint_a, layout_a), include, exclude)
            normalized_b = _side(checkpoint_b, *normalized(checkpoint_b, layout_b), include, exclude)
            if _shared(normalized_a, normalized_b) > _shared(pairing.a, pairing.b):
                pairing.a, pairing.b = normalized_a, normalized_b
                exported = layout_a.model_only and checkpoint_a.format != checkpoint_b.format  # {"model": ...} vs HF
                pairing.layout = None if exported else _roots_difference(layout_a, layout_b)
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
