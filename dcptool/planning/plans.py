"""Placement plans: which tensors tensor parallelism splits and how, which are grouped experts, which FSDP leaves whole.

A plan is a table of rules, a regular expression on the parameter name and what a training job
does with matching tensors, as torchtitan and transformers write their TP plans. The first rule
that matches wins; a tensor no rule matches is replicated across tp and sharded by FSDP on dim 0.
The built-in plans gather the rules every model kind declares (``dcptool.models``).

* ``tp``: ``colwise`` splits the output features (dim 0 of a Linear weight, the vocabulary of an
  embedding, dim 1 of grouped experts), ``rowwise`` the input features (dim 1, or dim 2 of experts;
  a rowwise bias stays whole), ``replicate`` neither.
* ``experts``: grouped experts ``[E, out, in]``, split by expert parallelism on dim 0.
* ``fsdp``: the dim FSDP2 shards (0 unless a job says otherwise), or ``none`` for buffers FSDP
  does not shard.

A plan file (YAML or JSON) has the same fields::

    name: my-model
    rules:
      - {match: 'attn\\.qkv\\.weight$', tp: colwise}
      - {match: 'attn\\.proj\\.weight$', tp: rowwise}
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

TP_STYLES = ("colwise", "rowwise", "replicate")


@dataclass(frozen=True)
class Rule:
    match: str
    tp: str = "replicate"
    experts: bool = False
    fsdp: int | None = 0

    def __post_init__(self):
        object.__setattr__(self, "pattern", re.compile(self.match))


@dataclass
class Plan:
    name: str
    description: str
    rules: list[Rule] = field(default_factory=list)

    def rule_for(self, name: str) -> Rule | None:
        """The first rule whose pattern is found in ``name``, or None (the default placement)."""
        return next((rule for rule in self.rules if rule.pattern.search(name)), None)


def _table(plan: str) -> list[Rule]:
    return [Rule(match, **options) for match, options in models.tp_rules(plan)]


BUILTIN: dict[str, Plan] = {plan.name: plan for plan in (
    *(Plan(name, description, _table(name)) for name, description in models.tp_plans().items()),
    Plan("fsdp", "data parallel only: every tensor sharded by FSDP on dim 0, nothing split by tp or ep"),
)}


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
    rules = []
    for number, entry in enumerate(data["rules"], 1):
        where = f"{path}: rule {number}"
        if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
            raise UsageError(f"{where}: needs 'match', a regular expression")
        unknown = set(entry) - {"match", "tp", "experts", "fsdp"}
        if unknown:
            raise UsageError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} (use match, tp, experts, fsdp)")
        tp = entry.get("tp", "replicate")
        if tp not in TP_STYLES:
            raise UsageError(f"{where}: tp {tp!r} is not one of {', '.join(TP_STYLES)}")
        fsdp = entry.get("fsdp", 0)
        fsdp = None if fsdp in (None, "none") else fsdp
        if fsdp is not None and (not isinstance(fsdp, int) or fsdp < 0):
            raise UsageError(f"{where}: fsdp must be a dim number or 'none'")
        try:
            rules.append(Rule(entry["match"], tp, bool(entry.get("experts", False)), fsdp))
        except re.error as exc:
            raise UsageError(f"{where}: match {entry['match']!r} is not a regular expression ({exc})") from None
    return Plan(str(data.get("name", path.stem)), f"plan file {path}", rules)


def choose(spec: str, names: list[str]) -> Plan:
    """The plan named by ``spec`` (a built-in name, a file, or ``auto``) for a model with these parameter names.

    ``auto`` picks the built-in plan whose rules match the most names; when none matches any,
    the data-parallel-only plan.
    """
    if spec != "auto":
        if spec in BUILTIN:
            return BUILTIN[spec]
        path = Path(spec)
        if not path.is_file():
            raise UsageError(f"{option('plan', spec)}: neither a built-in plan ({', '.join(BUILTIN)}, auto) nor a file")
        plan = load_plan_file(path)
        unmatched = [r.match for r in plan.rules if not any(r.pattern.search(n) for n in names)]
        if len(unmatched) == len(plan.rules):
            raise UsageError(f"{path}: the plan names no tensor of the checkpoint (no rule matches any key)")
        if unmatched:
            raise UsageError(f"{path}: rule {unmatched[0]!r} matches no tensor of the checkpoint")
        return plan
    scores = {name: sum(1 for n in names if plan.rule_for(n)) for name, plan in BUILTIN.items()}
    best = max(scores, key=scores.get)
    return BUILTIN[best] if scores[best] else BUILTIN["fsdp"]
