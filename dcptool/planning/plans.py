"""Placement plans: which tensors tensor parallelism splits and how, which are grouped experts, which FSDP leaves whole.

A plan is a table of rules, a regular expression on the parameter name and what a training job
does with matching tensors, as torchtitan and transformers write their TP plans. The first rule
that matches wins; a tensor no rule matches is replicated across tp and sharded by FSDP on dim 0.

* ``tp``: ``colwise`` splits the output features (dim 0 of a Linear weight, the vocabulary of an
  embedding, dim 1 of grouped experts), ``rowwise`` the input features (dim 1, or dim 2 of experts;
  a rowwise bias stays whole), ``replicate`` neither.
* ``dim``: the dim tp splits, where it is not the style's own (negative: counted from the last, and a 1-D
  tensor's only dim for colwise: transformers' ``Shard(ndim - 2)`` of a bias).
* ``packed``: the split dim holds that many equal parts stacked (a fused gate and up): tp splits each part,
  as transformers' ``packed_colwise`` places them (torch's ``_StridedShard``).
* ``experts``: grouped experts ``[E, out, in]``, split by expert parallelism on dim 0.
* ``fsdp``: the dim FSDP2 shards (0 unless a job says otherwise), or ``none`` for buffers FSDP
  does not shard.

A plan also says which engine's conventions its jobs follow (``engine``): ``torch`` (torch's FSDP2 and DTensor
placements saved by ``dcp.save`` as they are, as torchtitan and AReaL run them; experts sharded by FSDP on dim 1
when the data-parallel ranks outnumber them, as torchtitan does) or ``transformers`` (transformers' own
distributed training: no expert tensor parallelism, and a strided shard redistributed to a contiguous one
before ``dcp.save``, which records one region per rank and refuses a strided shard).

Where plans come from (``choose``): the built-in tables gather the rules every model kind declares
(``dcptool.models``); with the model's config.json, ``auto`` takes the kind's own table, or transformers' plan of
the model (``dcptool.models.transformers_plans``) when dcptool has no table for the kind or the table leaves
whole a tensor transformers' plan splits; a kind with neither is replicated over tp, with a warning.

A plan file (YAML or JSON) has the same fields::

    name: my-model
    engine: torch
    rules:
      - {match: 'attn\\.qkv\\.weight$', tp: colwise}
      - {match: 'attn\\.proj\\.weight$', tp: rowwise}
      - {match: 'mlp\\.gate_up\\.weight$', tp: colwise, packed: 2}
      - {match: 'experts\\.w_in$', experts: true, tp: colwise}
      - {match: 'router_bias$', fsdp: none}

>>> plan = BUILTIN["hf"]
>>> plan.rule_for("model.layers.0.self_attn.o_proj.weight").tp
'rowwise'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dcptool import models
from dcptool.errors import UsageError, option
from dcptool.models import transformers_plans

TP_STYLES = ("colwise", "rowwise", "replicate")
ENGINES = ("torch", "transformers")


@dataclass(frozen=True)
class Rule:
    match: str
    tp: str = "replicate"
    experts: bool = False
    fsdp: int | None = 0
    dim: int | None = None
    packed: int = 1

    def __post_init__(self):
        object.__setattr__(self, "pattern", re.compile(self.match))

    def tp_dim(self, ndim: int) -> int | None:
        """The dim tp splits in a tensor of ``ndim`` dims, None when it stays whole."""
        if self.tp == "replicate" or ndim == 0:
            return None
        if self.dim is None:
            dim = {"colwise": 0, "rowwise": 1}[self.tp] + (1 if self.experts else 0)
        elif ndim == 1:
            dim = 0 if self.tp == "colwise" else 1  # a bias: colwise splits it, rowwise adds it whole
        else:
            dim = self.dim if self.dim >= 0 else ndim + self.dim
        return dim if 0 <= dim < ndim else None  # a rowwise bias stays whole

    def describe(self) -> str:
        """What the rule does, as a plan file writes it: ``colwise dim=-2 packed=2``, ``experts``, ``fsdp=none``."""
        parts = [self.tp] if self.tp != "replicate" or not (self.experts or self.fsdp != 0) else []
        parts += [f"dim={self.dim}"] if self.dim is not None else []
        parts += [f"packed={self.packed}"] if self.packed > 1 else []
        parts += ["experts"] if self.experts else []
        parts += [f"fsdp={'none' if self.fsdp is None else self.fsdp}"] if self.fsdp != 0 else []
        return " ".join(parts)


@dataclass
class Plan:
    """A placement plan: ``rules`` (first match wins), the ``engine`` whose conventions its jobs follow, the
    ``entries`` a dry run lists (``(pattern, what it does)``: the rules themselves, or the entries of
    transformers' plan they were made from, ``rule_entries`` saying which entry made each rule), and a
    ``warning`` to show whenever it is used."""

    name: str
    description: str
    rules: list[Rule] = field(default_factory=list)
    engine: str = "torch"
    entries: list[tuple[str, str]] = field(default_factory=list)
    rule_entries: list[int] = field(default_factory=list)
    warning: str = ""

    def __post_init__(self):
        if not self.entries:
            self.entries = [(rule.match, rule.describe()) for rule in self.rules]
            self.rule_entries = list(range(len(self.rules)))

    def rule_index(self, name: str) -> int | None:
        """The index of the first rule whose pattern is found in ``name``, or None."""
        return next((i for i, rule in enumerate(self.rules) if rule.pattern.search(name)), None)

    def rule_for(self, name: str) -> Rule | None:
        """The first rule whose pattern is found in ``name``, or None (the default placement)."""
        index = self.rule_index(name)
        return None if index is None else self.rules[index]

    def splits(self, name: str) -> bool:
        """Whether the plan splits the tensor ``name`` over tp or ep (by its rule; dims aside)."""
        rule = self.rule_for(name)
        return rule is not None and (rule.tp != "replicate" or rule.experts)


def _table(plan: str) -> list[Rule]:
    return [Rule(match, **options) for match, options in models.tp_rules(plan)]


BUILTIN: dict[str, Plan] = {plan.name: plan for plan in (
    *(Plan(name, description, _table(name)) for name, description in models.tp_plans().items()),
    Plan("fsdp", "data parallel only: every tensor sharded by FSDP on dim 0, nothing split by tp or ep"),
)}
TRANSFORMERS = "transformers"  # --plan transformers: the model's own plan, as transformers resolves it

# How transformers' parallel styles place a parameter (transformers/distributed/tensor_parallel.py: each
# style's shard_param), as rule fields. colwise styles: Shard(ndim - 2), the output features of a Linear weight
# or bias and of grouped experts [E, out, in]; rowwise: Shard(-1), a bias whole; embedding_rowwise: the
# vocabulary, Shard(0); packed styles: _StridedShard of the same dims, each of the two stacked parts split.
TRANSFORMERS_STYLES: dict[str, dict] = {
    **{style: {"tp": "colwise", "dim": -2} for style in ("colwise", "colwise_gather_output", "colwise_rep")},
    **{style: {"tp": "rowwise", "dim": -1} for style in ("rowwise", "rowwise_split_input", "rowwise_rep")},
    "embedding_rowwise": {"tp": "colwise", "dim": 0},
    "embedding_colwise": {"tp": "rowwise", "dim": 1},
    "packed_colwise": {"tp": "colwise", "dim": -2, "packed": 2},
    "packed_rowwise": {"tp": "rowwise", "dim": -1, "packed": 2},
    "grouped_gemm": {"experts": True},  # the EP plan's: whole experts per rank, Shard(0) on the ep mesh
}
# Styles that leave their parameters as they are (replicated on every rank): replicated ones, and hooks on a
# module's forward (the experts' all-reduce, the EP dispatch, MLA's gradient sum, sequence parallel norms).
TRANSFORMERS_WHOLE = frozenset((
    "replicate", "replicated_with_grad_allreduce", "sequence_parallel", "local_params", "all_reduce",
    "mla_kv_a_proj", "moe_tp_experts", "moe_identity_expert", "ep_dispatch_experts"))


def from_transformers(found: transformers_plans.TransformersPlan, expert_parallel: bool) -> Plan:
    """The rules of transformers' plans for a job with (``expert_parallel``) or without expert parallelism, as
    transformers applies them (``DistributedMixin._resolve_parallel_plans``): the EP plan only under EP, where its
    entries take the place of the TP plan's on the experts and everything under them.

    An entry names a parameter, or a module whose own parameters it places; a parameter's own entry comes
    first. The model's persistent buffers are left whole by FSDP2, as by every style.
    """
    tp, ep = dict(found.tp), dict(found.ep) if expert_parallel else {}
    if ep:
        under_experts = re.compile(rf"(?:{'|'.join(map(re.escape, ep))})(?:\..+)?").fullmatch
        tp = {name: style for name, style in tp.items() if not under_experts(name)}
    entries = {**tp, **ep}
    unknown = sorted({style for style in entries.values()} - set(TRANSFORMERS_STYLES) - TRANSFORMERS_WHOLE)
    if unknown:
        entry = next(name for name, style in entries.items() if style == unknown[0])
        raise UsageError(f"{found.model_class}'s plan ({found.source}) places {entry} as {unknown[0]!r}, a style "
                         f"dcptool does not know: give {option('plan')} a plan file for it")
    listed = [*((name, "persistent buffer: FSDP leaves it whole") for name in found.buffers), *entries.items()]
    rules = [Rule(rf"^{_pattern(name)}$", fsdp=None) for name in found.buffers]
    rule_entries = list(range(len(found.buffers)))
    for own_parameters in ("", r"\.[^.]+"):  # a parameter's own entry before its module's
        rules += [Rule(f"^{_pattern(name)}{own_parameters}$", **TRANSFORMERS_STYLES.get(style, {}))
                  for name, style in entries.items()]
        rule_entries += range(len(found.buffers), len(listed))
    plan_names = "tp and ep plans" if ep else "tp plan"
    description = f"{found.model_class}'s {plan_names} from {found.source}"
    return Plan(TRANSFORMERS, description, rules, "transformers", listed, rule_entries)


def _pattern(name: str) -> str:
    """A regular expression of a transformers plan name: ``*`` stands for a layer number."""
    return r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in name.split("."))


def load_plan_file(path: Path) -> Plan:
    """A plan from a YAML or JSON file (see the module docstring for the fields)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the plan file ({exc.strerror})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as exc:  # both json and yaml errors derive from ValueError
        raise UsageError(f"{path}: not a valid plan file ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list) or not data["rules"]:
        raise UsageError(f"{path}: a plan file needs a non-empty 'rules' list")
    engine = data.get("engine", "torch")
    if engine not in ENGINES:
        raise UsageError(f"{path}: engine {engine!r} is not one of {', '.join(ENGINES)}")
    rules = []
    for number, entry in enumerate(data["rules"], 1):
        where = f"{path}: rule {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
            raise UsageError(f"{where}: needs 'match', a regular expression")
        unknown = set(entry) - {"match", "tp", "experts", "fsdp", "dim", "packed"}
        if unknown:
            raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} "
                             "(use match, tp, dim, packed, experts, fsdp)")
        tp = entry.get("tp", "replicate")
        if tp not in TP_STYLES:
            raise UsageError(f"{where}: tp {tp!r} is not one of {', '.join(TP_STYLES)}")
        fsdp = entry.get("fsdp", 0)
        fsdp = None if fsdp in (None, "none") else fsdp
        if fsdp is not None and (not isinstance(fsdp, int) or fsdp < 0):
            raise UsageError(f"{where}: fsdp must be a dim number or 'none'")
        dim, packed = entry.get("dim"), entry.get("packed", 1)
        if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool)):
            raise UsageError(f"{where}: dim must be a dim number (negative: counted from the last)")
        if not isinstance(packed, int) or isinstance(packed, bool) or packed < 1:
            raise UsageError(f"{where}: packed must be the number of parts stacked in the split dim (1 or more)")
        try:
            rules.append(Rule(entry["match"], tp, bool(entry.get("experts", False)), fsdp, dim, packed))
        except re.error as exc:
            raise UsageError(f"{where}: match {entry['match']!r} is not a regular expression ({exc})") from None
    return Plan(str(data.get("name", path.stem)), f"plan file {path}", rules, engine)


def choose(spec: str, names: list[str], config: dict | None = None, *, tp: int = 1, ep: int = 1) -> Plan:
    """The plan named by ``spec`` (a built-in name, ``transformers``, a file, or ``auto``) for a model with these
    parameter names, described by ``config`` (its config.json, or None), on a mesh of ``tp`` and ``ep`` ranks.

    ``auto`` without a config picks the built-in plan whose rules match the most names; when none matches any,
    the data-parallel-only plan. With a config it is the kind's own table (``hf`` or ``torchtitan``, whichever
    its names are in), unless transformers' plan for the model splits a tensor the table leaves whole; a kind
    without a table takes transformers' plan; one with neither is replicated over tp, with a warning when
    tp or ep is above 1. ``hf`` and ``torchtitan`` are the kind's table too, when a config names a kind.
    """
    if spec == TRANSFORMERS:
        found = _transformers_plan(config, ep > 1)
        if found is None:
            model_type = (config or {}).get("model_type")
            raise UsageError(f"{option('plan', spec)}: " + (
                f"transformers has no plan for model type {model_type!r}" if model_type else
                f"transformers' plan is read from the model's config.json: give {option('config_dir')}"))
        return found
    if spec in BUILTIN:
        return _kind_table(config, spec) or BUILTIN[spec]
    if spec != "auto":
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"{option('plan', spec)}: neither a built-in plan ({', '.join(BUILTIN)}, "
                             f"{TRANSFORMERS}, auto) nor a file")
        plan = load_plan_file(path)
        unmatched = [r.match for r in plan.rules if not any(r.pattern.search(n) for n in names)]
        if len(unmatched) == len(plan.rules):
            raise UsageError(f"{path}: the plan names no tensor of the checkpoint (no rule matches any key)")
        if unmatched:
            raise UsageError(f"{path}: rule {unmatched[0]!r} matches no tensor of the checkpoint")
        return plan
    model_type = (config or {}).get("model_type")
    if not model_type:
        return _by_names(BUILTIN, names) or BUILTIN["fsdp"]
    tables = {name: table for name in BUILTIN if (table := _kind_table(config, name))}
    table = _by_names(tables, names)
    found = _transformers_plan(config, ep > 1)
    if found is not None and not any(found.splits(name) for name in names):
        found = None  # its names are not the checkpoint's (another family's)
    if table is not None:
        more = [name for name in names if found and found.splits(name) and not table.splits(name)]
        if not more:
            return table
        found.warning = (f"dcptool's table of {models.kind_of(models.text_config(config)).name} leaves "
                         f"{more[0]}{f' (and {len(more) - 1} more)' if len(more) > 1 else ''} whole, which "
                         f"{found.description} splits: laid out by transformers' plan")
        return found
    if found is not None:
        return found
    if tables:  # a kind dcptool knows, under names none of its tables has: as without a config
        return _by_names(BUILTIN, names) or BUILTIN["fsdp"]
    plan = Plan(BUILTIN["fsdp"].name, BUILTIN["fsdp"].description)
    if tp > 1 or ep > 1:
        plan.warning = (f"model type {model_type!r} has no table in dcptool and no plan in transformers "
                        f"({_transformers_named()}): every tensor is laid out whole on the tp ranks, as a job "
                        f"without a plan holds it; {option('plan')} takes a plan file")
    return plan


def _by_names(candidates: dict[str, Plan], names: list[str]) -> Plan | None:
    """The plan of ``candidates`` whose rules match the most names (the first among equals), None if none matches."""
    scores = {name: sum(1 for n in names if plan.rule_for(n)) for name, plan in candidates.items()}
    best = max(scores, key=scores.get, default=None)
    return candidates[best] if best is not None and scores[best] else None


def _kind_table(config: dict | None, name: str) -> Plan | None:
    """Built-in plan ``name`` with the rules of the model kind ``config`` names alone; None for another kind."""
    kind = models.kind_of(models.text_config(config)) if config else None
    rules = kind.tp_rules.get(name) if kind else None
    if not rules:
        return None
    return Plan(name, f"dcptool's table of model kind {kind.name}, {BUILTIN[name].description}",
                [Rule(match, **options) for match, options in rules])


def _transformers_plan(config: dict | None, expert_parallel: bool) -> Plan | None:
    found = transformers_plans.plan_of(config)
    return from_transformers(found, expert_parallel) if found is not None else None


def _transformers_named() -> str:
    """Which transformers' plans were looked in: the installed one or the snapshot dcptool ships."""
    installed = transformers_plans._installed_version()
    return f"transformers {installed}" if installed else \
        f"dcptool's snapshot of transformers {transformers_plans.snapshot().transformers}"
