"""Naming families and the adapters between them: Hugging Face, AReaL Archon, torchtitan and Megatron-Core names.

Each model kind (``dcptool.models``) lists its parameters as rows: each under every family's name
and how its layout differs (grouped experts, transformers v5's fused experts, Llama's
RoPE-interleaved q/k rows). ``Mapping`` turns entries of one family into another's as views of the
source's chunks (``dcptool.views``), so an adapter costs planning, not bytes. Megatron-Core's stacked
and fused tensors are taken apart into HF's (``dcptool.adapters.megatron``) and, from there, go on
to any family (``MegatronMapping``).

>>> mapping = Mapping("qwen3_moe", "archon", "hf", config={})                          # doctest: +SKIP
>>> result = mapping.convert({"layers.0.moe.experts.w1": grouped_w1})                  # doctest: +SKIP
>>> sorted(result.entries)[:1]                                                          # doctest: +SKIP
['model.layers.0.mlp.experts.0.gate_proj.weight']
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from typing import Union

from dcptool import models, views
from dcptool.adapters import megatron
from dcptool.core import ObjectInfo, TensorInfo, join_path
from dcptool.errors import UsageError, counted, option
from dcptool.models import FAMILIES, MEGATRON, NAMING_FAMILIES, Row, StateLayout
from dcptool.safe_pickle import record
from dcptool.selection import NON_MODEL_ROOTS

Entry = Union[TensorInfo, ObjectInfo]
HF_EXPERTS = ("per-expert", "fused")

# A layer or expert number: a whole dot-separated part of a name.
_NUMBER = re.compile(r"(?<![^.])\d+(?![^.])")


@cache
def _index(kind: str, family: str) -> dict[str, list[tuple[Row, tuple[str, ...], str]]]:
    """Names of a family's table by their shape (numbers as ``#``): ``(row, what each number is, form)``,
    form being plain, expert (one HF tensor per expert) or fused (a part of transformers v5's fused tensor).
    Looking a name up is one dict access, however many rows and names there are."""
    index: dict[str, list] = {}
    for row in models.kinds()[kind].rows:
        name = row.name(family)
        if name is None:
            continue
        forms = [(name, "expert" if family == "hf" and row.experts else "plain")]
        if family == "hf" and row.fused:
            forms.append((row.fused[0], "fused"))
        for pattern, form in forms:
            fields = tuple(re.findall(r"\{(L|E)\}", pattern))
            index.setdefault(re.sub(r"\{(L|E)\}", "#", pattern), []).append((row, fields, form))
    return index


def _matches(kind: str, family: str, name: str) -> list[tuple[Row, dict, str]]:
    """Every row a name matches in a family: one, or the parts of a fused tensor."""
    found = _index(kind, family).get(_NUMBER.sub("#", name), [])
    numbers = _NUMBER.findall(name)
    return [(row, dict(zip(fields, numbers)), form) for row, fields, form in found if len(fields) == len(numbers)]


def detect_family(names) -> str | None:
    """The family whose tables name the most of ``names`` (torchtitan before 0.3 reads as archon); None if none."""
    names = list(names)
    shapes = [_NUMBER.sub("#", name) for name in names]
    known = {family: set().union(*(_index(kind, family) for kind in models.kinds())) for family in FAMILIES}
    scores = {family: sum(shape in known[family] for shape in shapes) for family in FAMILIES}
    scores[MEGATRON] = sum(megatron.is_megatron([name]) for name in names)
    best = max(NAMING_FAMILIES, key=lambda f: (scores[f], f == "archon"))  # archon wins its ties with torchtitan
    return best if scores[best] else None


def detect_kind(names, family: str, config: dict | None) -> str:
    """The model kind: the config's ``model_type`` when there is a config, else judged from the names: the
    kind whose table in ``family`` names the most of them, the one with the fewest rows among equals (a
    dense Qwen3 fits Qwen3-MoE's table too, Llama's names Qwen2's and Qwen3's)."""
    config = models.text_config(config)
    kinds = models.kinds()
    if config.get("model_type"):
        kind = config["model_type"]
        if kind not in kinds:
            raise UsageError(f"config.json: model_type {kind!r} has no naming table (known: {', '.join(kinds)})")
        return kind
    if family == MEGATRON:
        names = list(names)
        found = megatron.kind_of(names)
        if found is None:
            raise megatron.unknown_kind(names)
        return found
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


class Mapping:
    """Entries of model ``kind`` from family ``source`` to family ``target``.

    ``config`` is the model's HF ``config.json`` (head counts for Llama's RoPE permutation, the
    expert count, tied embeddings); ``hf_experts="fused"`` writes HF experts in transformers v5's
    fused layout instead of one tensor per expert, as the hub's checkpoints hold them.
    """

    def __init__(self, kind: str, source: str, target: str, config: dict | None, hf_experts: str = "per-expert"):
        for family in (source, target):
            if family not in FAMILIES:
                raise UsageError(f"{option('adapter', family)}: choose one of {', '.join(FAMILIES)}")
        if hf_experts not in HF_EXPERTS:
            raise UsageError(f"{option('hf_experts', hf_experts)}: choose {' or '.join(HF_EXPERTS)}")
        self.kind, self.source, self.target = kind, source, target
        self.model = models.kinds()[kind]
        named = [family for family in FAMILIES if any(row.name(family) for row in self.model.rows)]
        for family in (source, target):
            if family not in named:
                known = ", ".join(named + ([MEGATRON] if self.model.megatron else []))
                raise UsageError(f"{kind} has no {family} names in dcptool's tables ({family} has no such model); "
                                 f"its names: {known} ({option('adapter')})")
        self.config = models.text_config(config)
        self.fused = hf_experts == "fused" and target == "hf"
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
                if row.name(self.target) is None:
                    result.dropped.append(f"{name} ({self.target} names have no such tensor)")
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
            target = row.name(self.target).replace("{L}", target_layer)
            if self.target == "hf" and row.experts and self.fused:
                fused_parts.setdefault(row.fused[0].replace("{L}", target_layer), []).append(
                    (row.fused[1], logical, group["first"]))
                continue
            if self.target == "hf" and row.experts:
                self._split_experts(target, logical, self._experts.get((row, layer)), group["first"], result)
                continue
            if self.target == "hf" and row.rope_heads:
                logical = self._permuted(logical, row, to_hf=True)
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
        ``num_hidden_layers``, else those the names hold (in HF names, the layers before the first
        with a prediction layer's own tensors; None: no prediction layers)."""
        if isinstance(self.config.get("num_hidden_layers"), int):
            return self.config["num_hidden_layers"]
        if self.source == "hf":  # the first layer holding what only prediction layers have (enorm, eh_proj)
            only_mtp = [(row, where) for name in entries for row, where, _ in _matches(self.kind, "hf", name)
                        if row.mtp and not any(not other.mtp for other, _, _ in _matches(self.kind, "hf", name))]
            return min((int(where["L"]) for _, where in only_mtp), default=None)
        numbers = {name.split(".")[1] for name in entries if name.startswith("layers.")}
        return len(numbers) or None

    def _hits(self, name: str, main_layers: int | None) -> list[tuple[Row, dict, str]]:
        """The rows a name matches; an HF layer is a prediction layer when it comes after the main ones."""
        hits = _matches(self.kind, self.source, name)
        if self.source != "hf":
            return hits
        return [(row, where, form) for row, where, form in hits
                if row.mtp == (main_layers is not None and "L" in where and int(where["L"]) >= main_layers)]

    def _target_layer(self, row: Row, layer: str, main_layers: int | None, name: str) -> str:
        if not row.mtp or (self.source != "hf" and self.target != "hf"):
            return layer
        if main_layers is None:
            raise UsageError(f"{name}: numbering prediction layers after the main ones needs num_hidden_layers "
                             f"from the model's config.json (give {option('config_dir')})")
        return str(int(layer) - main_layers if self.source == "hf" else int(layer) + main_layers)

    def _logical(self, row: Row, layer: str, group: dict) -> Entry:
        """The entry in torchtitan's layout (grouped experts, RoPE-interleaved rows)."""
        if "plain" in group:
            entry = group["plain"]
            if self.source == "hf" and row.rope_heads:
                return self._permuted(entry, row, to_hf=False)
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
        return [n for n in names if any(row.name(self.target) is None for row, _, _ in self._hits(n, main_layers))]

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

    def _permuted(self, entry: Entry, row: Row, to_hf: bool) -> Entry:
        """Llama's q/k rows between HF's rotate-half order and torchtitan's interleaved pairs."""
        if _scalar(entry):
            return entry
        heads = self.config.get(row.rope_heads)
        if not isinstance(heads, int) or heads <= 0:
            raise UsageError(f"{entry.key}: {self.kind} q/k rows are permuted between HF and torchtitan, which needs "
                             f"{row.rope_heads} from the model's config.json (give {option('config_dir')})")
        rows = entry.shape[0]
        if rows % heads or (rows // heads) % 2:
            raise UsageError(f"{entry.key}: {rows} rows do not split into {heads} heads of even size "
                             f"({row.rope_heads} in config.json)")
        dim, half = rows // heads, rows // heads // 2
        if to_hf:  # HF row (h, part, i) is torchtitan row (h, i, part)
            order = [h * dim + 2 * i + part for h in range(heads) for part in range(2) for i in range(half)]
        else:
            order = [h * dim + part * half + i for h in range(heads) for i in range(half) for part in range(2)]
        return views.permute_rows(entry, order, entry.path)

    def _tie(self, entries: dict[str, Entry], result: Result) -> None:
        """An HF model with tied embeddings saves no lm_head: torchtitan's names still hold the output weight."""
        if self.source != "hf" or self.target == "hf":
            return
        for tie in models.active_ties(self.config, self.model):
            if tie.output.hf in entries or tie.embedding.hf not in entries:
                continue
            name, source = tie.output.name(self.target), tie.embedding.hf
            result.entries[name] = (_named(entries[source], name), source)
            result.made.append(f"{name} from {source} (the config ties them)")


class MegatronMapping:
    """Entries of model ``kind`` from or to Megatron-Core's names, through HF's: Megatron's stacked and fused
    tensors taken apart into HF's (``megatron.to_hf``), then mapped on to ``target`` like any HF names; or
    any family's mapped to HF, then put together as Megatron keeps them (``megatron.from_hf``, the
    vocabulary padded as ``output`` says). ``where`` names the checkpoint in refusals."""

    def __init__(self, kind: str, source: str, target: str, config: dict | None, hf_experts: str = "per-expert",
                 output: megatron.MegatronOutput | None = None, where: str = ""):
        for family in (source, target):
            if family not in NAMING_FAMILIES:
                raise UsageError(f"{option('adapter', family)}: choose one of {', '.join(NAMING_FAMILIES)}")
        self.kind, self.source, self.target = kind, source, target
        self.model = models.kinds()[kind]
        if not self.model.megatron:
            raise UsageError(f"{kind} has no Megatron-Core names in dcptool's tables")
        self.config = models.text_config(config)
        self.hf_experts, self.where = hf_experts, where or "the checkpoint"
        self.output = output or megatron.MegatronOutput()

    def convert(self, entries: dict[str, Entry], model: bool = True) -> Result:
        if self.source == MEGATRON:
            # HF's prediction layers repeat the embedding and head: other families keep them once
            hf = megatron.to_hf(self.model, entries, self.config, self.where, mtp_copies=self.target == "hf")
            result = Result(dropped=list(hf.dropped), unmatched=list(hf.unmatched), made=list(hf.made))
            onward = self.target != "hf" or self.hf_experts == "fused"
            if not onward:
                result.entries = dict(hf.entries)
                return result
            after = Mapping(self.kind, "hf", self.target, self.config, self.hf_experts).convert(
                {name: entry for name, (entry, _) in hf.entries.items()}, model)
            result.entries = {name: (entry, hf.entries[first][1]) for name, (entry, first) in after.entries.items()}
            result.dropped += after.dropped
            result.unmatched += [hf.entries[name][1] for name in after.unmatched]
            return result
        result = Result()
        named = entries
        if self.source != "hf":
            before = Mapping(self.kind, self.source, "hf", self.config).convert(entries, model)
            result.dropped, result.unmatched, result.made = before.dropped, before.unmatched, before.made
            firsts = {name: first for name, (_, first) in before.entries.items()}
            named = {name: entry for name, (entry, _) in before.entries.items()}
        else:
            firsts = {name: name for name in entries}
        if model:  # a tied HF model saves no lm_head; Megatron's output_layer is absent when tied too
            for output in models.tied_outputs(self.config):
                named.pop(output, None)
        built = megatron.from_hf(self.model, named, self.config, self.output, self.where)
        result.entries = {name: (entry, firsts[first]) for name, (entry, first) in built.entries.items()}
        result.unmatched += [firsts[name] for name in built.unmatched]
        result.dropped += built.dropped
        result.made += built.made
        return result

    def untranslatable(self, names) -> list[str]:
        """Names of the source whose tensors the target family has no place for."""
        if self.source == MEGATRON:
            empty = {m.megatron for m in self.model.megatron if not m.hf}
            return [n for n in names if (match := megatron.LAYER.match(n)) and match[2] in empty]
        return Mapping(self.kind, self.source, "hf", self.config).untranslatable(names) if self.source != "hf" else []


def with_run_args(config: dict | None, info: dict) -> dict | None:
    """``config`` completed by what a Megatron-LM run's ``args`` (``info["args"]``, its common state read as
    data) say of the model: head counts, layers, the vocabulary before padding; the HF config wins."""
    from_args = megatron.config_from_args(info.get("args"))
    if not from_args:
        return config
    return {**from_args, **models.text_config(config)}


# Families whose tensors hold rows no other family keeps, and what they are: a comparison takes such a side
# apart into the other's names (dropping those rows), never builds it from them.
_MORE_THAN_OTHERS = {MEGATRON: "Megatron pads the vocabulary"}


def taken_apart_to_compare(family: str) -> str | None:
    """Why ``family``'s side of a comparison across families is the one mapped onto the other's names (its
    tensors hold rows the other has no counterpart for), or None when either side may be mapped."""
    return _MORE_THAN_OTHERS.get(family)


def config_to_compare(config: dict | None, source: str, other: dict[str, TensorInfo]) -> dict | None:
    """The config for mapping ``source``'s names onto ``other``'s for a comparison: Megatron's padded embedding
    is compared on the other side's rows, so its vocabulary size comes from the other's embedding where the
    config has none."""
    if source != MEGATRON:
        return config
    config = models.text_config(config)
    if isinstance(config.get("vocab_size"), int):
        return config
    rows = next((t.shape[0] for name, t in other.items() if models.is_input_embedding(name) and t.shape), None)
    return config if rows is None else {**config, "vocab_size": rows}


def config_from_run(mapping: Mapping | MegatronMapping | None, info: dict) -> tuple[dict | None, list[str]]:
    """An HF config.json for an export made from what a checkpoint says of its training run (a Megatron-LM run's
    ``args``, read as data into ``info``), with the lines that say so; (None, []) where it says nothing."""
    if not isinstance(mapping, MegatronMapping) or mapping.source != MEGATRON or not info.get("args"):
        return None, []
    config, line = megatron.hf_config_from_args(mapping.kind, info["args"])
    return config, ["head counts and vocab_size from the Megatron-LM run's args (its common state)", line]


def make_mapping(kind: str, source: str, target: str, config: dict | None, hf_experts: str = "per-expert",
                 megatron_output: megatron.MegatronOutput | None = None,
                 where: str = "") -> Mapping | MegatronMapping:
    """The mapping between two families: ``MegatronMapping`` where one is Megatron-Core's."""
    if MEGATRON in (source, target):
        return MegatronMapping(kind, source, target, config, hf_experts, megatron_output, where)
    return Mapping(kind, source, target, config, hf_experts)


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


def convert_state(mapping: Mapping, entries: dict[str, Entry], params: dict[str, TensorInfo]) -> StateResult:
    """Map every entry of a checkpoint: model weights and each slot of optimizer state that names them.

    ``params`` are the model's weights by their names (``convert.model_part``). An entry whose key
    holds a weight's name (``optim.state.<name>.exp_avg``, ``optimizer.param_groups.<name>.lr``)
    follows that weight's new name and layout; entries that name no weight (``train_state``) stay.
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
    if mapping.source == MEGATRON and mapping.target != MEGATRON:
        own = [key for key in kept if megatron.SHARDED_OBJECT.search(key)]
        buckets = [key for key in kept if megatron.DP_BUCKET.search(key)]
        for key in own + buckets:
            del out[key]
        if own:
            dropped.append(f"{counted(len(own), 'Megatron-Core ShardedObject')} (layers' _extra_state, RNG, common "
                           f"state: {mapping.target} jobs have no use for them): {', '.join(own[:2])}"
                           + (" ..." if len(own) > 2 else ""))
        if buckets:
            dropped.append(f"{counted(len(buckets), 'dp_reshardable optimizer bucket')} ({buckets[0]} ...): Megatron's "
                           "distributed optimizer flattens a DDP bucket's parameters into one 1-D tensor whose order "
                           "and padding only the model's bucketing rebuilds; save with "
                           "--dist-ckpt-optim-fully-reshardable to carry optimizer state")
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
    if mapping.target == MEGATRON and mapping.source != MEGATRON and "args" not in out:
        made += _megatron_common(mapping, weights, out)
    return StateResult(out, dropped, unmatched, list(dict.fromkeys(made)))  # a line per slot would repeat


def _megatron_common(mapping: MegatronMapping, weights: dict[str, Entry], out: dict[str, Entry]) -> list[str]:
    """Megatron-LM's ``iteration`` (0) and, for the kinds they describe, its ``args`` for a checkpoint made from
    another family, as its own HF conversion writes them (``out`` gets them; the Megatron format puts them in the
    common state); a line on what was made."""
    out["iteration"] = ObjectInfo(("iteration",), value=0)
    args = megatron.run_args(mapping.model, mapping.config, weights, mapping.output)
    if args is None:
        return [(f"iteration 0; no args: dcptool writes them for {', '.join(megatron.args_kinds())} given the "
                 "model's config.json")]
    out["args"] = ObjectInfo(("args",), value=record("argparse.Namespace", args))
    return [(f"args: {len(args)} fields of Megatron-LM's arguments from the config (padded_vocab_size "
             f"{args['padded_vocab_size']}, make_vocab_size_divisible_by {args['make_vocab_size_divisible_by']}), "
             "iteration 0")]


_MEGATRON_SLOT = re.compile(r"^(.*?)\.?\bstate\.(\w+)\.$")


def _slot_order(mapping, prefix: str, suffix: str):
    """Megatron keeps a parameter's optimizer state as ``optimizer.state.<slot>.<name>``, flat; torch's optimizers
    (every other family) as ``optimizer.state.<name>.<slot>``, nested. Between them the slot moves, and this
    gives ``name -> (key, path)``; None where the slot stays where it is."""
    if mapping.source == MEGATRON and mapping.target != MEGATRON and not suffix:
        match = _MEGATRON_SLOT.match(prefix)
        if match:
            root = tuple(match[1].split(".")) if match[1] else ()
            return lambda name: (join_path((*root, "state", name, match[2])), (*root, "state", name, match[2]))
    if mapping.target == MEGATRON and mapping.source != MEGATRON and prefix.endswith("state.") \
            and re.fullmatch(r"\.\w+", suffix):
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


def in_layout(entries: dict[str, Entry], model_root: tuple[str, ...] | None, optimizer_root: tuple[str, ...] | None,
              layout: StateLayout) -> tuple[dict[str, Entry], list[str]]:
    """``entries`` moved to where ``layout``'s job keeps them, and notes on what that job does not load.

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
            path = layout.optimizer + path[len(optimizer_root):]
        elif model_root and len(path) > len(model_root) and path[: len(model_root)] == model_root:
            path = layout.model + path[len(model_root):]
        elif model_root is None and isinstance(entry, TensorInfo) and str(path[0]) not in NON_MODEL_ROOTS:
            path = layout.model + path
        else:
            others.add(str(path[0]))
        key = join_path(path)
        if key in moved:
            raise UsageError(f"{key}: two entries of the source land on this key in {layout.engine}'s layout")
        moved[key] = with_path(entry, path)
    notes = []
    missing = [root for root in layout.also_loads if root not in others]
    if missing:
        notes.append(f"{layout.engine} also loads {', '.join(missing)} when it resumes, and the source holds "
                     f"none: {layout.without_them}")
    roots = {path[0] for path in (layout.model, layout.optimizer) if path}
    kept = sorted(others - set(layout.also_loads) - roots)
    if kept:
        notes.append(f"kept {', '.join(kept)} as saved: {layout.engine} does not load them")
    return moved, notes


def mapping_for(names, target: str | None, source: str = "auto", config: dict | None = None,
                hf_experts: str = "per-expert", megatron_output: megatron.MegatronOutput | None = None,
                where: str = "") -> tuple[Mapping | MegatronMapping | None, str | None]:
    """The mapping from the names' family to ``target`` (None: keep the source's), or None when the
    names stay as they are; and a line saying which family and kind were found."""
    names = list(names)
    family = detect_family(names) if source == "auto" else source
    if family is None:
        if source == "auto" and target not in (None, "hf"):
            shown = ", ".join(names[:5])
            raise UsageError(f"cannot tell which family names these weights ({shown} ...): give {option('adapter')}")
        return None, None
    if family not in NAMING_FAMILIES:
        raise UsageError(f"{option('adapter', family)}: choose one of auto, {', '.join(NAMING_FAMILIES)}")
    target = target or family
    fused = hf_experts == "fused" and target == "hf"
    if family == target and not fused:
        return None, f"names: {family}"
    kind = detect_kind(names, family, config)
    mapping = make_mapping(kind, family, target, config, hf_experts, megatron_output, where)
    return mapping, f"names: {family} ({kind}), written as {target}" + (" with fused experts" if fused else "")


def refuse_unmatched(unmatched: list[str], mapping: Mapping, hint: str) -> None:
    """Keys no row of the table names: refused, so nothing is silently dropped or left misnamed."""
    if unmatched:
        shown = ", ".join(unmatched[:5]) + (f" and {len(unmatched) - 5} more" if len(unmatched) > 5 else "")
        raise UsageError(f"{counted(len(unmatched), 'key')} match{'es' if len(unmatched) == 1 else ''} no {mapping.source} name of a {mapping.kind} model: {shown} "
                         f"({hint})")
