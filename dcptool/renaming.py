"""Renaming between naming families: the model kinds' rows as names, and a whole training state renamed.

Each model kind (``dcptool.models``) lists its parameters as rows: each under every family's name
and how its layout differs (grouped experts, transformers v5's fused experts, Llama's
RoPE-interleaved q/k rows). ``TableMapping`` turns entries of one family into another's as views of the
source's chunks (``dcptool.engine.views``), so renaming costs planning, not bytes; what each family's names do
(experts apart or grouped, q/k rows in halves or pairs) is what it declares (``family_interface.Family``).
``convert_state`` renames a whole training state: optimizer state follows its parameter, and each family
says what of its engine's own state goes or is made; ``in_engine_state`` moves the entries to where the target's
engine keeps them. The families themselves and the one entry point are ``dcptool.families``.

>>> mapping = TableMapping("qwen3_moe", archon, hf, config={})                          # doctest: +SKIP
>>> result = mapping.convert({"layers.0.moe.experts.w1": grouped_w1})                  # doctest: +SKIP
>>> sorted(result.entries)[:1]                                                          # doctest: +SKIP
['model.layers.0.mlp.experts.0.gate_proj.weight']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Union

from dcptool import models
from dcptool.engine import views
from dcptool.engine.core import ObjectInfo, TensorInfo, join_path
from dcptool.errors import UsageError, option
from dcptool.models import Row
from dcptool.selection import NON_MODEL_ROOTS

Entry = Union[TensorInfo, ObjectInfo]

# A layer or expert number: a whole dot-separated part of a name.
_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")


@cache
def _index(kind: str, family) -> dict[str, list[tuple[Row, tuple[str, ...], str]]]:
    """Names of a family's table by their shape (numbers as ``#``): ``(row, what each number is, form)``,
    form being plain, expert (one tensor per expert, in a family that keeps them apart) or fused (a part of
    transformers v5's fused tensor). Looking a name up is one dict access, however many rows and names there are."""
    index: dict[str, list] = {}
    for row in models.kinds()[kind].rows:
        name = row.name(family.name)
        if name is None:
            continue
        forms = [(name, "expert" if family.experts_apart and row.experts else "plain")]
        if family.experts_apart and row.fused:
            forms.append((row.fused[0], "fused"))
        for pattern, form in forms:
            fields = tuple(re.findall(r"\{(L|E)\}", pattern))
            index.setdefault(re.sub(r"\{(L|E)\}", "#", pattern), []).append((row, fields, form))
    return index


def _matches(kind: str, family, name: str) -> list[tuple[Row, dict, str]]:
    """Every row a name matches in a family: one, or the parts of a fused tensor."""
    found = _index(kind, family).get(_NUMBER.sub("#", name), [])
    numbers = _NUMBER.findall(name)
    return [(row, dict(zip(fields, numbers)), form) for row, fields, form in found if len(fields) == len(numbers)]


def table_score(family, names) -> int:
    """How many of ``names`` some model kind's table names in ``family``'s column."""
    known = set().union(*(_index(kind, family) for kind in models.kinds()))
    return sum(_NUMBER.sub("#", name) in known for name in names)


def table_kind(family, names) -> str:
    """The model kind whose table in ``family``'s column names the most of ``names``, the one with the fewest
    rows among equals (a dense Qwen3 fits Qwen3-MoE's table too, Llama's names Qwen2's and Qwen3's); a kind that is
    another's architecture under its own config (Kimi-K2) is told by its config only."""
    kinds = {name: kind for name, kind in models.kinds().items() if kind.architecture_of is None}
    shapes = [_NUMBER.sub("#", name) for name in names]
    scores = {kind: sum(shape in _index(kind, family) for shape in shapes) for kind in kinds}
    return max(kinds, key=lambda kind: (scores[kind], -len(kinds[kind].rows)))


@dataclass
class Result:
    """What a mapping made: new name -> (entry, the source name it follows), and what it left out, with why."""

    entries: dict[str, tuple[Entry, str]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)
    made: list[str] = field(default_factory=list)  # entries the source has no bytes of its own for


class TableMapping:
    """Entries of model ``kind`` from family ``source`` to family ``target`` (``family_interface.Family``
    objects whose names are columns of the kind's rows), row by row.

    ``config`` is the model's HF ``config.json`` (head counts for Llama's RoPE permutation, the
    expert count, tied embeddings); ``fused``: experts the target keeps apart are written in transformers v5's
    fused layout instead of one tensor per expert, as the hub's checkpoints hold them.
    """

    def __init__(self, kind: str, source, target, config: dict | None, fused: bool = False):
        self.kind, self.source, self.target = kind, source, target
        self.model = models.kinds()[kind]
        self.config = models.text_config(config)
        self.fused = fused and target.experts_apart
        # Experts per (row, layer), from the weights: per-expert optimizer counters follow them.
        self._experts: dict[tuple[Row, str], int] = {}

    def convert(self, entries: dict[str, Entry], model: bool = True) -> Result:
        """Map ``entries`` (name -> tensor or object). ``model``: these are the weights themselves, so
        tied embeddings are completed; optimizer state (same names, scalars for ``step``) is not."""
        result = Result()
        groups: dict[tuple[Row, str], dict] = {}
        main_layers = self._main_layers(entries)
        for name, entry in entries.items():
            hits = self._hits(name, main_layers)
            if not hits:
                result.unmatched.append(name)
                continue
            for row, where, form in hits:
                if row.name(self.target.name) is None:
                    result.dropped.append(f"{name} ({self.target.name} names have no such tensor)")
                    break
                group = groups.setdefault((row, where.get("L", "")), {"first": name})
                if form == "expert":
                    group.setdefault("experts", {})[int(where["E"])] = entry
                elif form == "fused":
                    group["fused"] = entry
                else:
                    group["plain"] = entry
        fused_parts: dict[str, list[tuple[int, TensorInfo]]] = {}
        for (row, layer), group in groups.items():
            logical = self._logical(row, layer, group)
            target_layer = self._target_layer(row, layer, main_layers, group["first"])
            target = row.name(self.target.name).replace("{L}", target_layer)
            if self.target.experts_apart and row.experts and self.fused:
                fused_parts.setdefault(row.fused[0].replace("{L}", target_layer), []).append(
                    (row.fused[1], logical, group["first"]))
                continue
            if self.target.experts_apart and row.experts:
                self._split_experts(target, logical, self._experts.get((row, layer)), group["first"], result)
                continue
            if row.rope_heads and self.target.rope_halves and not self.source.rope_halves:
                logical = self._permuted(logical, row, to_halves=True)
            result.entries[target] = (_named(logical, target), group["first"])
        for name, parts in fused_parts.items():
            parts.sort(key=lambda part: part[0])
            ordered = [tensor for _, tensor, _ in parts]
            combined = ordered[0] if _scalar(ordered[0]) else views.cat(ordered, 1, (name,))
            result.entries[name] = (_named(combined, name), parts[0][2])
        if model:
            self._tie(entries, result)
        return result

    def _main_layers(self, entries) -> int | None:
        """The main decoder layers, after which HF numbers the prediction layers: the config's
        ``num_hidden_layers``, else those the names hold (in names that number prediction layers after the main
        ones, the layers before the first with a prediction layer's own tensors; None: no prediction layers)."""
        if isinstance(self.config.get("num_hidden_layers"), int):
            return self.config["num_hidden_layers"]
        if self.source.predictions_after_main:  # the first layer holding what only prediction layers have (enorm, eh_proj)
            only_mtp = [(row, where) for name in entries for row, where, _ in _matches(self.kind, self.source, name)
                        if row.mtp and not any(not other.mtp for other, _, _ in _matches(self.kind, self.source, name))]
            return min((int(where["L"]) for _, where in only_mtp), default=None)
        numbers = {name.split(".")[1] for name in entries if name.startswith("layers.")}
        return len(numbers) or None

    def _hits(self, name: str, main_layers: int | None) -> list[tuple[Row, dict, str]]:
        """The rows a name matches; where prediction layers are numbered after the main ones, a layer after them
        is one."""
        hits = _matches(self.kind, self.source, name)
        if not self.source.predictions_after_main:
            return hits
        return [(row, where, form) for row, where, form in hits
                if row.mtp == (main_layers is not None and "L" in where and int(where["L"]) >= main_layers)]

    def _target_layer(self, row: Row, layer: str, main_layers: int | None, name: str) -> str:
        if not row.mtp or self.source.predictions_after_main == self.target.predictions_after_main:
            return layer
        if main_layers is None:
            raise UsageError(f"{name}: numbering prediction layers after the main ones needs num_hidden_layers "
                             f"from the model's config.json (give {option('config_dir')})")
        after = self.source.predictions_after_main
        return str(int(layer) - main_layers if after else int(layer) + main_layers)

    def _logical(self, row: Row, layer: str, group: dict) -> Entry:
        """The entry in torchtitan's layout (grouped experts, RoPE-interleaved rows)."""
        if "plain" in group:
            entry = group["plain"]
            if row.rope_heads and self.source.rope_halves and not self.target.rope_halves:
                return self._permuted(entry, row, to_halves=False)
            return self._remember_experts(row, layer, entry)
        if "fused" in group:
            fused = group["fused"]
            if _scalar(fused):
                return fused
            parts = sum(1 for other in self.model.rows if other.fused and other.fused[0] == row.fused[0])
            width = fused.shape[1] // parts
            return self._remember_experts(row, layer, views.narrow(fused, 1, row.fused[1] * width, width, fused.path))
        experts = group["experts"]
        count = len(experts)
        if sorted(experts) != list(range(count)):
            missing = sorted(set(range(max(experts) + 1)) - set(experts))
            raise UsageError(f"{group['first']}: experts {missing[:8]} of layer {layer} are missing")
        self._check_expert_count(count, group["first"])
        self._experts[(row, layer)] = count
        ordered = [experts[e] for e in range(count)]
        return ordered[0] if _scalar(ordered[0]) else views.stack(ordered, ordered[0].path)

    def _remember_experts(self, row: Row, layer: str, entry: Entry) -> Entry:
        if row.experts and not _scalar(entry):
            self._experts[(row, layer)] = entry.shape[0]
        return entry

    def untranslatable(self, names) -> list[str]:
        """The names whose tensors the target family has no place for (dropped by ``convert``)."""
        main_layers = self._main_layers(names)
        return [n for n in names if any(row.name(self.target.name) is None for row, _, _ in self._hits(n, main_layers))]

    def _split_experts(self, pattern: str, logical: Entry, seen: int | None, first: str, result: Result) -> None:
        if _scalar(logical):
            count = seen or self.model.expert_count(self.config)
            if count is None:
                raise UsageError(f"{first}: splitting per-expert state needs the expert count ({option('config_dir')})")
        else:
            count = logical.shape[0]
            self._check_expert_count(count, first)
        for expert in range(count):
            name = pattern.replace("{E}", str(expert))
            entry = logical if _scalar(logical) else views.select(logical, 0, expert, (name,))
            result.entries[name] = (_named(entry, name), first)

    def _check_expert_count(self, count: int, where: str) -> None:
        expected = self.model.expert_count(self.config)
        if expected is not None and expected != count:
            raise UsageError(f"{where}: {count} experts in the checkpoint, but the config says {expected}")

    def _permuted(self, entry: Entry, row: Row, to_halves: bool) -> Entry:
        """Llama's q/k rows between HF's rotate-half order and torchtitan's interleaved pairs."""
        if _scalar(entry):
            return entry
        heads = self.config.get(row.rope_heads)
        if not isinstance(heads, int) or heads <= 0:
            raise UsageError(f"{entry.key}: {self.kind} q/k rows are permuted between {self.source.name} and "
                             f"{self.target.name} names, which needs "
                             f"{row.rope_heads} from the model's config.json (give {option('config_dir')})")
        rows = entry.shape[0]
        if rows % heads or (rows // heads) % 2:
            raise UsageError(f"{entry.key}: {rows} rows do not split into {heads} heads of even size "
                             f"({row.rope_heads} in config.json)")
        dim, half = rows // heads, rows // heads // 2
        if to_halves:  # HF row (h, part, i) is torchtitan row (h, i, part)
            order = [h * dim + 2 * i + part for h in range(heads) for part in range(2) for i in range(half)]
        else:
            order = [h * dim + part * half + i for h in range(heads) for i in range(half) for part in range(2)]
        return views.permute_rows(entry, order, entry.path)

    def _tie(self, entries: dict[str, Entry], result: Result) -> None:
        """An HF model with tied embeddings saves no lm_head: torchtitan's names still hold the output weight."""
        if not self.source.may_omit_tied_output or self.target.may_omit_tied_output:
            return
        for tie in models.active_ties(self.config, self.model):
            output, embedding = tie.output.name(self.source.name), tie.embedding.name(self.source.name)
            if output in entries or embedding not in entries:
                continue
            name, source = tie.output.name(self.target.name), embedding
            result.entries[name] = (_named(entries[source], name), source)
            result.made.append(f"{name} from {source} (the config ties them)")


def _scalar(entry: Entry) -> bool:
    """Optimizer step counters and objects: one per parameter, whatever its shape."""
    return not isinstance(entry, TensorInfo) or not entry.shape


def _named(entry: Entry, name: str) -> Entry:
    if isinstance(entry, TensorInfo):
        return views.renamed(entry, (name,))
    return ObjectInfo((name,), entry.blob, entry.value)


@dataclass
class StateResult:
    """A whole training state mapped: every entry under its new key (and path), and what was left out."""

    entries: dict[str, Entry]
    dropped: list[str]
    unmatched: list[str]
    made: list[str]


def convert_state(mapping, entries: dict[str, Entry], params: dict[str, TensorInfo]) -> StateResult:
    """Map every entry of a checkpoint: model weights and each slot of optimizer state that names them.

    ``params`` are the model's weights by their names (``convert.model_part``). An entry whose key
    holds a weight's name (``optim.state.<name>.exp_avg``, ``optimizer.param_groups.<name>.lr``)
    follows that weight's new name and layout; entries that name no weight (``train_state``) stay, but
    for those only the source's engine keeps (``Family.own_state``); the target's engine gets what it needs
    beside the weights (``Family.made_state``).
    """
    name_of = {id(tensor): name for name, tensor in params.items()}
    slots: dict[tuple[str, str], dict[str, tuple[str, Entry]]] = {}
    kept: dict[str, Entry] = {}
    for key, entry in entries.items():
        name = name_of.get(id(entry))
        if name is not None and key.endswith(name):
            slot = (key[: len(key) - len(name)], "")
        else:
            name, slot = _named_inside(key, params)
            if name is None:
                kept[key] = entry
                continue
        slots.setdefault(slot, {})[name] = (key, entry)
    out, dropped, unmatched, made = dict(kept), [], [], []
    weights: dict[str, Entry] = {}  # the model's, in the target's names
    if mapping.source is not mapping.target:  # what only the source's engine keeps
        own, lines = mapping.source.own_state(list(kept), mapping.target)
        for key in own:
            del out[key]
        dropped += lines
    # The weights first: the optimizer state after them takes their expert counts.
    for (prefix, suffix), named in sorted(slots.items(), key=lambda slot: bool(slot[0][1])):
        result = mapping.convert({name: entry for name, (_, entry) in named.items()}, model=not suffix)
        dropped += [f"{prefix}{line}" for line in result.dropped]
        made += [f"{prefix}{line}" for line in result.made]
        unmatched += [named[name][0] for name in result.unmatched]
        ordered = _slot_order(mapping, prefix, suffix)
        for new_name, (entry, first) in result.entries.items():
            source_key, source_entry = named[first]
            if ordered is None:
                key = prefix + new_name + suffix
                path = _path_for(source_entry.path, source_key, len(prefix), first, new_name, key)
            else:
                key, path = ordered(new_name)
            out[key] = with_path(entry, path)
            if not suffix:
                weights[new_name] = entry
    if mapping.source is not mapping.target:
        made += mapping.target.made_state(mapping, weights, out)
    return StateResult(out, dropped, unmatched, list(dict.fromkeys(made)))  # a line per slot would repeat


# A key of state by slot, then parameter: ``optimizer.state.exp_avg.`` before the parameter's name.
_SLOT_FIRST = re.compile(r"^(.*?)\.?\bstate\.(\w+)\.$")


def _slot_order(mapping, prefix: str, suffix: str):
    """Megatron keeps a parameter's optimizer state as ``optimizer.state.<slot>.<name>``, flat; torch's optimizers
    as ``optimizer.state.<name>.<slot>``, nested (``Family.slots_before_names``). Between them the slot moves,
    and this gives ``name -> (key, path)``; None where the slot stays where it is."""
    before, after = mapping.source.slots_before_names, mapping.target.slots_before_names
    if before and not after and not suffix:
        match = _SLOT_FIRST.match(prefix)
        if match:
            root = tuple(match[1].split(".")) if match[1] else ()
            return lambda name: (join_path((*root, "state", name, match[2])), (*root, "state", name, match[2]))
    if after and not before and prefix.endswith("state.") and re.fullmatch(r"\.\w+", suffix):
        return lambda name: ((key := f"{prefix}{suffix[1:]}.{name}"), (key,))
    return None


def _named_inside(key: str, params: dict[str, TensorInfo]) -> tuple[str | None, tuple[str, str]]:
    """The longest weight name that is a run of ``key``'s dot-separated parts, and the prefix and suffix around it."""
    parts = key.split(".")
    best = None
    for start in range(len(parts)):
        for stop in range(len(parts), start, -1):
            if best and stop - start <= best[1] - best[0]:
                break
            if ".".join(parts[start:stop]) in params:
                best = (start, stop)
                break
    if best is None:
        return None, ("", "")
    start, stop = best
    prefix = "".join(p + "." for p in parts[:start])
    suffix = "".join("." + p for p in parts[stop:])
    return ".".join(parts[start:stop]), (prefix, suffix)


def _path_for(path: tuple, key: str, at: int, old: str, new: str, new_key: str) -> tuple:
    """The nested path of the renamed entry: the path element that held the old name holds the new one."""
    position = 0
    for index, part in enumerate(path):
        text = str(part)
        if position <= at and at + len(old) <= position + len(text) and isinstance(part, str):
            inner = at - position
            return (*path[:index], text[:inner] + new + text[inner + len(old):], *path[index + 1:])
        position += len(text) + 1
    return (new_key,)


def with_path(entry: Entry, path: tuple) -> Entry:
    if isinstance(entry, TensorInfo):
        return views.renamed(entry, path)
    return ObjectInfo(path, entry.blob, entry.value)


def in_engine_state(entries: dict[str, Entry], model_root: tuple[str, ...] | None,
                    optimizer_root: tuple[str, ...] | None, engine) -> tuple[dict[str, Entry], list[str]]:
    """``entries`` moved to where ``engine``'s job keeps them (an ``EngineState``), and notes on what it does not load.

    The model's entries are those under ``model_root`` (None: the tensors at the top level that are no
    other state), the optimizer's those under ``optimizer_root``; each keeps the rest of its path
    (``("dcp", "optim", "state", "<fqn>", "exp_avg")`` -> ``("optimizer", "state", "<fqn>", "exp_avg")``).
    Other entries (lr scheduler, dataloader, train state) keep their paths and their meaning.
    """
    moved: dict[str, Entry] = {}
    others = set()
    for entry in entries.values():
        path = entry.path
        if optimizer_root and len(path) > len(optimizer_root) and path[: len(optimizer_root)] == optimizer_root:
            path = engine.optimizer + path[len(optimizer_root):]
        elif model_root and len(path) > len(model_root) and path[: len(model_root)] == model_root:
            path = engine.model + path[len(model_root):]
        elif model_root is None and isinstance(entry, TensorInfo) and str(path[0]) not in NON_MODEL_ROOTS:
            path = engine.model + path
        else:
            others.add(str(path[0]))
        key = join_path(path)
        if key in moved:
            raise UsageError(f"{key}: two entries of the source land on this key where {engine.engine} keeps them")
        moved[key] = with_path(entry, path)
    notes = []
    missing = [root for root in engine.also_loads if root not in others]
    if missing:
        notes.append(f"{engine.engine} also loads {', '.join(missing)} when it resumes, and the source holds "
                     f"none: {engine.without_them}")
    roots = {path[0] for path in (engine.model, engine.optimizer) if path}
    kept = sorted(others - set(engine.also_loads) - roots)
    if kept:
        notes.append(f"kept {', '.join(kept)} as saved: {engine.engine} does not load them")
    return moved, notes
