"""Options more than one command takes, the choices of options as Literal types, and the groups of flags that
build the API's option objects (``dcptool.options``).

A command takes an option object as one parameter whose default is a ``Group``; ``grouped`` puts the group's
flags in its place and calls the command with the object built from them, so a group is declared once. Every
parameter is named by the key messages name its option by (``errors.option``: ``tp``, ``format`` for
``--from``), so ``cli.flags`` maps those keys to flags.
"""

from __future__ import annotations

import functools
import inspect
from copy import copy
from dataclasses import dataclass, replace
from typing import Any, Callable, Literal, Optional

import typer

from dcptool import dtypes, families, formats, models
from dcptool.planning import plans
from dcptool.cli import render
from dcptool.options import Completeness, MeshOptions, Reading, Selection, Side, Writing

# An output: a local Path, or a URL kept as given (storage.output_path decides). Not annotated Path:
# typer would make the URL "s3://b/x" the path "s3:/b/x".
OutputLocation = str

# Choices as Literal types, so that help lists them and click refuses anything else with exit 2.
FormatName = Literal[tuple(formats.names())]
OutputFormat = Literal[tuple(formats.writable())]
CastDtype = Literal[dtypes.CASTABLE]
Family = Literal[tuple(families.names())]
FamilyOrAuto = Literal[("auto", *families.names())]
# reshard writes the formats laid out over ranks (a mesh, or data-parallel ranks)
LaidOutFormat = Literal[tuple(name for name in formats.writable() if formats.get(name).sharding.value != "none")]
OptimForm = Literal["named", "flat", "orig", "fsdp2"]
Compression = Literal[tuple(sorted({c for f in formats.all_formats().values() for c in f.compressions}))]


DtypeOption = typer.Option(None, "--dtype", help="Cast floating-point tensors to this dtype.")
TargetFamilyOption = typer.Option(None, "--adapter", help="Write model weights and their optimizer state under this family's names and in its engine's layout: " + families.described() + ". Default: the source's.")
JsonOption = typer.Option(False, "--json", help="Print a JSON report (exit codes stay the same).")
PlanOption = typer.Option("auto", "--plan", help="Placement plan: auto (by the model's config.json: its kind's table, else transformers' plan of the model), " + ", ".join([*plans.BUILTIN, plans.TRANSFORMERS]) + ", or a YAML/JSON plan file.")
ConfigDirOption = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with the model's config.json: heads, kv heads and experts are checked against tp and ep.")


@dataclass(frozen=True)
class Flag:
    """One flag of a group: the typer parameter (named by its message key), and the field of the option object
    it sets (``negated``: ``--no-fsync`` sets ``fsync`` to False)."""

    key: str
    field: str
    annotation: Any
    option: Any  # typer.Option(...)
    negated: bool = False


@dataclass(frozen=True)
class Group:
    """Flags that build one option object: ``build(**fields)``, given also the command's own parameters named in
    ``uses`` (the output format). A command takes the object as a parameter whose default is the group."""

    build: Callable[..., Any]
    flags: tuple[Flag, ...]
    uses: tuple[str, ...] = ()

    def only(self, *keys: str) -> Group:
        """The group with only the flags of these keys (in the group's order)."""
        return replace(self, flags=tuple(flag for flag in self.flags if flag.key in keys))

    def helped(self, **helps: str) -> Group:
        """The group with its flags of these keys described as a command needs them."""
        return replace(self, flags=tuple(replace(flag, option=_described(flag.option, helps[flag.key]))
                                         if flag.key in helps else flag for flag in self.flags))


def _described(option: Any, text: str) -> Any:
    """A copy of a ``typer.Option`` with another help text."""
    described = copy(option)
    described.help = text
    return described


def grouped(command: Callable) -> Callable:
    """``command`` with each parameter whose default is a ``Group`` replaced, where it stands, by the group's
    flags; it is called with that parameter set to the object the group builds from them."""
    parameters = inspect.signature(command).parameters
    groups = {name: p.default for name, p in parameters.items() if isinstance(p.default, Group)}
    flat, annotations = [], {}
    for name, parameter in parameters.items():
        if name not in groups:
            flat.append(parameter)
            annotations[name] = command.__annotations__[name]
            continue
        for flag in groups[name].flags:
            flat.append(inspect.Parameter(flag.key, parameter.kind, default=flag.option, annotation=flag.annotation))
            annotations[flag.key] = flag.annotation

    @functools.wraps(command)
    def run(**values):
        for name, group in groups.items():
            fields = {flag.field: not values.pop(flag.key) if flag.negated else values.pop(flag.key)
                      for flag in group.flags}
            values[name] = group.build(**fields, **{used: values[used] for used in group.uses})
        return command(**values)

    run.__signature__ = inspect.Signature(flat)
    run.__annotations__ = {**annotations, "return": command.__annotations__.get("return")}
    return run


def _given(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields whose flags were given (flags left out are None, or False for a flag without a value)."""
    return {name: value for name, value in fields.items() if value is not None and value is not False}


# Reading: how the sources are read; the progress bar is the command line's.
READING = Group(lambda **fields: Reading(**fields, progress=render.progress), (
    Flag("format", "format", Optional[FormatName], typer.Option(None, "--from", help="Source format (detected when omitted).")),
    Flag("revision", "revision", Optional[str], typer.Option(None, "--revision", metavar="REV", help="Branch, tag or commit of a source that is a Hugging Face hub repo (ORG/NAME; or hf://ORG/NAME@REVISION).")),
    Flag("dequantize", "dequantize", bool, typer.Option(False, "--dequantize", help="Turn block-scaled float8 weights (X.weight + X.weight_scale_inv, block size from config.json's quantization_config) and MXFP4 experts (GPT-OSS's X_blocks + X_scales, as X) into --dtype (default bfloat16); the scales are left out.")),
    Flag("max_memory", "max_memory", str, typer.Option("256MiB", "--max-memory", help="Budget for data buffers; larger tensors move in pieces.")),
    Flag("verify_records", "verify_records", bool, typer.Option(False, "--no-verify-records", help="Read records (torch.save archives: DCP chunks and objects, torch.save and FSDP1 files) without checking their zip structure and CRC-32s, which dcptool checks by default and refuses a damaged one (exit 2); only for a user who accepts that damaged bytes are read or copied as they are."), negated=True),
))

# Writing: how an output is written. One flag, not --fsync/--no-fsync: a second column of names would narrow
# every description at 80 columns.
WRITING = Group(Writing, (
    Flag("overwrite", "overwrite", bool, typer.Option(False, "--overwrite", help="Replace DST if it exists (only once the new output is complete).")),
    Flag("fsync", "fsync", bool, typer.Option(False, "--no-fsync", help="Rename outputs into place without flushing them to disk first (faster; after a power loss a renamed output may be incomplete)."), negated=True),
    Flag("dry_run", "dry_run", bool, typer.Option(False, "--dry-run", help="Print the plan and its problems; write nothing.")),
))

SELECTION = Group(Selection, (
    Flag("include", "include", Optional[str], typer.Option(None, "--include", help="Only keys matching this regular expression.")),
    Flag("exclude", "exclude", Optional[str], typer.Option(None, "--exclude", help="Leave out keys matching this regular expression.")),
    Flag("prefix", "prefix", Optional[str], typer.Option(None, "--prefix", help="Wrapper of the model's keys, e.g. 'dcp.model' (found automatically).")),
))

# The mesh a reshard lays a checkpoint out for (reshard, import-hf, average).
MESH = Group(MeshOptions, (
    Flag("dp", "dp", Optional[int], typer.Option(None, "--dp", help="FSDP shard degree (default: keeps the source's world size, else 1).")),
    Flag("tp", "tp", int, typer.Option(1, "--tp", help="Tensor-parallel degree.")),
    Flag("ep", "ep", int, typer.Option(1, "--ep", help="Expert-parallel degree (borrows data-parallel ranks).")),
    Flag("etp", "etp", str, typer.Option("1", "--etp", help="Tensor-parallel degree of the experts: 1 or tp.")),
    Flag("cp", "cp", int, typer.Option(1, "--cp", help="Context-parallel degree (FSDP shards over dp*cp).")),
    Flag("dp_replicate", "dp_replicate", int, typer.Option(1, "--dp-replicate", help="HSDP replicas (each holds the dp shards).")),
    Flag("world_size", "world_size", Optional[int], typer.Option(None, "--world-size", help="Ranks of the target job; must equal dp_replicate*dp*cp*tp.")),
    Flag("plan", "plan", str, PlanOption),
))


# What an HF-named output may lack of the model its config describes, or hold beyond it (export-hf, import-hf,
# convert --adapter hf).
COMPLETENESS = Group(lambda allow_missing, allow_unexpected: Completeness(allow_missing=tuple(allow_missing or ()),
                                                                          allow_unexpected=allow_unexpected), (
    Flag("allow_missing", "allow_missing", Optional[list[str]], typer.Option(None, "--allow-missing", metavar="PART,...", help=f"Accept an output that lacks these parts of the model its config.json describes, which from_pretrained fills with random weights (refused otherwise, exit 2): {', '.join(models.PARTS)}; a comma list, or the flag repeated.")),
    Flag("allow_unexpected", "allow_unexpected", bool, typer.Option(False, "--allow-unexpected", help="Keep tensors the model of config.json has no place for, which from_pretrained drops (refused otherwise, exit 2).")),
))


def _mesh_if_given(**fields) -> MeshOptions | None:
    mesh = MeshOptions(**fields)
    return mesh if mesh.sizes_given() else None


OPTIONAL_MESH = replace(MESH, build=_mesh_if_given)  # None unless a size is given: average's own layout


# A format's own options (formats.options): each command builds them for its output format (``to``).
FORMAT_OPTIONS = Group(lambda to, **fields: formats.options(to, **_given(fields)), (
    Flag("world_size", "world_size", Optional[int], typer.Option(None, "--world-size", help="Ranks to write for --to fsdp1 (default 1).")),
    Flag("keep_rank_state", "keep_rank_state", bool, typer.Option(False, "--keep-rank-state", help="With --to fsdp1: give each new rank the state its source rank saved of its own (RNG) instead of dropping it.")),
    # verl's FSDP1 files (--to fsdp1): how the optimizer and model files hold their tensors (converters/fsdp1/planning.output_forms).
    Flag("optim_form", "optim_form", Optional[OptimForm], typer.Option(None, "--optim-form", help="With --to fsdp1, how the optimizer files hold the state: flat (verl's plain optimizer.state_dict() under FSDP1 with use_orig_params=False, its default) or orig (use_orig_params=True), which verl's optimizer.load_state_dict loads as they are; or named (FSDP.optim_state_dict, loaded through its optim_state_dict_to_load); or fsdp2 (an FSDP2 folder: optimizer.state_dict() of fully_shard, DTensor moments and model values, FSDP_version 2). Default: the source folder's form, else named.")),
    Flag("model_values", "model_values", Optional[str], typer.Option(None, "--model-values", help="With --to fsdp1: sharded-tensor (FSDP1 without a device mesh) or dtensor[:DEVICE] (FSDP1 given verl's 1-D device mesh, which must equal the loading job's: on DEVICE, else the source mesh's device type, else cuda; named as the source mesh, else fsdp). Default: the source folder's, else sharded-tensor.")),
    Flag("max_shard_size", "max_shard_size", Optional[str], typer.Option(None, "--max-shard-size", help="Largest safetensors file for --to hf (default 5GB, the hub's).")),
    Flag("compress", "compress", Optional[Compression], typer.Option(None, "--compress", help="Compress DCP records as torch's zstd extension does (dcp.load reads them; needs the zstandard package).")),
), uses=("to",))


def format_options_of(format: str, *keys: str) -> Group:  # noqa: A002 - a format's name
    """The flags of ``keys`` of ``FORMAT_OPTIONS`` for a command whose output is always ``format``."""
    return replace(FORMAT_OPTIONS.only(*keys), build=lambda **fields: formats.options(format, **_given(fields)),
                   uses=())


def side(letter: str) -> Group:
    """verify's and diff's options of side A or B (``--prefix-a``, ``--from-a``, ``--adapter-a``)."""
    side_name = letter.upper()
    return Group(Side, (
        Flag(f"prefix_{letter}", "prefix", Optional[str], typer.Option(None, f"--prefix-{letter}", help=f"Compare only keys under this wrapper of {side_name}, with it stripped (e.g. 'dcp.model'); 'auto' finds the model part as export-hf does.")),
        Flag(f"format_{letter}", "format", Optional[FormatName], typer.Option(None, f"--from-{letter}", help=f"Format of {side_name} (detected when omitted).")),
        Flag(f"family_{letter}", "family", FamilyOrAuto, typer.Option("auto", f"--adapter-{letter}", help=f"Naming family of {side_name}'s weights" + ("; when A and B differ, B's weights are compared under A's names." if letter == "a" else "."))),
    ))
