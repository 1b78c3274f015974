"""Megatron-Core's names: stacked decoder layers, fused q/k/v and gate/up, a padded vocabulary (``layers``), its
optimizer state by slot before parameter, and Megatron-LM's ``args`` beside the weights (``args``).

Its tensors are no row of one tensor each, so it maps through the hub's names (HF's): taken apart into them
(``layers.to_hf``) and on to any family, or from any family into them and put together (``layers.from_hf``).
What it writes is made for a tensor parallelism and vocabulary multiple (``MegatronOptions``), as Megatron-Core's
torch_dist checkpoint, which Megatron reshards as it loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dcptool import models
from dcptool.engine.core import ObjectInfo, TensorInfo
from dcptool.errors import UsageError, counted, option
from dcptool.family_interface import Family, FamilyOptions

# Its layers, args and mapping are imported where they are used: the command line lists the families as it starts.
if TYPE_CHECKING:
    from dcptool.families.megatron.mapping import MegatronMapping
    from dcptool.renaming import Entry

__all__ = ["FAMILY", "Megatron", "MegatronFamilyOptions", "MegatronOptions"]

# Megatron-LM's default make_vocab_size_divisible_by: the vocabulary is padded to a multiple of it x TP.
VOCAB_MULTIPLE = 128


@dataclass(frozen=True, kw_only=True)
class MegatronFamilyOptions(FamilyOptions):
    """A caller's choices for the Megatron-Core checkpoint written: ``make_vocab_size_divisible_by``, the multiple
    (times the tensor parallelism) its vocabulary is padded to, Megatron-LM's option of that name (default 128);
    ``megatron_spec``, the layer spec of the run that loads it, whose names it holds (``local``, the default, or
    ``te``: Transformer Engine's)."""

    make_vocab_size_divisible_by: int | None = None
    megatron_spec: str | None = None


@dataclass(frozen=True)
class MegatronOptions:
    """What a Megatron-Core checkpoint dcptool writes is made for: the tensor parallelism and multiple
    (``vocab_multiple``, Megatron-LM's ``--make-vocab-size-divisible-by``) its vocabulary is padded for, the
    dtype its weights are written in (None: the source's), and the layer spec whose names it holds (``spec``:
    ``local`` or ``te``, Transformer Engine's; ``models.kind.MEGATRON_SPECS``)."""

    tp: int = 1
    vocab_multiple: int = VOCAB_MULTIPLE
    dtype: str | None = None
    spec: str = "local"

    @property
    def padded_multiple(self) -> int:
        """The vocabulary is padded to a multiple of this, as Megatron-LM pads it."""
        return self.vocab_multiple * self.tp


class Megatron(Family):
    name = "megatron"
    rank = 3
    description = "Megatron-Core's torch_dist: stacked layers, fused qkv and gate/up, Megatron-LM's args"
    output_format = "megatron"  # its torch_dist folder, what its engine loads
    options_type = MegatronFamilyOptions
    more_than_others = "Megatron pads the vocabulary"
    slots_before_names = True

    def score(self, names: list[str]) -> int:
        from dcptool.families.megatron import layers

        return sum(layers.is_megatron([name]) for name in names)

    def kind_of(self, names: list[str]) -> str:
        from dcptool.families.megatron import layers

        found = layers.kind_of(names)
        if found is None:
            raise layers.unknown_kind(names)
        return found

    def names_kind(self, kind: models.ModelKind) -> bool:
        return bool(kind.megatron)

    def options(self, mesh: dict, dtype: str | None, given: MegatronFamilyOptions | None) -> MegatronOptions:
        """Megatron reshards global tensors as it loads: the mesh's tp sizes its vocabulary padding."""
        given = given or MegatronFamilyOptions()
        multiple, megatron_spec = given.make_vocab_size_divisible_by, given.megatron_spec
        if multiple is not None and multiple < 1:
            raise UsageError(f"{option('make_vocab_size_divisible_by', multiple)}: the vocabulary is padded to a "
                             "multiple of a positive number")
        if megatron_spec not in (None, *models.MEGATRON_SPECS):
            raise UsageError(f"{option('megatron_spec', megatron_spec)}: choose "
                             f"{' or '.join(models.MEGATRON_SPECS)} (the layer spec of the run that loads it)")
        return MegatronOptions(mesh.get("tp") or 1, multiple or VOCAB_MULTIPLE, dtype, megatron_spec or "local")

    def output_mesh(self, mesh: dict) -> dict:
        """One checkpoint of global tensors, which Megatron reshards as it loads."""
        if any(mesh.get(name) not in (None, 1) for name in ("dp", "ep", "cp", "dp_replicate", "world_size")):
            raise UsageError(f"{option('family', self.name)} writes one Megatron-Core checkpoint that Megatron "
                             f"reshards as it loads ({option('tp')} sizes its vocabulary padding): drop "
                             f"{option('dp')}, {option('ep')}, {option('cp')}, {option('dp_replicate')} and "
                             f"{option('world_size')}")
        return {**mesh, "dp": 1, "tp": 1, "ep": 1, "etp": 1, "cp": 1, "dp_replicate": 1, "world_size": None}

    def mapping(self, kind, source, target, config, options, where, hub) -> MegatronMapping:
        from dcptool.families.megatron.mapping import MegatronMapping

        return MegatronMapping(kind, source, target, config, options, where, hub)

    def completed_config(self, config: dict | None, run: dict) -> dict | None:
        """What a Megatron-LM run's ``args`` (its common state, read as data) say of the model: head counts,
        layers, the vocabulary before padding."""
        from dcptool.families.megatron import args as run_args

        from_args = run_args.config_from_args(run.get("args"))
        if not from_args:
            return config
        return {**from_args, **models.text_config(config)}

    def config_from_run(self, kind: str, run: dict) -> tuple[dict | None, list[str]]:
        from dcptool.families.megatron import args as run_args

        if not run.get("args"):
            return None, []
        config, line = run_args.hf_config_from_args(kind, run["args"])
        return config, ["head counts and vocab_size from the Megatron-LM run's args (its common state)", line]

    def config_to_compare(self, config: dict | None, other: dict[str, TensorInfo]) -> dict | None:
        """Its padded embedding is compared on the other side's rows: the vocabulary size comes from the other's
        embedding where the config has none."""
        config = models.text_config(config)
        if isinstance(config.get("vocab_size"), int):
            return config
        rows = next((t.shape[0] for name, t in other.items() if models.is_input_embedding(name) and t.shape), None)
        return config if rows is None else {**config, "vocab_size": rows}

    def own_state(self, keys: list[str], target: Family) -> tuple[list[str], list[str]]:
        from dcptool.families.megatron import layers

        own = [key for key in keys if layers.SHARDED_OBJECT.search(key)]
        buckets = [key for key in keys if layers.DP_BUCKET.search(key)]
        lines = []
        if own:
            lines.append(f"{counted(len(own), 'Megatron-Core ShardedObject')} (layers' _extra_state, RNG, common "
                         f"state: {target.name} jobs have no use for them): {', '.join(own[:2])}"
                         + (" ..." if len(own) > 2 else ""))
        if buckets:
            lines.append(f"{counted(len(buckets), 'dp_reshardable optimizer bucket')} ({buckets[0]} ...): Megatron's "
                         "distributed optimizer flattens a DDP bucket's parameters into one 1-D tensor whose order "
                         "and padding only the model's bucketing rebuilds; save with "
                         "--dist-ckpt-optim-fully-reshardable to carry optimizer state")
        return own + buckets, lines

    def made_state(self, mapping: MegatronMapping, weights: dict[str, Entry], out: dict[str, Entry]) -> list[str]:
        """Megatron-LM's ``iteration`` (0) and, for the kinds they describe, its ``args`` for a checkpoint made from
        another family, as its own HF conversion writes them (the Megatron format puts them in the common state),
        unless the source has its own; for Transformer Engine's layer spec, the ``_extra_state`` objects of the
        norms it keeps apart (``layers.te_norm_states``; the linear layers' the Megatron format adds)."""
        from dcptool.families.megatron import args as run_args
        from dcptool.families.megatron import layers
        from dcptool.safe_pickle import record

        lines = []
        if mapping.output.spec == "te":
            states = layers.te_norm_states(weights)
            out.update((key, state) for key, state in states.items() if key not in out)
            lines.append(f"{counted(len(states), 'empty _extra_state object')} of the norms Transformer Engine's "
                         "spec keeps apart (its RMSNorm's FP8 state)")
        if "args" in out:
            return lines
        out["iteration"] = ObjectInfo(("iteration",), value=0)
        args = run_args.run_args(mapping.model, mapping.config, weights, mapping.output)
        if args is None:
            return [*lines, (f"iteration 0; no args: dcptool writes them for {', '.join(run_args.args_kinds())} "
                             "given the model's config.json")]
        out["args"] = ObjectInfo(("args",), value=record("argparse.Namespace", args))
        return [*lines, (f"args: {len(args)} fields of Megatron-LM's arguments from the config (padded_vocab_size "
                         f"{args['padded_vocab_size']}, make_vocab_size_divisible_by "
                         f"{args['make_vocab_size_divisible_by']}, transformer_impl {args['transformer_impl']}), "
                         "iteration 0")]


FAMILY = Megatron()
