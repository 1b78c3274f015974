"""The interface of a naming family: what every module of ``dcptool/families/`` implements.

A naming family is how one kind of training job names a model's weights and keeps its state: Hugging
Face's names, an engine's own (grouped experts, interleaved RoPE rows, stacked layers), where its job keeps
model and optimizer. A family module defines ``FAMILY``, an instance of a ``Family`` subclass;
``dcptool.families`` finds them by listing the package, and it alone imports them. Everything else asks a
family what it declares (where its engine keeps its state, the format it writes to, the options it takes, how
its names lay tensors out) and never compares a family's name.

By default a family's names are a column of the model kinds' rows (``models.Row``): ``dcptool.renaming``
maps between such families row by row. A family whose tensors are no row of one tensor each (Megatron-Core's
stacked, fused layers) gives its own ``mapping`` to and from the hub's names (HF's), and the other families
are reached through those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from dcptool import models
from dcptool.engine.core import TensorInfo
from dcptool.options import Options

if TYPE_CHECKING:
    from dcptool.renaming import Entry, Result


@dataclass(frozen=True)
class EngineState:
    """Where a family's training job keeps its state in the dict it hands ``dcp.save`` and ``dcp.load``:
    the path of the model's weights (``()``: at the top level) and of its flattened optimizer state
    (``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``: ``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``); ``also_loads``: the other top-level entries its resume loads, and
    ``without_them`` how to start the job from a checkpoint that lacks them."""

    engine: str
    model: tuple[str, ...]
    optimizer: tuple[str, ...]
    also_loads: tuple[str, ...] = ()
    without_them: str = ""


class FamilyOptions(Options):
    """Base of a naming family's own options (a caller's choices for the names it writes): each family that takes
    any declares a frozen dataclass of them in its module (``Family.options_type``), built by name through
    ``dcptool.family_options("megatron", make_vocab_size_divisible_by=64)`` (``families.given``), which refuses
    what the family does not take."""


class Mapping(Protocol):
    """Entries of model ``kind`` from family ``source``'s names to ``target``'s (``Family.mapping`` makes one)."""

    kind: str
    source: Family
    target: Family
    config: dict

    def convert(self, entries: dict[str, Entry], model: bool = True) -> Result:
        """``entries`` under the target's names, as views of the same bytes. ``model``: these are the weights
        themselves (tied outputs are completed); optimizer state under the same names is not."""

    def untranslatable(self, names) -> list[str]:
        """The names of the source whose tensors the target has no place for (``convert`` drops them)."""


class Family:
    """One naming family. A subclass sets the class attributes; one whose names are no column of the model
    kinds' rows overrides ``score``, ``kind_of`` and ``mapping`` too.

    >>> class Plain(Family):
    ...     name, rank = "plain", 9
    >>> Plain().engine_state is None, Plain().output_format, Plain().options_type
    (True, None, None)
    """

    name: ClassVar[str]
    rank: ClassVar[int]  # its place in lists of families (the command line's choices): the lowest first
    # Whose names these are and how they look, for the command line's help (``--adapter``).
    description: ClassVar[str] = ""
    # The hub: the names every other family maps to and from (a mapping between two others may go through them),
    # a Hugging Face folder's. Names no table knows stay as they are in it.
    hub: ClassVar[bool] = False
    # Where its engine keeps model and optimizer (an output in its names is laid out so); None: as the source has them.
    engine_state: ClassVar[EngineState | None] = None
    # The format its engine loads, when it has one of its own (``import-hf`` writes it); None: DCP's.
    output_format: ClassVar[str | None] = None
    # The options a caller may give for the names it writes (``options`` makes what its mapping uses of them).
    options_type: ClassVar[type[FamilyOptions] | None] = None
    # Among families whose tables name as many of a checkpoint's names, the one of the highest priority is it.
    detect_priority: ClassVar[int] = 0
    # Why its tensors hold rows no other family keeps (a padded vocabulary), or None: compared with another family,
    # its side is the one taken apart into the other's names, never built from them.
    more_than_others: ClassVar[str | None] = None
    # How its names lay tensors out, which the rows' mapping follows (``dcptool.renaming.TableMapping``):
    experts_apart: ClassVar[bool] = False  # one tensor per routed expert (not grouped as [E, ...])
    rope_halves: ClassVar[bool] = False  # q/k rows in rotate-half order (not interleaved in pairs for RoPE)
    predictions_after_main: ClassVar[bool] = False  # prediction (MTP) layers numbered after the main layers
    may_omit_tied_output: ClassVar[bool] = False  # an output weight tied to the embedding may be absent
    # Optimizer state by slot, then parameter (``state.<slot>.<name>``), not torch's ``state.<name>.<slot>``.
    slots_before_names: ClassVar[bool] = False

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    # --- finding it -------------------------------------------------------------------------------------------

    def score(self, names: list[str]) -> int:
        """How many of ``names`` are this family's (the registry's detection takes the highest)."""
        from dcptool import renaming  # the rows' machinery only once names are looked at: the CLI lists families

        return renaming.table_score(self, names)

    def kind_of(self, names: list[str]) -> str:
        """The model kind these names (this family's) are of, judged from them alone."""
        from dcptool import renaming

        return renaming.table_kind(self, names)

    def names_kind(self, kind: models.ModelKind) -> bool:
        """Whether it has names for model ``kind`` (a family with no such model has None in every row)."""
        return any(row.name(self.name) for row in kind.rows)

    # --- options and outputs ----------------------------------------------------------------------------------

    def options(self, mesh: dict, dtype: str | None, given: FamilyOptions | None) -> Any:
        """What its mapping writes for: an output for ``mesh`` (``dp``, ``tp``, ...) in ``dtype``, with the caller's
        ``given`` options (an ``options_type``, its defaults when None); None when it takes none."""
        return None

    def output_mesh(self, mesh: dict) -> dict:
        """The mesh an output in its names is laid out for, when ``mesh`` is asked for; a mesh its engine cannot
        load is refused (``UsageError``)."""
        return mesh

    def fused_experts(self, options: Any) -> bool:
        """Whether its ``options`` ask for experts fused into one tensor (transformers v5's form): then even its
        own names are rewritten."""
        return False

    # --- the mapping ------------------------------------------------------------------------------------------

    def mapping(self, kind: str, source: Family, target: Family, config: dict | None, options: Any,
                where: str, hub: Family) -> Mapping | None:
        """Its own mapping of ``kind`` from ``source`` to ``target`` (one of them this family), through ``hub``'s
        names; None: the rows' (``renaming.TableMapping``). ``options``: the target's; ``where`` names the
        checkpoint in refusals."""
        return None

    # --- the model's config -----------------------------------------------------------------------------------

    def completed_config(self, config: dict | None, run: dict) -> dict | None:
        """``config`` completed by what a checkpoint in its names says of its training run (``run``: the
        checkpoint's ``info``); the config wins."""
        return config

    def config_from_run(self, kind: str, run: dict) -> tuple[dict | None, list[str]]:
        """A Hugging Face config.json made from what the checkpoint says of its run, with lines saying so;
        (None, []) where it says nothing."""
        return None, []

    def config_to_compare(self, config: dict | None, other: dict[str, TensorInfo]) -> dict | None:
        """The config for taking its names apart onto ``other``'s weights (another family's) to compare them."""
        return config

    # --- a whole training state ---------------------------------------------------------------------------------

    def own_state(self, keys: list[str], target: Family) -> tuple[list[str], list[str]]:
        """Of ``keys`` (entries that name no weight), those that are its engine's alone, which ``target``'s jobs
        have no use for (left out when its names are renamed), and lines saying why."""
        return [], []

    def made_state(self, mapping: Mapping, weights: dict[str, Entry], out: dict[str, Entry]) -> list[str]:
        """The state its engine needs beside weights renamed into its names (``weights``), added to ``out``;
        lines on what was made."""
        return []
