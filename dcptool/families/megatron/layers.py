"""Megatron-Core's names to Hugging Face's and back, as views of the stored chunks (nothing is read).

Megatron stacks each decoder layer's tensor over the layers (``decoder.layers.X`` of shape ``[L, ...]``;
``decoder.layers.{i}.X`` where the layers are not uniform), fuses q, k and v per query group
(``linear_qkv``), gate and up (``linear_fc1``) and the layer norms into the linear layer after them,
keeps routed experts as ``[E, ...]``, pads the vocabulary rows and keeps multi-token-prediction layers
apart (``mtp.layers.{n}``; HF numbers them after the main layers). The kind's tables
(``ModelKind.megatron``, ``ModelKind.megatron_mtp``) say which Megatron tensor holds which HF tensors and
how; this module takes them apart (``to_hf``) and puts them together (``from_hf``).
The family (``dcptool.families.megatron``) joins them with the other families through HF's names.

>>> kind = models.kinds()["qwen3"]                                               # doctest: +SKIP
>>> hf = to_hf(kind, {"decoder.layers.self_attention.linear_qkv.weight": qkv}, config)  # doctest: +SKIP
>>> sorted(hf.entries)[:1]                                                       # doctest: +SKIP
['model.layers.0.self_attn.k_proj.weight']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dcptool import models
from dcptool.engine import views
from dcptool.engine.core import Checkpoint, Computed, ObjectInfo, TensorInfo
from dcptool.errors import UsageError, option
from dcptool.models import common
from dcptool.models.kind import MegatronName, ModelKind
from dcptool.renaming import Result

if TYPE_CHECKING:
    from dcptool.families.megatron import MegatronOptions

LAYER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
# A multi-token-prediction layer (multi_token_prediction.py): its decoder layer under ``transformer_layer.``,
# its own tensors (enorm, hnorm, eh_proj, final_layernorm) beside it; always per layer.
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
MTP_DECODER = "transformer_layer."
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# A ShardedObject's key (mapping.py unique_key): the layers' _extra_state, RNG and rerun state, the common
# state. Megatron's own: another family's engine has no use for them.
SHARDED_OBJECT = re.compile(r"/shard_[\d.]+_[\d.]+$")
# The distributed optimizer's dp_reshardable buckets (distrib_optimizer.py): 1-D, a DDP bucket's parameters flat.
DP_BUCKET = re.compile(r"(^|\.)distributed\.dp_group_idx_\d+\.")
EXPERT_HOWS = ("experts", "expert_halves")  # how a MegatronName holds routed experts


@dataclass(frozen=True)
class Heads:
    """What splits ``linear_qkv``: query heads, query groups (key/value heads) and the head size."""

    heads: int
    groups: int
    dim: int

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups


def is_megatron(names) -> bool:
    """Whether names are Megatron-Core's (its decoder layers and embedding)."""
    return any(name.startswith(common.MEGATRON_LAYERS) or name in common.MEGATRON_OUTSIDE for name in names)


def kind_of(names) -> str | None:
    """The model kind whose Megatron table names the most of ``names``; among equals, one that has an HF place for
    each of them, then the smallest table (a dense Qwen3 fits Qwen3-MoE's too); None when no table names any
    decoder tensor. (The router's expert bias, which Megatron keeps only for a sigmoid router, is HF's for
    GLM-4.5 and DeepSeek-V3, and nothing for the softmax-routed Qwen MoEs.) A kind that is another's
    architecture under its own config (Kimi-K2) is told by its config only."""
    suffixes = {match[2] for name in names if (match := LAYER.match(name))}
    tables = {name: {m.megatron: m.hf for m in kind.megatron} for name, kind in models.kinds().items()
              if kind.megatron and kind.architecture_of is None}

    def fit(name: str) -> tuple:
        table = tables[name]
        named = suffixes & table.keys()
        return len(named), suffixes <= table.keys(), all(table[s] for s in named), -len(table)

    best = max(tables, key=fit)
    return best if suffixes & tables[best].keys() else None


def unknown_kind(names) -> UsageError:
    shown = ", ".join(list(names)[:4])
    known = ", ".join(name for name, kind in models.kinds().items() if kind.megatron)
    return UsageError(f"Megatron-Core names of a model kind dcptool's tables do not know ({shown} ...); "
                      f"known: {known}")


# ---------------------------------------------------------------------------------------------
# Megatron -> HF

def to_hf(kind: ModelKind, entries: dict, config: dict, where: str, mtp_copies: bool = True) -> Result:
    """``entries`` (Megatron names) as HF-named views: per layer, per expert, q/k/v and gate/up apart,
    the vocabulary padding dropped (``config``'s ``vocab_size``); prediction layers numbered after the main
    ones, with (``mtp_copies``: for HF's own files) the copies of the embedding and head HF's prediction
    layers hold. ``where`` names the checkpoint in refusals."""
    table = {m.megatron: m for m in kind.megatron}
    heads = _heads(kind, entries, config, where)
    result = Result()
    predictions: set[int] = set()
    for name, entry in entries.items():
        if name in common.MEGATRON_OUTSIDE:
            target = common.MEGATRON_OUTSIDE[name]
            if name in common.MEGATRON_VOCAB_ROWS and not _scalar(entry):
                entry = _without_padding(entry, config, where, result)
            result.entries[target] = (_named(entry, target), name)
            continue
        spec, layers = _spec_and_layers(kind, table, name, entry, entries, config, where)
        if spec is None:
            result.unmatched.append(name)
            continue
        if not spec.hf:
            result.dropped.append(f"{name} (HF names have no such tensor)")
            continue
        if MTP_LAYER.match(name):
            predictions.add(layers[0][0])
        for layer, tensor in layers:
            for hf, part in _parts(spec, tensor, heads, name):
                target = f"model.layers.{layer}.{hf}"
                result.entries[target] = (_named(part, target), name)
    for layer in sorted(predictions) if mtp_copies else ():
        _shared_copies(kind, layer, result)
    return result


def _spec_and_layers(kind: ModelKind, table: dict, name: str, entry, entries: dict, config: dict, where: str):
    """The table row of a Megatron name and ``(HF layer number, tensor)`` of each layer it holds; (None, [])
    when no row names it."""
    match = LAYER.match(name)
    if match:
        spec = table.get(match[2])
        if spec is None:
            return None, []
        if match[1] is not None:
            return spec, [(int(match[1]), entry)]
        if _scalar(entry):
            return spec, [(layer, entry) for layer in range(_layer_count(entries, config, where))]
        return spec, [(layer, views.select(entry, 0, layer, entry.path)) for layer in range(entry.shape[0])]
    match = MTP_LAYER.match(name)
    if match is None or kind.megatron_mtp is None:
        return None, []
    inner = match[2]
    own = {m.megatron: m for m in kind.megatron_mtp.own}
    spec = table.get(inner.removeprefix(MTP_DECODER)) if inner.startswith(MTP_DECODER) else own.get(inner)
    return spec, [(_main_layers(entries, config, where) + int(match[1]), entry)]


def _shared_copies(kind: ModelKind, layer: int, result: Result) -> None:
    """HF's prediction layer ``layer``'s copies of the main embedding and head (Megatron shares them)."""
    for inner, mains in kind.megatron_mtp.shared:
        main = next((m for m in mains if m in result.entries), None)
        if main is None:
            continue
        target = f"model.layers.{layer}.{inner}"
        entry, source = result.entries[main]
        result.entries[target] = (_named(entry, target), source)
        result.made.append(f"{target} from {source} (Megatron's prediction layers share it with the main model)")


def _main_layers(entries: dict, config: dict, where: str) -> int:
    """The main decoder layers, after which HF numbers the prediction layers: those the names hold, else
    the config's ``num_hidden_layers``."""
    numbers = [int(match[1]) for n in entries if (match := LAYER.match(n)) and match[1] is not None]
    if numbers:
        return max(numbers) + 1
    return _layer_count(entries, config, where)


def _parts(spec: MegatronName, tensor, heads: Heads | None, name: str):
    """``(HF name in the layer, view)`` of every HF tensor one layer's Megatron tensor holds."""
    if _scalar(tensor):
        if spec.how in EXPERT_HOWS:
            raise UsageError(f"{name}: per-expert state that is no tensor cannot be split per expert")
        return [(hf, tensor) for hf in spec.hf]
    if spec.how == "plain":
        return [(spec.hf[0], tensor)]
    if spec.how == "halves":
        return list(zip(spec.hf, _halves(tensor, 0, name)))
    if spec.how == "qkv":
        return list(zip(spec.hf, _split_qkv(tensor, heads, name)))
    if spec.how == "transposed":
        return [(spec.hf[0], views.transpose(tensor, 1, 2, tensor.path))]
    if spec.how == "interleaved":
        return [(spec.hf[0], _interleaved(tensor, name))]
    parts = []
    for expert in range(tensor.shape[0]):
        one = views.select(tensor, 0, expert, tensor.path)
        pieces = _halves(one, 0, name) if spec.how == "expert_halves" else [one]
        parts += [(hf.replace("{E}", str(expert)), piece) for hf, piece in zip(spec.hf, pieces)]
    return parts


def _halves(tensor: TensorInfo, dim: int, name: str) -> list[TensorInfo]:
    rows = tensor.shape[dim]
    if rows % 2:
        raise UsageError(f"{name}: {rows} rows do not split into gate and up halves")
    return [views.narrow(tensor, dim, start, rows // 2, tensor.path) for start in (0, rows // 2)]


def _interleaved(tensor: TensorInfo, name: str) -> TensorInfo:
    """HF's experts of Megatron's ``[E, gate; up, ...]``: gate and up alternating along the last dim (of
    ``[E, H, 2F]``, a weight's last two dims swapped)."""
    halves = _halves(tensor, 1, name)
    if len(tensor.shape) == 3:
        halves = [views.transpose(half, 1, 2, tensor.path) for half in halves]
    return views.interleave(halves, len(tensor.shape) - 1, tensor.path)


def _split_qkv(tensor: TensorInfo, heads: Heads, name: str) -> list[TensorInfo]:
    """q, k and v of one layer's ``linear_qkv``: per group, q_per_group x dim rows of q, then dim of k and of v."""
    per_group = (heads.q_per_group + 2) * heads.dim
    rows = tensor.shape[0]
    if rows != heads.groups * per_group:
        raise UsageError(f"{name}: {rows} rows are not {heads.groups} query groups of {heads.q_per_group} query "
                         f"heads + k + v of size {heads.dim} ({heads.groups * per_group} rows)")
    q_rows = heads.q_per_group * heads.dim
    parts = []
    for start, length in ((0, q_rows), (q_rows, heads.dim), (q_rows + heads.dim, heads.dim)):
        pieces = [views.narrow(tensor, 0, group * per_group + start, length, tensor.path)
                  for group in range(heads.groups)]
        parts.append(pieces[0] if len(pieces) == 1 else views.cat(pieces, 0, tensor.path))
    return parts


def _heads(kind: ModelKind, entries: dict, config: dict, where: str) -> Heads | None:
    """The head counts of the config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``), else
    what the tensors give (a per-head q norm gives the head size, ``linear_proj`` then the query heads)."""
    qkv = next((e for n, e in entries.items() if n.endswith("self_attention.linear_qkv.weight") and not _scalar(e)), None)
    if qkv is None:
        return None
    hidden = qkv.shape[-1]
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    dim = config.get("head_dim") or (hidden // heads if isinstance(heads, int) and heads else None)
    source = "config.json"
    if not isinstance(heads, int):
        norm = next((e for n, e in entries.items() if n.endswith("self_attention.q_layernorm.weight")
                     and not _scalar(e)), None)
        proj = next((e for n, e in entries.items() if n.endswith("self_attention.linear_proj.weight")
                     and not _scalar(e)), None)
        if norm is None or proj is None:
            raise UsageError(f"{where}: splitting Megatron's linear_qkv into q, k and v needs the head counts "
                             f"(num_attention_heads, num_key_value_heads): give the model's config.json with "
                             f"{option('config_dir')}")
        dim, source = norm.shape[-1], "the tensors"
        heads = proj.shape[-1] // dim
        groups = (qkv.shape[-2] // dim - heads) // 2
    groups = groups or heads
    if heads <= 0 or groups <= 0 or heads % groups or not dim:
        raise UsageError(f"{where}: {heads} attention heads in {groups} key/value groups ({source}) do not fit "
                         f"Megatron's linear_qkv {list(qkv.shape)}")
    found = Heads(heads, groups, dim)
    if qkv.shape[-2] != (heads + 2 * groups) * dim:
        raise UsageError(f"{where}: linear_qkv has {qkv.shape[-2]} rows, but {heads} attention heads and {groups} "
                         f"key/value heads of size {dim} ({source}) make {(heads + 2 * groups) * dim}; check "
                         f"{option('config_dir')}")
    return found


def _without_padding(entry: TensorInfo, config: dict, where: str, result: Result) -> TensorInfo:
    """The embedding's (or output's) rows of the real vocabulary: Megatron's padding rows dropped."""
    vocab = config.get("vocab_size")
    rows = entry.shape[0]
    if not isinstance(vocab, int):
        result.made.append(f"{entry.key}: kept all {rows} rows (no vocab_size to drop Megatron's padding by; "
                           f"give {option('config_dir')})")
        return entry
    if vocab > rows:
        raise UsageError(f"{where}: vocab_size {vocab} (config.json) is more than the {rows} rows of {entry.key}")
    return entry if vocab == rows else views.narrow(entry, 0, 0, vocab, entry.path)


def _layer_count(entries: dict, config: dict, where: str) -> int:
    stacked = [e.shape[0] for n, e in entries.items() if LAYER.match(n) and not LAYER.match(n)[1]
               and not _scalar(e)]
    if stacked:
        return stacked[0]
    if isinstance(config.get("num_hidden_layers"), int):
        return config["num_hidden_layers"]
    raise UsageError(f"{where}: how many layers share stacked state needs num_hidden_layers ({option('config_dir')})")


# ---------------------------------------------------------------------------------------------
# HF -> Megatron

def from_hf(kind: ModelKind, entries: dict, config: dict, options: MegatronOptions, where: str) -> Result:
    """HF-named ``entries`` (per expert or transformers v5's fused experts) in Megatron's names: layers
    stacked (per layer where the layers are not uniform), q/k/v grouped into ``linear_qkv``, gate and up
    into ``linear_fc1``, experts into ``[E, ...]``, the vocabulary padded with zero rows to a multiple of
    ``options``' make_vocab_size_divisible_by x tp, as Megatron-LM pads it; the norms under the names
    ``options``' layer spec saves them by."""
    result = Result()
    hf_outside = {hf: megatron for megatron, hf in common.MEGATRON_OUTSIDE.items()}
    layers: dict[int, dict[str, TensorInfo]] = {}
    for name, entry in entries.items():
        if name in hf_outside:
            if hf_outside[name] in common.MEGATRON_VOCAB_ROWS and not _scalar(entry):
                entry = padded_vocab(entry, options.padded_multiple)
                if entry.transform is not None:
                    result.made.append(f"{hf_outside[name]}: {entry.shape[0]} rows, the vocabulary padded with zeros "
                                       f"to a multiple of {options.vocab_multiple} x tp {options.tp}")
            result.entries[hf_outside[name]] = (_named(entry, hf_outside[name]), name)
            continue
        match = _HF_LAYER.match(name)
        if match is None:
            result.unmatched.append(name)
            continue
        layers.setdefault(int(match[1]), {})[match[2]] = (entry, name)
    heads = _hf_heads(config, where) if any("self_attn.k_proj.weight" in inner for inner in layers.values()) else None
    _predictions_from_hf(kind, layers, config, heads, options.spec, result)
    built = {layer: _layer_from_hf(kind, inner, heads, options.spec, result)
             for layer, inner in sorted(layers.items())}
    names = [set(tensors) for tensors in built.values()]
    uniform = bool(names) and all(n == names[0] for n in names) and sorted(built) == list(range(len(built)))
    if uniform:
        for megatron in built[0]:
            per_layer = [built[layer][megatron] for layer in sorted(built)]
            stacked_name = common.MEGATRON_LAYERS + megatron
            tensors = [tensor for tensor, _ in per_layer]
            stacked = tensors[0] if _scalar(tensors[0]) else views.stack(tensors, (stacked_name,))
            result.entries[stacked_name] = (_named(stacked, stacked_name), per_layer[0][1])
    else:
        for layer, tensors in built.items():
            for megatron, (tensor, first) in tensors.items():
                per_layer_name = f"{common.MEGATRON_LAYERS}{layer}.{megatron}"
                result.entries[per_layer_name] = (_named(tensor, per_layer_name), first)
    return result


def _predictions_from_hf(kind: ModelKind, layers: dict, config: dict, heads: Heads | None, layer_spec: str,
                         result: Result) -> None:
    """The prediction layers of ``layers`` (HF's layers after the config's ``num_hidden_layers``, taken out of
    ``layers``) as ``mtp.layers.{n}``."""
    main = config.get("num_hidden_layers")
    if kind.megatron_mtp is None or not isinstance(main, int):
        return
    for layer in [layer for layer in layers if layer >= main]:
        _prediction_from_hf(kind, f"mtp.layers.{layer - main}.", layers.pop(layer), heads, layer_spec, result)


def _prediction_from_hf(kind: ModelKind, prefix: str, inner: dict, heads: Heads | None, layer_spec: str,
                        result: Result) -> None:
    """One prediction layer as ``prefix`` (``mtp.layers.{n}.``): its decoder layer under ``transformer_layer.``,
    its own tensors beside; HF's copies of the embedding and head are not written (Megatron's prediction
    layers share the main ones)."""
    for spec in kind.megatron_mtp.own:
        if spec.hf[0] in inner:
            tensor, name = inner.pop(spec.hf[0])
            result.entries[prefix + spec.megatron] = (_named(tensor, prefix + spec.megatron), name)
    for shared, mains in kind.megatron_mtp.shared:
        if shared in inner:
            _, name = inner.pop(shared)
            result.dropped.append(f"{name} (Megatron's prediction layers use the main {mains[0]}; this copy is "
                                  f"not written)")
    for megatron, (tensor, first) in _layer_from_hf(kind, inner, heads, layer_spec, result).items():
        target = prefix + MTP_DECODER + megatron
        result.entries[target] = (_named(tensor, target), first)


def _layer_from_hf(kind: ModelKind, inner: dict, heads: Heads | None, layer_spec: str, result: Result) -> dict:
    """One layer's Megatron tensors (name -> (view, first HF name)) from its HF tensors, under the names
    ``layer_spec`` saves in a layer of its kind (dense, or MoE: one with routed experts); what fits no row is
    unmatched."""
    used: set[str] = set()
    built = {}
    fused = _fused_experts(inner)
    moe = bool(fused) or any(spec.how in EXPERT_HOWS and all(hf.replace("{E}", "0") in inner for hf in spec.hf)
                             for spec in kind.megatron)
    for spec in kind.megatron:
        # a name this layer spec does not save (another spec's), or a second name of an HF tensor already placed
        if not spec.hf or not spec.saved(layer_spec, moe) or spec.hf[0] in used:
            continue
        if spec.how in EXPERT_HOWS:
            found = _experts_from_hf(spec, inner, fused, used)
        else:
            parts = [inner.get(hf) for hf in spec.hf]
            if any(part is None for part in parts):
                continue
            used.update(spec.hf)
            tensors = [entry for entry, _ in parts]
            found = (_joined(spec, tensors, heads), parts[0][1])
        if found is not None:
            built[spec.megatron] = found
    for rest, (_, name) in inner.items():
        if rest not in used and not (fused and rest in fused):
            result.unmatched.append(name)
    return built


def _fused_experts(inner: dict) -> dict[str, tuple]:
    """transformers v5's fused experts of a layer, if it has them: ``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]."""
    return {name: inner[name] for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj") if name in inner}


def _experts_from_hf(spec: MegatronName, inner: dict, fused: dict, used: set) -> tuple | None:
    """Megatron's ``[E, ...]`` experts from one HF tensor per expert, or from the fused tensor as it is."""
    fused_name = "mlp.experts.gate_up_proj" if spec.how == "expert_halves" else "mlp.experts.down_proj"
    if fused_name in fused:
        return fused[fused_name]
    per_expert = []
    while all(hf.replace("{E}", str(len(per_expert))) in inner for hf in spec.hf):
        parts = [inner[hf.replace("{E}", str(len(per_expert)))] for hf in spec.hf]
        used.update(hf.replace("{E}", str(len(per_expert))) for hf in spec.hf)
        per_expert.append(parts)
    if not per_expert:
        return None
    tensors = [[entry for entry, _ in parts] for parts in per_expert]
    first = per_expert[0][0]
    if _scalar(tensors[0][0]):
        return first
    joined = [ts[0] if len(ts) == 1 else views.cat(ts, 0, ts[0].path) for ts in tensors]
    return views.stack(joined, joined[0].path), first[1]


def _joined(spec: MegatronName, tensors: list, heads: Heads | None):
    if _scalar(tensors[0]) or spec.how == "plain":
        return tensors[0]
    if spec.how == "halves":
        return views.cat(tensors, 0, tensors[0].path)
    if spec.how == "transposed":
        return views.transpose(tensors[0], 1, 2, tensors[0].path)
    if spec.how == "interleaved":
        return _halves_of_interleaved(tensors[0], spec.hf[0])
    q, k, v = tensors  # qkv: per group its q heads, then its k and v head
    q_rows = heads.q_per_group * heads.dim
    pieces = []
    for group in range(heads.groups):
        pieces += [views.narrow(q, 0, group * q_rows, q_rows, q.path),
                   views.narrow(k, 0, group * heads.dim, heads.dim, k.path),
                   views.narrow(v, 0, group * heads.dim, heads.dim, v.path)]
    return views.cat(pieces, 0, q.path)


def _halves_of_interleaved(tensor: TensorInfo, name: str) -> TensorInfo:
    """Megatron's ``[E, gate; up, ...]`` of HF's experts whose last dim alternates gate and up (``[E, H, 2F]``:
    the last two dims swapped too)."""
    last = len(tensor.shape) - 1
    if tensor.shape[last] % 2:
        raise UsageError(f"{name}: {tensor.shape[last]} columns do not alternate gate and up")
    halves = [views.strided(tensor, last, start, 2, tensor.path) for start in (0, 1)]
    if last == 2:
        halves = [views.transpose(half, 1, 2, tensor.path) for half in halves]
    return views.cat(halves, 1, tensor.path)


def _hf_heads(config: dict, where: str) -> Heads:
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if not isinstance(heads, int) or heads <= 0:
        raise UsageError(f"{where}: Megatron's linear_qkv groups q, k and v per query group, which needs "
                         f"num_attention_heads from the model's config.json (give {option('config_dir')})")
    groups = config.get("num_key_value_heads") or heads
    dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if heads % groups or not dim:
        raise UsageError(f"{where}: {heads} attention heads do not split into {groups} key/value heads (config.json)")
    return Heads(heads, groups, dim)


# A norm Transformer Engine's spec keeps as a module of its own (TENorm: input_layernorm of MLA, pre_mlp_layernorm
# of MoE layers, q/k layernorm, final_layernorm, a prediction layer's enorm / hnorm): its weight's name.
_NORM_WEIGHT = re.compile(r"^(.*norm)\.weight$")


def te_norm_states(weights: dict) -> dict[str, ObjectInfo]:
    """The ``_extra_state`` objects of the norms among ``weights`` (Megatron names) that Transformer Engine's spec
    keeps apart: its RMSNorm is an operation with extra state (its FP8 recipe) since TE 2.0, which Megatron saves
    and loads as a ShardedObject per layer, ``<module>._extra_state/shard_{layer}_{L}`` (``shard_0_1`` for a module
    saved once). Empty (``[None]``, which TE's ``set_extra_state`` skips), as the linear layers' of an import;
    a run whose TE has no such state does not ask for them, and its load leaves them unread."""
    states = {}
    for name, tensor in weights.items():
        norm = _NORM_WEIGHT.match(name)
        if norm is None or _scalar(tensor):
            continue
        stacked = (match := LAYER.match(name)) is not None and match[1] is None
        layers = tensor.shape[0] if stacked else 1
        for layer in range(layers):
            key = f"{norm[1]}._extra_state/shard_{layer}_{layers}"  # ShardedObject.unique_key (SHARDED_OBJECT)
            states[key] = ObjectInfo((key,), value=[None])
    return states


def padded_vocab(tensor: TensorInfo, multiple: int) -> TensorInfo:
    """The embedding (or output) with Megatron's vocabulary padding: zero rows up to a multiple of ``multiple``."""
    rows = -(-tensor.shape[0] // multiple) * multiple
    if rows == tensor.shape[0]:
        return tensor
    return TensorInfo(tensor.path, tensor.dtype, (rows, *tensor.shape[1:]), tensor.chunks,
                      transform=ZeroRows(tensor))


@dataclass(frozen=True)
class ZeroRows(Computed):
    """A tensor's rows followed by zero rows (a ``TensorInfo.transform``): Megatron's vocabulary padding."""

    tensor: TensorInfo
    work_bytes = 0  # read straight into the output

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        stored = self.tensor.shape[0]
        first, count = offsets[0], sizes[0]
        inside = max(0, min(first + count, stored) - first)
        if inside:
            checkpoint.read_region(self.tensor, offsets, (inside, *sizes[1:]), out[:inside], scratch, passing=True)
        out[inside:] = 0


# ---------------------------------------------------------------------------------------------

def _scalar(entry) -> bool:
    return not isinstance(entry, TensorInfo) or not entry.shape


def _named(entry, name: str):
    if isinstance(entry, TensorInfo):
        return views.renamed(entry, (name,))
    return ObjectInfo((name,), entry.blob, entry.value)

