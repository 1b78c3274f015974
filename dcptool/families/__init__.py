"""Naming families: the registry that finds them, and the one way to rename entries to a family.

A family is one module (or package) of this package that defines ``FAMILY``, an instance of a
``family_interface.Family`` subclass: Hugging Face's names, AReaL Archon's, torchtitan's, Megatron-Core's.
The registry lists the package, so a new family is one new module and nothing else names it: callers ask
what a family declares and never compare a family's name.

``rename`` is what every command that renames calls (convert, reshard, import-hf, export-hf, verify and
those pairing checkpoints as it does, LoRA's peft names): it finds the names' family and model kind,
completes the model's config with what the checkpoint says of its run, maps the entries (a whole training
state's optimizer state following its weights, moved to where the target's engine keeps it), refuses names
no table knows, and gives the entries back with the config, the notes and a config.json made from the run.

>>> sorted(names())
['archon', 'hf', 'megatron', 'torchtitan']
>>> get("torchtitan").engine_state.optimizer, get("hf").engine_state
(('optimizer',), None)
>>> renamed = rename({"layers.0.attention.wq.weight": wq}, "hf", config=qwen3_config)     # doctest: +SKIP
>>> list(renamed.entries), renamed.notes                                                 # doctest: +SKIP
(['model.layers.0.self_attn.q_proj.weight'], ['names: archon (qwen3), written as hf'])
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, fields
from functools import cache
from typing import TYPE_CHECKING, Any

from dcptool import models
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.errors import UsageError, counted, option
from dcptool.family_interface import Family, FamilyOptions, Mapping
from dcptool.selection import model_wrapper, optimizer_root

# The renaming machinery (dcptool.renaming, and views under it) is imported where it is used: the command line
# lists the families as it starts, and most commands rename nothing.
if TYPE_CHECKING:
    from dcptool.renaming import Entry

AUTO = "auto"  # a source family found from the names


@cache
def all_families() -> dict[str, Family]:
    """Every family, by name, in the order of their ranks: the ``FAMILY`` of each module of this package."""
    found = [importlib.import_module(f"{__name__}.{module.name}").FAMILY for module in pkgutil.iter_modules(__path__)]
    return {family.name: family for family in sorted(found, key=lambda family: family.rank)}


def names() -> list[str]:
    """The families' names, in the order of their ranks (the command line's choices)."""
    return list(all_families())


def described(separator: str = ", ", last: str = " or ") -> str:
    """Every family's name with its description, for the command line's help: ``hf (...), archon (...) or ...``."""
    parts = [f"{family.name} ({family.description})" for family in all_families().values()]
    return separator.join(parts[:-1]) + last + parts[-1] if len(parts) > 1 else "".join(parts)


def get(name: str) -> Family:
    try:
        return all_families()[name]
    except KeyError:
        raise UsageError(f"{option('family', name)}: choose one of {', '.join(names())}") from None


def hub() -> Family:
    """The family every other maps to and from (HF's names)."""
    return next(family for family in all_families().values() if family.hub)


def detect(names) -> Family | None:
    """The family that names the most of ``names`` (the highest ``detect_priority`` among equals, then the lowest
    rank); None if none names any."""
    names = list(names)
    scores = {family: family.score(names) for family in all_families().values()}
    best = max(scores, key=lambda family: (scores[family], family.detect_priority, -family.rank))
    return best if scores[best] else None


def kind_of(names, family: Family, config: dict | None) -> str:
    """The model kind: the config's ``model_type`` when there is a config, else judged from the names (the
    family's ``kind_of``)."""
    config = models.text_config(config)
    kinds = models.kinds()
    if config.get("model_type"):
        kind = config["model_type"]
        if kind not in kinds:
            raise UsageError(f"config.json: model_type {kind!r} has no naming table (known: {', '.join(kinds)})")
        return kind
    return family.kind_of(list(names))


def given(name: str, **values) -> FamilyOptions | None:
    """The options of family ``name`` set to ``values`` (None: not given), as ``dcptool.family_options`` builds them;
    None for a family that takes none and none given. A value the family does not take is refused, naming the
    families that take it.

    >>> given("hf", hf_experts="fused")
    HfFamilyOptions(hf_experts='fused')
    >>> given("hf", make_vocab_size_divisible_by=64)
    Traceback (most recent call last):
    dcptool.errors.UsageError: make_vocab_size_divisible_by goes with family='megatron'
    """
    family = get(name)
    taken = {f.name for f in fields(family.options_type)} if family.options_type else set()
    for key, value in values.items():
        if value is not None and key not in taken:
            takers = [option("family", other.name) for other in all_families().values()
                      if other.options_type and key in {f.name for f in fields(other.options_type)}]
            raise UsageError(f"{option(key)} goes with {' or '.join(takers)}" if takers else
                             f"{option(key)}: no naming family takes it")
    chosen = {key: value for key, value in values.items() if key in taken and value is not None}
    return family.options_type(**chosen) if family.options_type else None


def options_for(family: Family, mesh: dict, dtype: str | None, chosen: FamilyOptions | None = None) -> Any:
    """What ``family``'s mapping writes for: an output on ``mesh`` in ``dtype`` with the caller's ``chosen`` options
    (``given``); options of another family are refused, naming it."""
    if chosen is not None and not isinstance(chosen, family.options_type or ()):
        owner = next((other.name for other in all_families().values() if isinstance(chosen, other.options_type or ())),
                     None)
        raise UsageError(f"{type(chosen).__name__} goes with {option('family', owner)}, not {option('family', family.name)}")
    return family.options(mesh, dtype, chosen)


def make_mapping(kind: str, source: Family, target: Family, config: dict | None, options: Any = None,
                 where: str = "") -> Mapping:
    """The mapping of model ``kind`` from ``source``'s names to ``target``'s: one a family gives of its own
    (through the hub's names), else the rows'. ``options``: the target's (``options_for``)."""
    from dcptool.renaming import TableMapping

    model = models.kinds()[kind]
    for family in (source, target):
        if not family.names_kind(model):
            known = ", ".join(other.name for other in all_families().values() if other.names_kind(model))
            raise UsageError(f"{kind} has no {family.name} names in dcptool's tables ({family.name} has no such "
                             f"model); its names: {known} ({option('family')})")
    for family in (source, target):
        own = family.mapping(kind, source, target, config, options, where, hub())
        if own is not None:
            return own
    return TableMapping(kind, source, target, config, fused=target.fused_experts(options))


def untranslatable(names, kind: str, source: Family, target: Family, config: dict | None) -> list[str]:
    """The names of ``source``'s weights whose tensors ``target``'s names have no place for."""
    return make_mapping(kind, source, target, config).untranslatable(list(names))


@dataclass
class Renamed:
    """Entries renamed to a family: the entries (the whole state's, when a checkpoint's state was renamed), the
    family found and the mapping used (None: the names stay), the model's config as used (the one given,
    completed by what the checkpoint says of its run), one note a line, and with ``make_config`` the config.json
    made from what the checkpoint says of its run (None where it says nothing)."""

    entries: dict[str, Entry]
    family: Family | None = None
    mapping: Mapping | None = None
    config: dict | None = None
    notes: list[str] = field(default_factory=list)
    made_config: dict | None = None
    laid_out: bool = False  # moved to where the target's engine keeps them

    @property
    def changed(self) -> bool:
        return self.mapping is not None or self.laid_out


def rename(weights: dict[str, Entry], to: str | None = None, *, source: str = AUTO, config: dict | None = None,
           run: dict | None = None, options: Any = None, where: str = "", hint: str = "",
           state: Checkpoint | None = None, make_config: bool = False, without_tied: bool = False,
           compare_with: dict[str, TensorInfo] | None = None) -> Renamed:
    """``weights`` (a model's, by name) under family ``to``'s names (None: the source's).

    Args:
        source: the family of their names (``"auto"``: the one that names the most of them).
        config: the model's HF config.json (head counts, expert counts, ties), completed by what ``run`` (the
            checkpoint's ``info``) says of its training run.
        options: ``to``'s options object (``options_for``): HF's fused experts, Megatron's vocabulary padding.
        where: the checkpoint, named in refusals; ``hint``: what a refusal of unknown names suggests.
        state: the checkpoint whose whole training state follows its weights (optimizer state renamed with them,
            what only the source's engine keeps left out, what the target's needs made), moved to where the
            target's engine keeps it (``Family.engine_state``); None: only ``weights`` are renamed.
        make_config: also make a config.json from what ``run`` says (``Renamed.made_config``).
        without_tied: leave out output weights the config ties to the embedding (an HF folder's files have none).
        compare_with: the weights (of another family) the renamed ones will be compared with.

    Returns:
        ``Renamed``. Names no table of the family knows are refused (``UsageError``), so nothing is silently
        dropped or left misnamed.

    Example:
        >>> renamed = rename(model_part(checkpoint), "hf", config=config, where="step-100")   # doctest: +SKIP
    """
    from dcptool.renaming import convert_state, in_engine_state

    names = list(weights)
    family = detect(names) if source == AUTO else get(source)
    target = get(to) if to is not None else family
    if family is None and source == AUTO and target is not None and not target.hub:
        shown = ", ".join(names[:5])
        raise UsageError(f"cannot tell which family names these weights ({shown} ...): give {option('family')}")
    renamed = Renamed(dict(weights) if state is None else {**state.tensors, **state.objects}, family, config=config)
    if family is not None:
        renamed.config = family.completed_config(config, run or {})
        if compare_with is not None:
            renamed.config = family.config_to_compare(renamed.config, compare_with)
        _map(renamed, names, target, options, where, to is not None)
    mapping = renamed.mapping
    if make_config and mapping is not None:
        renamed.made_config, lines = mapping.source.config_from_run(mapping.kind, run or {})
        renamed.notes += lines
    if mapping is not None:
        result = convert_state(mapping, renamed.entries, weights) if state is not None else mapping.convert(weights)
        _refuse_unmatched(result.unmatched, mapping, hint)
        renamed.entries = result.entries if state is not None else {n: e for n, (e, _) in result.entries.items()}
        renamed.notes += [f"left out {line}" for line in result.dropped] + [f"made {line}" for line in result.made]
    if state is not None and to is not None and target.engine_state is not None:
        renamed.entries, lines = in_engine_state(renamed.entries, model_wrapper(state), optimizer_root(state),
                                                 target.engine_state)
        renamed.notes += lines
        renamed.laid_out = True
    if without_tied and target is not None:  # transformers recreates a tied output from the embedding
        for output in models.tied_outputs(renamed.config, target.name):
            if renamed.entries.pop(output, None) is not None:
                renamed.notes.append(f"left out {output}: the config ties it to the embedding")
    return renamed


def _map(renamed: Renamed, names: list[str], target: Family, options: Any, where: str, asked: bool) -> None:
    """The mapping from ``renamed.family`` to ``target`` (none when the names stay as they are), and the line
    saying which family and kind were found (when a target was ``asked`` for, or the names change)."""
    family = renamed.family
    fused = target.fused_experts(options)
    if family is target and not fused:
        note = f"names: {family.name}"
    else:
        kind = kind_of(names, family, renamed.config)
        renamed.mapping = make_mapping(kind, family, target, renamed.config, options, where)
        note = f"names: {family.name} ({kind}), written as {target.name}" + (" with fused experts" if fused else "")
    if renamed.mapping is not None or asked:
        renamed.notes.append(note)


def _refuse_unmatched(unmatched: list[str], mapping: Mapping, hint: str) -> None:
    """Keys no row of the table names: refused, so nothing is silently dropped or left misnamed."""
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else "")
        raise UsageError(f"{counted(len(unmatched), 'key')} match{'es' if len(unmatched) == 1 else ''} no "
                         f"{mapping.source.name} name of a {mapping.kind} model: {shown} ({hint})")


__all__ = ["AUTO", "Family", "FamilyOptions", "Renamed", "all_families", "detect", "get", "given", "hub", "kind_of",
           "make_mapping", "names", "options_for", "rename", "untranslatable"]
