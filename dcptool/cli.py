"""The ``dcptool`` command line. Bad input exits 2 with one line naming the file; ``--debug`` shows tracebacks."""

from __future__ import annotations

import io
import json
import os
import re
import sys
import traceback
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

import typer

from dcptool import core, dtypes, formats, hub, selection
from dcptool.adapters.table import FAMILIES
from dcptool.errors import DcptoolError, MismatchError, UsageError, counted
from dcptool.storage import check_destination, is_remote, output_path, parse_size

# Each command imports what it runs (convert, reshard, verify, checksum, rich) when it runs, so that
# `inspect` starts fast (issue 5); these imports are for annotations only.
if TYPE_CHECKING:
    from dcptool import checksums, conversion, verification

app = typer.Typer(
    name="dcptool",
    help="Inspect, convert, reshard and verify PyTorch distributed checkpoints offline: DCP, FSDP1, torch.save, HF safetensors.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)
# An output: a local Path, or a URL kept as given (storage.output_path decides). Not annotated Path:
# typer would make the URL "s3://b/x" the path "s3:/b/x".
OutputLocation = str

# Choices as Literal types, so that help lists them and click refuses anything else with exit 2.
FormatName = Literal[tuple(formats.names())]
OutputFormat = Literal[tuple(formats.writable())]
CastDtype = Literal[dtypes.CASTABLE]
Family = Literal[FAMILIES]
FamilyOrAuto = Literal[("auto", *FAMILIES)]
_state = {"debug": False, "quiet": False}
# Control characters and lone surrogates, which a key read from a file may hold: shown as escapes,
# so a name cannot move the cursor, recolour the terminal or forge a line of output.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(name: str) -> str:
    """A name from a checkpoint as one printable line: ``"a\\nb\\x1b[31m"`` for ``"a\nb\x1b[31m"``."""
    return _CONTROL_OR_NEWLINE.sub(_escape, name)


class _EscapingStream(io.TextIOBase):
    """stdout or stderr with control characters escaped (newlines and tabs of our own output kept)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(_CONTROL.sub(_escape, text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


@cache
def _err():
    """The rich console on stderr, for progress bars and notes (its own escape codes must pass unescaped)."""
    from rich.console import Console

    stderr = sys.stderr.stream if isinstance(sys.stderr, _EscapingStream) else sys.stderr
    return Console(file=stderr)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


FromOption = typer.Option(None, "--from", help="Source format (detected when omitted).")
OverwriteOption = typer.Option(False, "--overwrite", help="Replace DST if it exists (only once the new output is complete).")
MaxMemoryOption = typer.Option("256MB", "--max-memory", help="Budget for data buffers; larger tensors move in pieces.")
DtypeOption = typer.Option(None, "--dtype", help="Cast floating-point tensors to this dtype.")
IncludeOption = typer.Option(None, "--include", help="Only keys matching this regular expression.")
ExcludeOption = typer.Option(None, "--exclude", help="Leave out keys matching this regular expression.")
FsyncOption = typer.Option(True, "--fsync/--no-fsync", help="Flush outputs to disk before the final rename.")
RevisionOption = typer.Option(None, "--revision", metavar="REV", help="Branch, tag or commit of a source that is a Hugging Face hub repo (ORG/NAME; or hf://ORG/NAME@REVISION).")
DequantizeOption = typer.Option(False, "--dequantize", help="Turn block-scaled float8 weights (X.weight + X.weight_scale_inv, block size from config.json's quantization_config) into --dtype (default bfloat16); the scales are left out.")
CompressOption = typer.Option(None, "--compress", help="Compress DCP records as torch's zstd extension does (dcp.load reads them; needs the zstandard package).")
TargetAdapterOption = typer.Option(None, "--adapter", help="Write model weights and their optimizer state under this family's names: hf, archon (AReaL Archon, torchtitan before 0.3) or torchtitan (0.3 and later). Default: the source's.")


def _notes(notes: list[str]) -> None:
    """What an adapter found and left out, on stderr (kept under --quiet: nothing is dropped without a line)."""
    for note in notes:
        _err().print(shown(note), soft_wrap=True, markup=False, highlight=False)


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"dcptool {version('dcptool')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("dcptool (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors (also after the command name)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars (also after the command name)."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    _state["debug"], _state["quiet"] = debug, quiet
    if quiet or not sys.stderr.isatty():  # huggingface_hub's bars (hub downloads, uploads), like ours; read at its import
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if not isinstance(sys.stdout, _EscapingStream):
        sys.stdout, sys.stderr = _EscapingStream(sys.stdout), _EscapingStream(sys.stderr)


@contextmanager
def _progress(total: int, what: str):
    """A byte progress bar on a terminal, unless --quiet; yields the callback to advance it."""
    if _state["quiet"] or not sys.stderr.isatty():  # rich, imported only for a bar, costs 20 ms of start-up
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_err(), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def _summary(report: conversion.Report, dropped: dict[str, list[str]] | None = None, why: str = "",
             reasons: dict[str, str] | None = None) -> None:
    """The written line, and one line of everything the output does not hold, grouped by why.

    ``dropped``: the source's entries planning did not choose (``conversion.left_out``), by kind; each
    for its reason in ``reasons``, else ``why``. The objects the writer could not hold
    (``report.left_out``) are said apart.
    """
    print(f"wrote {report.destination} ({report.format}): {counted(report.tensors, 'tensor')}, {report.bytes_written:,} bytes")
    unheld = f"{report.format} cannot hold them"
    groups: dict[str, dict[str, list[str]]] = {}  # reason -> kind -> keys
    for kind, keys in (dropped or {}).items():
        for key in keys:
            reason = unheld if key in report.left_out else (reasons or {}).get(key, why or "not chosen")
            groups.setdefault(reason, {}).setdefault(kind, []).append(key)
    for key in report.left_out:
        if not any(key in keys for kinds in groups.values() for keys in kinds.values()):
            groups.setdefault(unheld, {}).setdefault("non-tensor entries", []).append(key)
    if groups:
        singular = {"non-tensor entries": "non-tensor entry", "optimizer tensors": "optimizer tensor", "other tensors": "other tensor"}
        said = "; ".join(", ".join(counted(len(keys), singular[kind], kind) for kind, keys in kinds.items()) + f" ({reason})"
                         for reason, kinds in groups.items())
        print(f"left out: {said}: {_grouped([key for kinds in groups.values() for keys in kinds.values() for key in keys])}")


def _chunking(tensor) -> str:
    if len(tensor.chunks) == 1:
        return "1 chunk"
    splits = core.chunk_splits(tensor.chunks, len(tensor.shape))
    split = " x ".join(f"{n} along dim {d}" for d, n in enumerate(splits) if n > 1)
    return f"{len(tensor.chunks)} chunks" + (f" ({split})" if split else "")


def _aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """A plain text table, columns padded to their widest cell (``right``: right-aligned columns).

    Plain text rather than a rich table: keys are never cut to the terminal's width, the lines
    grep and cut well, and 2,000 rows print in milliseconds instead of a second.
    """
    widths = [max(map(len, column)) for column in zip(header, *rows)]

    def line(cells):
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header), *map(line, rows)]


def _grouped(keys, limit: int = 12) -> str:
    """Keys as a short line: long lists are grouped by their first two parts (``optimizer.param_groups.* (230)``)."""
    keys = [shown(key) for key in keys]
    if len(keys) <= limit:
        return ", ".join(keys)
    groups: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        group = ".".join(parts[:2]) + (".*" if len(parts) > 2 else "")
        groups[group] = groups.get(group, 0) + 1
    return ", ".join(f"{g} ({n})" if n > 1 else g for g, n in groups.items())


@app.command()
def inspect(
    path: str = typer.Argument(..., help="Checkpoint folder or file (or a URL: s3://..., memory://...; or a hub repo ORG/NAME)."),
    source_format: Optional[FormatName] = FromOption,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of a table."),
    revision: Optional[str] = RevisionOption,
    include: Optional[str] = IncludeOption,
    show_all: bool = typer.Option(False, "--all", "--no-collapse", help="One row per key (by default numbered layers of one dtype, shape and chunking fold into one row)."),
    with_stats: bool = typer.Option(False, "--stats", help="Read every tensor: min, max, mean, std, L2 norm, zeros, NaN, Inf; flag all-zero tensors and experts, NaN/Inf, identical tensors."),
    layout_key: Optional[str] = typer.Option(None, "--layout", metavar="KEY", help="Draw which rank holds which block of this tensor."),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="With --layout: lay it out on this mesh (dp=2,tp=4[,ep=..,etp=..,cp=..,dp_replicate=..]) as reshard would, instead of as saved."),
    plan: str = typer.Option("auto", "--plan", help="With --mesh: placement plan (auto, hf, torchtitan, fsdp, or a YAML/JSON plan file)."),
    svg: Optional[Path] = typer.Option(None, "--svg", help="With --layout: also write the picture to this SVG file (replaced if it exists)."),
    threads: int = typer.Option(0, "--threads", help="With --stats: reading threads (default: the CPUs, at most 4)."),
    max_memory: str = MaxMemoryOption,
) -> None:
    """Show a checkpoint's format, tensors (dtype, shape, bytes, chunking), parameter count, other entries and files.

    [bold]Examples[/bold]:
      [cyan]dcptool inspect checkpoints/step-1000 --json[/cyan]
      [cyan]dcptool inspect step-1000 --stats --include 'layers\\.1[0-9]\\.'[/cyan]
      [cyan]dcptool inspect step-1000 --layout model.layers.0.self_attn.q_proj.weight --mesh dp=2,tp=4 --svg q.svg[/cyan]
    """
    from dcptool import stats

    path, = hub.with_revision(path, revision=revision)
    checkpoint = formats.open_checkpoint(path, source_format)
    if layout_key is not None:
        _draw_layout(checkpoint, layout_key, mesh, plan, svg, as_json)
        return
    if mesh or svg:
        raise UsageError("--mesh and --svg go with --layout KEY")
    tensors, objects = stats.included(checkpoint.tensors, include), stats.included(checkpoint.objects, include)
    files = checkpoint.data_files()
    disk = sum(checkpoint.files.size(f) for f in files)
    ranks_recorded = any(core.ranks_recorded(t.chunks) for t in checkpoint.tensors.values())
    inferred = None
    if ranks_recorded:
        from dcptool import resharding

        inferred = resharding.infer_mesh(checkpoint)
    names = _naming(checkpoint)
    parameters = stats.parameter_counts(checkpoint, tensors)
    summary = _read_stats(checkpoint, tensors, threads, max_memory) if with_stats else None
    if as_json:
        report = {
            "format": checkpoint.format,
            "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": len(t.chunks)}
                        for k, t in tensors.items()},
            "objects": list(objects),
            "total_bytes": sum(t.nbytes for t in tensors.values()),
            "files": {"count": len(files), "bytes": disk},
            "info": {k: str(v) if isinstance(v, Path) else v for k, v in checkpoint.info.items()},
            "mesh": None if inferred is None else inferred[0].as_dict() | {"plan": inferred[1].name},
            "names": names,
            "parameters": parameters,
        }
        if summary:
            report["stats"] = summary.to_json()
        print(json.dumps(report, indent=2))
        return

    def describe(key):
        return tensors[key].dtype, str(list(tensors[key].shape)), _chunking(tensors[key])

    rows = []  # numbered keys that agree fold into one row (model.layers.{0..79}.mlp.up_proj.weight), unless --all
    for name, keys in stats.folded_rows(list(tensors), describe, minimum=len(tensors) + 1 if show_all else 3):
        dtype, shape, chunking = describe(keys[0])
        rows.append((shown(name), dtype, shape, f"{sum(tensors[k].nbytes for k in keys):,}", chunking))
    lines = [f"{path} ({checkpoint.format})", *_aligned(("key", "dtype", "shape", "bytes", "chunks"), rows, right={3})]
    lines += stats.parameter_lines(parameters, shown)
    if objects:
        lines.append(f"non-tensor entries ({len(objects)}): {_grouped(objects)}")
    lines.append(f"{counted(len(tensors), 'tensor')}, {sum(t.nbytes for t in tensors.values()):,} bytes of tensor data; "
                 f"{counted(len(files), 'data file')}, {disk:,} bytes on disk")
    lines += [f"{key}: {value}" for key, value in checkpoint.info.items() if value is not None]
    if names:
        lines.append(f"names: {names['family']}" + (f" ({names['kind']})" if names["kind"] else ""))
    if inferred:
        lines.append(f"saved on mesh {inferred[0].describe()} (plan {inferred[1].name})")
    elif ranks_recorded:
        lines.append("saved on a mesh no built-in plan reproduces")
    if summary:
        lines += _aligned(stats.STATS_HEADER, stats.stats_rows(summary, shown), right=set(range(1, 9)))
        lines += stats.summary_lines(summary, shown)
    print("\n".join(lines))


def _read_stats(checkpoint, tensors, threads: int, max_memory: str):
    """inspect --stats: every tensor read once, with a progress bar."""
    from dcptool import stats

    with _progress(sum(t.nbytes for t in tensors.values()), "reading") as advance:
        return stats.compute(checkpoint, tensors, max_memory=_size(max_memory), threads=threads or None, progress=advance)


def _draw_layout(checkpoint, key: str, mesh: Optional[str], plan: str, svg: Optional[Path], as_json: bool) -> None:
    """inspect --layout KEY: the text grid (or JSON) of who holds what, and the SVG picture when asked."""
    from dcptool import layout

    picture = layout.planned_layout(checkpoint, key, mesh, plan) if mesh else layout.saved_layout(checkpoint, key)
    if svg:
        layout.write_svg(picture, svg)
    print(json.dumps(picture.to_json(), indent=2) if as_json else "\n".join(map(shown, layout.text_grid(picture))))


def _naming(checkpoint) -> dict | None:
    """The naming family and model kind of the model weights (``dcptool.adapters``), or None for names no table knows."""
    from dcptool import adapters, conversion

    params = selection.model_part(checkpoint)
    family = adapters.detect_family(params)
    if family is None:
        return None
    config_dir = checkpoint.info.get("hf_config_dir")
    try:
        kind = adapters.detect_kind(params, family, selection.read_config(config_dir) if config_dir else None)
    except UsageError:  # a model type with no table: the family is still worth showing
        kind = None
    return {"family": family, "kind": kind}


# verl's FSDP1 files (--to fsdp1): how the optimizer and model files hold their tensors (converters/fsdp1.output_forms).
OptimFormOption = typer.Option(None, "--optim-form", help="With --to fsdp1, how the optimizer files hold the state: flat (verl's plain optimizer.state_dict() under FSDP1 with use_orig_params=False, its default) or orig (use_orig_params=True), which verl's optimizer.load_state_dict loads as they are; or named (FSDP.optim_state_dict, loaded through FSDP.optim_state_dict_to_load); or fsdp2 (an FSDP2 folder: optimizer.state_dict() of fully_shard, DTensor moments and model values, FSDP_version 2). Default: the source folder's form, else named.")
ModelValuesOption = typer.Option(None, "--model-values", help="With --to fsdp1: sharded-tensor (FSDP1 without a device mesh) or dtensor[:DEVICE] (FSDP1 given verl's 1-D device mesh, which must equal the loading job's: on DEVICE, else the source mesh's device type, else cuda; named as the source mesh, else fsdp). Default: the source folder's, else sharded-tensor.")


@app.command(name="convert")
def convert_command(
    source: str = typer.Argument(..., help="Checkpoint to read (a path, a URL or a hub repo ORG/NAME)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder (a file for --to torch); a path or a URL."),
    to: OutputFormat = typer.Option(..., "--to", help="Output format."),
    source_format: Optional[FormatName] = FromOption,
    dtype: Optional[CastDtype] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    world_size: int = typer.Option(1, "--world-size", help="Ranks to write for --to fsdp1."),
    keep_rank_state: bool = typer.Option(False, "--keep-rank-state", help="With --to fsdp1: give each new rank the state its source rank saved of its own (RNG) instead of dropping it."),
    optim_form: Optional[Literal["named", "flat", "orig", "fsdp2"]] = OptimFormOption,
    model_values: Optional[str] = ModelValuesOption,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file for --to hf."),
    adapter: Optional[Family] = TargetAdapterOption,
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder with the model's config.json, for --adapter (head counts, experts, tied embeddings)."),
    revision: Optional[str] = RevisionOption,
    dequantize: bool = DequantizeOption,
    compress: Optional[Literal["zstd"]] = CompressOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Convert between formats, keeping every key as saved (nested keys flattened with '.'), or renamed with --adapter.

    [bold]Examples[/bold]:
      [cyan]dcptool convert step-1000 step-1000.pt --to torch[/cyan]
      [cyan]dcptool convert step-1000 hf-out --to hf --dtype bfloat16 --exclude '^optimizer\\.'[/cyan]
      [cyan]dcptool convert global_step_10/actor fsdp1-out --to fsdp1 --world-size 8[/cyan]
      [cyan]dcptool convert s3://bucket/run-7/step-1000 step-1000.pt --to torch[/cyan]   (with s3fs installed)
      [cyan]dcptool convert archon-step-200 fsdp-engine-step-200 --to dcp --adapter hf[/cyan]   (optimizer state follows)
    """
    from dcptool import conversion

    source, = hub.with_revision(source, revision=revision)
    if compress and to != "dcp":
        raise UsageError(f"--compress {compress} goes with --to dcp")
    conversion.fsdp1_forms_only(to, optim_form, model_values)
    checkpoint, quant_notes = _dequantized(formats.open_checkpoint(source, source_format), dequantize, config_dir, dtype)
    planned = conversion.plan_convert(checkpoint, to, dtype=dtype, include=include, exclude=exclude, adapter=adapter,
                                      config_dir=config_dir, world_size=world_size, max_shard_size=_size(max_shard_size),
                                      keep_rank_state=keep_rank_state, optim_form=optim_form, model_values=model_values)
    planned.notes += quant_notes
    if compress:
        planned.writer_options["compress"] = compress
    _write(planned, destination, max_memory, overwrite, fsync)


def _dequantized(checkpoint, dequantize: bool, config_dir, dtype):
    """With --dequantize, the checkpoint with its block-scaled float8 weights as ``dtype`` ones (dcptool.quant), and notes."""
    if not dequantize:
        return checkpoint, []
    from dcptool import quant

    return quant.dequantized(checkpoint, config_dir, dtype)


def _write(planned: conversion.Conversion, destination, max_memory, overwrite, fsync) -> None:
    """Write and summarize; the adapter's notes come after the summary, once the output exists."""
    from dcptool import conversion

    with _progress(planned.total_bytes, f"writing {Path(str(destination)).name}") as advance:
        report = planned.write(destination, overwrite=overwrite, max_memory=_size(max_memory), fsync=fsync,
                               progress=advance)
    _summary(report, conversion.left_out(planned.checkpoint, planned.tensors, planned.objects),
             planned.why_left_out, planned.reasons)
    _notes([*report.notes, *(planned.checkpoint.info.get("not_read") or [])])  # files of the source no reader used


@app.command(name="export-hf")
def export_hf(
    source: str = typer.Argument(..., help="Training checkpoint (DCP, FSDP1 folder, torch.save file; a path or a URL)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder for safetensors, index and config; a path or a URL."),
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with config.json and tokenizer files to copy."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Wrapper of the model's keys, e.g. 'dcp.model' (found automatically)."),
    source_format: Optional[FormatName] = FromOption,
    dtype: Optional[CastDtype] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file (the hub's default 5GB)."),
    adapter: FamilyOrAuto = typer.Option("auto", "--adapter", help="Family of the checkpoint's names: auto (detected), hf, archon (AReaL Archon, torchtitan before 0.3) or torchtitan (0.3 and later); the output has HF names."),
    hf_experts: Literal["per-expert", "fused"] = typer.Option("per-expert", "--hf-experts", help="MoE experts as per-expert tensors (as hub checkpoints hold them) or fused (transformers v5's gate_up_proj / down_proj)."),
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="ORG/NAME", help="Then upload the export to this Hugging Face hub model repo (created if missing)."),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repo private (an existing repo keeps its visibility)."),
    hub_branch: Optional[str] = typer.Option(None, "--revision", metavar="BRANCH", help="With --push-to-hub: the branch to upload to, created if missing (e.g. one per step)."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", metavar="MESSAGE", help="With --push-to-hub: the commit message."),
    dequantize: bool = DequantizeOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Export the model weights as Hugging Face safetensors, ready for transformers' from_pretrained.

    The model part is found from the checkpoint's nesting ({"dcp": {"model": ...}} in AReaL,
    {"model": ..., "optim": ...}, or model keys at the top level as in torchtitan); optimizer and
    other state are left out. A verl folder's huggingface/ config is used when --config-dir is not given.

    Archon and torchtitan names (grouped experts, Llama's interleaved q/k rows) become Hugging Face's;
    the family is detected from the names and printed.

    [bold]Examples[/bold]:
      [cyan]dcptool export-hf recover_checkpoint hf-out --config-dir base-model --dtype bfloat16[/cyan]
      [cyan]dcptool export-hf archon/step-200 qwen3-moe-hf --config-dir Qwen3-30B-A3B[/cyan]
      [cyan]dcptool export-hf step-1000 hf-1000 --config-dir base-model --push-to-hub my-org/run-7 --private --revision step-1000[/cyan]
    """
    from dcptool import conversion

    if push_to_hub:  # before the export: a push that cannot start should not cost one
        hub.check_repo_id(push_to_hub)
        if is_remote(destination):
            raise UsageError(f"{destination}: --push-to-hub uploads a local export folder: give a local output folder")
        hub.check_can_push()
    elif private or hub_branch or commit_message:
        raise UsageError("--private, --revision and --commit-message go with --push-to-hub ORG/NAME")
    checkpoint, quant_notes = _dequantized(formats.open_checkpoint(source, source_format), dequantize, config_dir, dtype)
    planned = conversion.plan_export_hf(checkpoint, config_dir=config_dir, prefix=prefix, dtype=dtype, include=include,
                                        exclude=exclude, adapter=adapter, hf_experts=hf_experts,
                                        max_shard_size=_size(max_shard_size))
    if dequantize:  # a quantization_config left in would make transformers quantize the weights again
        from dcptool import quant

        planned.writer_options["config"] = quant.drop_quantization_config(planned.writer_options.get("config"))
        planned.notes += quant_notes
    _write(planned, destination, max_memory, overwrite, fsync)
    if push_to_hub:
        url = hub.push(destination, push_to_hub, private=private, revision=hub_branch, commit_message=commit_message)
        print(f"pushed {destination} to {url}")


# Mesh options shared by reshard and import-hf.
DpOption = typer.Option(None, "--dp", help="FSDP shard degree (default: keeps the source's world size, else 1).")
TpOption = typer.Option(1, "--tp", help="Tensor-parallel degree.")
EpOption = typer.Option(1, "--ep", help="Expert-parallel degree (borrows data-parallel ranks).")
EtpOption = typer.Option("1", "--etp", help="Tensor-parallel degree of the experts: 1 or tp.")
CpOption = typer.Option(1, "--cp", help="Context-parallel degree (FSDP shards over dp*cp).")
DpReplicateOption = typer.Option(1, "--dp-replicate", help="HSDP replicas (each holds the dp shards).")
WorldSizeOption = typer.Option(None, "--world-size", help="Ranks of the target job; must equal dp_replicate*dp*cp*tp.")
PlanOption = typer.Option("auto", "--plan", help="Placement plan: auto, hf, torchtitan, fsdp, or a YAML/JSON plan file.")
ConfigDirOption = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with the model's config.json: heads, kv heads and experts are checked against tp and ep.")
DryRunOption = typer.Option(False, "--dry-run", help="Print the plan and its problems; write nothing.")


def _reshard(source, destination, source_format, mesh_options, plan, keep_rank_state, config_dir, dtype, dry_run,
             as_json, max_memory, overwrite, fsync, adapter=None, wrapper=(), dequantize=False, compress=None) -> None:
    from dcptool import resharding

    if not dry_run:
        check_destination(destination, overwrite)  # before planning prints its warnings
    checkpoint, quant_notes = _dequantized(formats.open_checkpoint(source, source_format), dequantize, config_dir, dtype)
    result = resharding.plan_for(checkpoint, mesh_options, plan, adapter=adapter,
                                 wrapper=wrapper, config_dir=config_dir, keep_rank_state=keep_rank_state, dtype=dtype)
    result.notes[:0] = quant_notes
    if dry_run:
        _print_plan(result, as_json)
        if not as_json:
            _notes(result.notes)
        if result.problems:
            raise typer.Exit(2)
        return
    resharding.raise_problems(result)
    if not _state["quiet"]:
        _err().print(f"{result.mesh.describe()}; plan {result.plan.name} ({result.plan.description})", soft_wrap=True)
    for warning in result.warnings:
        _err().print("[yellow]warning[/yellow]: " + shown(warning).replace("[", "\\["), soft_wrap=True)
    total = sum(layout.tensor.nbytes for layout in result.layouts)
    with _progress(total, f"writing {Path(str(destination)).name}") as advance:
        report = resharding.write_plan(result, destination, compress=compress, max_memory=_size(max_memory),
                                       overwrite=overwrite, fsync=fsync, progress=advance)
    _summary(report)
    _notes(report.notes)


def _print_plan(result, as_json: bool) -> None:
    """--dry-run: per tensor its source chunks -> target placement and chunks, bytes per rank file, problems."""
    summary = result.summary()
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    print(f"{summary['mesh']['description']} (plan {summary['plan']})")
    rows = [(shown(key), str(tensor["shape"]), tensor["placement"], f"{tensor['source_chunks']} -> {len(tensor['chunks'])}")
            for key, tensor in summary["tensors"].items()]
    print("\n".join(_aligned(("key", "shape", "placement", "chunks"), rows, right=set())))
    if summary["objects"]:
        print(f"non-tensor entries carried over ({len(summary['objects'])}): {_grouped(summary['objects'])}")
    names, sizes = list(summary["files"]), list(summary["files"].values())
    print(f"{counted(len(sizes), 'file')} ({names[0]} to {names[-1]}), {min(sizes):,} to {max(sizes):,} bytes each")
    for warning in summary["warnings"]:
        print(f"warning: {warning}")
    for problem in summary["problems"]:
        print(f"problem: {problem}")
    if not summary["problems"]:
        print("no problems: run without --dry-run to write it")


@app.command()
def reshard(
    source: str = typer.Argument(..., help="Checkpoint to read (DCP, FSDP1 folder, torch.save file, HF folder; a path or a URL)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder; a path or a URL."),
    dp: Optional[int] = DpOption,
    tp: int = TpOption,
    ep: int = EpOption,
    etp: str = EtpOption,
    cp: int = CpOption,
    dp_replicate: int = DpReplicateOption,
    world_size: Optional[int] = WorldSizeOption,
    plan: str = PlanOption,
    to: Literal["dcp", "fsdp1"] = typer.Option("dcp", "--to", help="dcp, or fsdp1 (per-rank files of the model, data parallel only)."),
    keep_rank_state: bool = typer.Option(False, "--keep-rank-state", help="Keep entries of single data-parallel ranks (dataloader.dp_rank_*) as saved instead of dropping them."),
    optim_form: Optional[Literal["named", "flat", "orig", "fsdp2"]] = OptimFormOption,
    model_values: Optional[str] = ModelValuesOption,
    adapter: Optional[Family] = TargetAdapterOption,
    config_dir: Optional[str] = ConfigDirOption,
    source_format: Optional[FormatName] = FromOption,
    dtype: Optional[CastDtype] = DtypeOption,
    dry_run: bool = DryRunOption,
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    compress: Optional[Literal["zstd"]] = CompressOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Lay a checkpoint out for another mesh, exactly as a job with that mesh saves it with dcp.save.

    Each rank of the new job then reads its own file. Placements follow FSDP2 fully_shard over dp (and cp), TP colwise/rowwise by the plan, and EP for grouped experts; optimizer state follows its parameter. Entries of single data-parallel ranks (dataloader.dp_rank_*) are dropped with a warning unless --keep-rank-state.

    [bold]Examples[/bold]:
      [cyan]dcptool reshard step-1000 step-1000-tp4 --tp 4[/cyan]            (8 ranks saved it: dp=2 x tp=4)
      [cyan]dcptool reshard step-1000 moe-ep --dp 4 --tp 2 --ep 4 --etp 1 --dry-run[/cyan]
      [cyan]dcptool reshard global_step_10/actor fsdp1-w8 --to fsdp1 --world-size 8[/cyan]
    """
    from dcptool import conversion, resharding

    mesh_options = resharding.mesh_options(dp, tp, ep, etp, cp, dp_replicate, world_size)
    conversion.fsdp1_forms_only(to, optim_form, model_values)
    if to == "fsdp1":
        if compress:
            raise UsageError(f"--compress {compress} goes with --to dcp")
        checkpoint = formats.open_checkpoint(source, source_format)
        _write(resharding.fsdp1_conversion(checkpoint, mesh_options, dtype, keep_rank_state=keep_rank_state,
                                           optim_form=optim_form, model_values=model_values),
               destination, max_memory, overwrite, fsync)
        return
    _reshard(source, destination, source_format, mesh_options, plan, keep_rank_state, config_dir, dtype, dry_run,
             as_json, max_memory, overwrite, fsync, adapter, compress=compress)


@app.command(name="import-hf")
def import_hf(
    source: str = typer.Argument(..., help="Hugging Face folder with safetensors (and index); a path, a URL or a hub repo ORG/NAME."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output DCP folder; a path or a URL."),
    dp: Optional[int] = typer.Option(None, "--dp", help="FSDP shard degree of the job that will load it (default 1)."),
    tp: int = TpOption,
    ep: int = EpOption,
    etp: str = EtpOption,
    cp: int = CpOption,
    dp_replicate: int = DpReplicateOption,
    world_size: Optional[int] = WorldSizeOption,
    plan: str = PlanOption,
    adapter: Family = typer.Option("hf", "--adapter", help="Names of the job that will load it: hf (keys as in the folder), archon (AReaL Archon: model.<name>, grouped experts) or torchtitan (0.3 and later, keys at the top level)."),
    config_dir: Optional[str] = ConfigDirOption,
    dtype: Optional[CastDtype] = DtypeOption,
    dry_run: bool = DryRunOption,
    revision: Optional[str] = RevisionOption,
    dequantize: bool = DequantizeOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Turn Hugging Face safetensors into a DCP checkpoint that dcp.load reads, laid out for a mesh.

    Without mesh options the weights are one chunk each; with them, chunked as a job on that mesh saves them (see reshard). The folder's config.json is checked against tp and ep. With --adapter archon or torchtitan the weights get that family's names and layout (experts grouped, so --ep works), and an Archon or torchtitan job starts from them with dcp.load.

    [bold]Examples[/bold]:
      [cyan]dcptool import-hf Qwen3-8B qwen3-dcp[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-archon --adapter archon --dp 8 --ep 8[/cyan]
      [cyan]dcptool import-hf Llama-3.1-8B llama-titan --adapter torchtitan --dp 4 --tp 2[/cyan]
      [cyan]dcptool import-hf Qwen/Qwen3-8B qwen3-dcp --revision main[/cyan]   (a hub repo, through the hub cache)
    """
    from dcptool import adapters, resharding

    source, = hub.with_revision(source, revision=revision)
    mesh_options = resharding.mesh_options(dp, tp, ep, etp, cp, dp_replicate, world_size)
    _reshard(source, destination, "hf", mesh_options, plan, False, config_dir, dtype, dry_run, False,
             max_memory, overwrite, fsync, adapter, adapters.JOB_WRAPPERS[adapter], dequantize=dequantize)


# verify and checksum: integrity checks (exit 1 when something differs).

PrefixHelp = "Compare only keys under this wrapper of {side}, with it stripped (e.g. 'dcp.model'); 'auto' finds the model part as export-hf does."
JsonOption = typer.Option(False, "--json", help="Print a JSON report (exit codes stay the same).")


@app.command(name="verify")
def verify_command(
    a: str = typer.Argument(..., metavar="A", help="Reference checkpoint (any format or layout; a path, a URL or a hub repo ORG/NAME)."),
    b: Optional[str] = typer.Argument(None, metavar="B", help="Checkpoint to compare with it (any format or layout); none with --roundtrip."),
    roundtrip: Optional[OutputFormat] = typer.Option(None, "--roundtrip", help="Convert A to this format and back in a temporary folder ($TMPDIR), and compare with A."),
    atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance for floating-point values (default: bitwise)."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance (of A's values) for floating-point values (default: bitwise)."),
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    prefix_a: Optional[str] = typer.Option(None, "--prefix-a", help=PrefixHelp.format(side="A")),
    prefix_b: Optional[str] = typer.Option(None, "--prefix-b", help=PrefixHelp.format(side="B")),
    from_a: Optional[FormatName] = typer.Option(None, "--from-a", help="Format of A (detected when omitted)."),
    from_b: Optional[FormatName] = typer.Option(None, "--from-b", help="Format of B (detected when omitted)."),
    adapter_a: FamilyOrAuto = typer.Option("auto", "--adapter-a", help="Naming family of A's weights; when A and B differ, B's weights are compared under A's names."),
    adapter_b: FamilyOrAuto = typer.Option("auto", "--adapter-b", help="Naming family of B's weights."),
    load_on: Optional[str] = typer.Option(None, "--load-on", help="Load A with torch's dcp.load in a real multi-process job on this mesh (dp=2,tp=2[,ep=2,etp=tp]) and check every rank's shard against the files."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="With --load-on: processes to start (default: the mesh's world size)."),
    backend: Literal["auto", "gloo", "nccl"] = typer.Option("auto", "--backend", help="With --load-on: auto is nccl when GPUs are present, else gloo."),
    plan: str = PlanOption,
    timeout: float = typer.Option(600.0, "--timeout", help="With --load-on: seconds before the job is killed."),
    as_json: bool = JsonOption,
    revision: Optional[str] = RevisionOption,
    max_memory: str = MaxMemoryOption,
) -> None:
    """Compare two checkpoints of any formats and layouts: keys, dtypes, shapes and values (bitwise unless --atol/--rtol).

    Tensors are read region by region within --max-memory. Exit 0 when equal, 1 when they differ (every differing tensor is listed: missing from B, extra in B, dtype, shape, or value with the first differing index), 2 when a checkpoint cannot be read.

    [bold]Examples[/bold]:
      [cyan]dcptool verify step-1000 step-1000.pt[/cyan]
      [cyan]dcptool verify recover_checkpoint hf-out --prefix-a dcp.model --json > verify.json[/cyan]
      [cyan]dcptool verify step-1000 hf-bf16 --prefix-a auto --atol 1e-2 --rtol 1e-2[/cyan]
      [cyan]dcptool verify step-1000 --roundtrip hf[/cyan]
      [cyan]dcptool verify archon/step-200 archon-hf-export[/cyan]   (Archon names against HF names)
      [cyan]dcptool verify step-1000 --load-on dp=2,tp=2,ep=2,etp=tp[/cyan]
    """
    from dcptool import verification

    a, b = hub.with_revision(a, b, revision=revision)
    verification.check_arguments(b, roundtrip, load_on, prefix_a, prefix_b, from_b)
    if load_on:
        _verify_load_on(a, load_on, nproc, backend, plan, timeout, include, exclude, as_json)
        return
    memory = _size(max_memory)
    tolerances = {"atol": atol, "rtol": rtol}
    if roundtrip:
        with _progress(None, f"round trip via {roundtrip}") as advance:
            report = verification.roundtrip(a, roundtrip, source_format=from_a, include=include, exclude=exclude,
                                            max_memory=memory, progress=advance, **tolerances)
    else:
        side_a, side_b, note = verification.sides(a, b, format_a=from_a, format_b=from_b, prefix_a=prefix_a,
                                                  prefix_b=prefix_b, include=include, exclude=exclude,
                                                  family_a=adapter_a, family_b=adapter_b)
        if note and not as_json:  # the first line of the output: the comparison is not the one asked for
            print(shown(note))
        total = sum(t.nbytes for k, t in side_a.tensors.items() if k in side_b.tensors)
        with _progress(total, "comparing") as advance:
            report = verification.compare_sides(side_a, side_b, max_memory=memory, progress=advance, **tolerances)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print_verify(report)
        if not report.tensors and report.differences and all(d.kind in ("missing", "extra") for d in report.differences):
            print("no tensor name is on both sides: if one nests the model (dcp.model.*), try --prefix-a dcp.model or auto")
    if not report.equal:
        raise MismatchError(f"{a} and {b or 'its round trip via ' + roundtrip} differ: {report.summary()}")


def _verify_load_on(path, mesh, nproc, backend, plan, timeout, include, exclude, as_json) -> None:
    from dcptool import loadcheck

    loadcheck.check_runnable(path)  # before the line announcing the job
    if not as_json and not _state["quiet"]:
        _err().print(f"loading {path} on {mesh} with dcp.load in a real multi-process job ...")
    report = loadcheck.run(path, loadcheck.parse_mesh(mesh), nproc=nproc, backend=backend, plan=plan,
                           timeout=timeout, include=include, exclude=exclude)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        load = f"{report.load_seconds:.2f} s" if report.load_seconds is not None else "did not finish"
        print(f"{path}: {counted(report.nproc, 'rank')} ({report.backend}), dcp.load {load}")
        for result in report.ranks:
            state = "error" if result.error else ("FAIL" if result.failures else "ok")
            print(f"rank {result.rank}: {state}, {counted(result.tensors, 'tensor')} checked" + (f"; {result.error}" if result.error else ""))
            for failure in result.failures:
                print(f"  {failure['key']}: {failure['reason']}")
        if report.missing_ranks:
            print(f"no result from ranks {report.missing_ranks}" + (f": {report.problem}" if report.problem else ""))
    if report.problem or report.missing_ranks:
        raise DcptoolError(f"{path}: the load job did not finish ({report.problem or 'ranks missing'})")
    if not report.ok:
        failed = sorted({r.rank for r in report.ranks if r.failures or r.error})
        raise MismatchError(f"{path}: ranks {failed} failed the load check on {mesh}")


def _print_verify(report: verification.Report) -> None:
    print(f"A: {report.a}\nB: {report.b}")
    for difference in report.differences:
        print(f"{difference.kind:<8} {shown(difference.key)}: {difference.detail}")
    differing = {d.key for d in report.differences}
    for key, (most_abs, most_rel) in report.closeness.items():
        if key not in differing and (most_abs or most_rel):
            print(f"{'close':<8} {shown(key)}: max abs {most_abs:.3g}, max rel {most_rel:.3g}")
    if report.left_out:
        print(f"left out (the round trip's format cannot hold them): {_grouped(report.left_out)}")
    if report.not_compared:
        print(f"non-tensor entries not compared (not plain data): {_grouped(report.not_compared)}")
    print(report.summary())


@app.command(name="checksum")
def checksum_command(
    path: str = typer.Argument(..., help="Checkpoint folder or file the manifest belongs to (a path or a URL)."),
    write: bool = typer.Option(False, "--write", help="Hash every file and tensor and write the manifest."),
    check: bool = typer.Option(False, "--check", help="Check PATH against its manifest."),
    against: Optional[str] = typer.Option(None, "--against", help="Check this other checkpoint (any format or layout) against PATH's manifest, by tensor hashes."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="Manifest file (default: dcptool.manifest.json in the folder, <file>.dcptool.manifest.json beside a file)."),
    scan_nonfinite: bool = typer.Option(False, "--scan-nonfinite", help="Also count NaN and Inf in floating-point tensors; any found exits 1."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="With --against: compare only the manifest's keys under this wrapper, stripped ('auto': the model part)."),
    against_prefix: Optional[str] = typer.Option(None, "--against-prefix", help="With --against: the same for the other checkpoint's keys."),
    source_format: Optional[FormatName] = typer.Option(None, "--from", help="Format of the checkpoint read (detected when omitted)."),
    threads: int = typer.Option(0, "--threads", help="Hashing threads (default: the CPUs, at most 16)."),
    as_json: bool = JsonOption,
    revision: Optional[str] = RevisionOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = typer.Option(False, "--overwrite", help="With --write: replace an existing manifest."),
) -> None:
    """Write or check an integrity manifest: a BLAKE3 hash per file and per tensor (of its global values).

    Tensor hashes do not depend on layout or format, so --against checks an export or a resharded copy against the original's manifest. Exit 0 when everything matches, 1 naming each change (changed, truncated, missing or extra file; missing or extra tensor; changed dtype, shape or values; NaN/Inf with --scan-nonfinite), 2 on bad input.

    [bold]Examples[/bold]:
      [cyan]dcptool checksum step-1000 --write --scan-nonfinite[/cyan]
      [cyan]dcptool checksum step-1000 --check --json > integrity.json[/cyan]
      [cyan]dcptool checksum step-1000 --against hf-out --prefix auto[/cyan]
      [cyan]dcptool checksum model.pt --write --manifest manifests/model.json[/cyan]
    """
    from dcptool import checksums

    path, against = hub.with_revision(path, against, revision=revision)
    if hub.parse(path):  # the hub cache is huggingface_hub's: no manifest is written into it or read from it
        if manifest is None:
            raise UsageError(f"{path}: a hub repo holds no dcptool manifest: give --manifest FILE")
        if check:
            path = hub.local_path(path)
    with _progress(None, "hashing") as advance:
        result = checksums.run(path, write=write, check=check, against=against, manifest=manifest,
                               source_format=source_format, scan_nonfinite=scan_nonfinite, prefix=prefix,
                               against_prefix=against_prefix, overwrite=overwrite, max_memory=_size(max_memory),
                               threads=threads or None, progress=advance)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        _print_checksum(result)
        if result.action == "against" and not result.compared and all(p.kind in ("missing tensor", "extra tensor") for p in result.problems):
            print("no tensor name is on both sides: if one nests the model (dcp.model.*), try --prefix dcp.model or auto")
    if not result.ok:
        written = " (the manifest was written)" if write else ""
        raise MismatchError(f"{result.path}: {counted(len(result.problems), 'problem')} against {result.manifest}{written}")


def _print_checksum(result: checksums.Result) -> None:
    for problem in result.problems:
        print(f"{problem.kind:<17} {shown(problem.name)}: {problem.detail}")
    rate = f"{result.bytes_hashed / max(result.seconds, 1e-9) / 1e6:,.0f} MB/s"
    if result.action == "write":
        print(f"wrote {result.manifest}: {counted(result.files, 'file')} and {counted(result.tensors, 'tensor')} hashed "
              f"({result.bytes_hashed:,} bytes in {result.seconds:.2f}s, {rate})")
    elif result.ok and result.action == "check":
        print(f"{result.path}: intact, {counted(result.files, 'file')} match {result.manifest}")
    elif result.ok:
        print(f"{result.path}: {counted(result.tensors, 'tensor')} match {result.manifest}")


# Options of the whole program that may also follow the command name (moved before it), and
# command options that may also precede it (moved after it, for the commands that have them).
GLOBAL_FLAGS = ("--debug", "--quiet", "-q")
COMMAND_FLAGS_FIRST = ("--json",)


def _arranged(group: typer.core.TyperGroup, argv: list[str]) -> list[str]:
    """``argv`` with GLOBAL_FLAGS moved before the command name and COMMAND_FLAGS_FIRST after it.

    Option values are skipped by the command's own options (``--include -q`` keeps ``-q`` as the
    regular expression), and nothing after ``--`` moves.

    >>> _arranged(typer.main.get_command(app), ["--json", "inspect", "x", "--debug"])
    ['--debug', 'inspect', '--json', 'x']
    """
    at = next((i for i, arg in enumerate(argv) if arg in group.commands), None)
    if at is None:
        return argv
    command = group.commands[argv[at]]
    takes_value = {name for param in command.params if param.param_type_name == "option" and not param.is_flag
                   for name in param.opts}
    before, after, rest = list(argv[:at]), [], argv[at + 1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            after += rest[i:]
            break
        if arg in GLOBAL_FLAGS:
            before.append(arg)
        else:
            after.append(arg)
            if arg in takes_value and i + 1 < len(rest):
                after.append(rest[i + 1])
                i += 1
        i += 1
    first = [arg for arg in before if arg in COMMAND_FLAGS_FIRST]
    return [arg for arg in before if arg not in COMMAND_FLAGS_FIRST] + [argv[at]] + first + after


def _command() -> typer.core.TyperGroup:
    """The click command of ``app``, its flags shown without a ``<bool>`` type in help."""
    command = typer.main.get_command(app)
    for each in [command, *command.commands.values()]:
        help_option = each.get_help_option(command.context_class(each, help_option_names=["-h", "--help"]))
        for param in [*each.params, help_option]:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
    return command


# typer runs on its own copy of click, whose usage errors all derive from its ClickException.
CLICK_ERRORS = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
CLICK_ABORTS = typer.Abort


def main(argv: list[str] | None = None) -> None:
    """Run the command line; exits 0, 1 (a check found a difference), 2 (bad input, with one line
    naming the file), 3 (a bug in dcptool: please report it) or 130 (interrupted, with one line)."""
    import atexit
    import os
    import signal

    from dcptool import storage

    handling = storage.handle_interrupts() is not None  # Ctrl-C from here on: one line and exit 130, click or not
    if handling:  # ignored once the interpreter exits, past the last Python code that could act on it
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    error = None
    try:
        from dcptool import distributed

        distributed.quiet_other_ranks()  # under torchrun only rank 0 prints, errors of every rank included
        command = _command()
        args = _arranged(command, sys.argv[1:] if argv is None else argv)
        code = command.main(args=args, prog_name="dcptool", standalone_mode=False)
        if code == 130:  # typer's exit for a KeyboardInterrupt raised by other means than Ctrl-C
            print(f"dcptool: {distributed.describe_failure(KeyboardInterrupt())[1]}", file=sys.stderr)
    except CLICK_ERRORS as exc:  # one line, as every other refusal
        context = getattr(exc, "ctx", None)
        hint = f" (see {context.command_path} -h)" if context is not None else ""
        message = exc.format_message().replace("Value error, ", "")  # typer's prefix for a refused choice
        if message:
            print(f"dcptool: error: {message}{hint}", file=sys.stderr)
        else:  # no arguments: click shows the help
            exc.show()
        code = exc.exit_code
    except CLICK_ABORTS:
        from dcptool import distributed

        print(f"dcptool: {distributed.describe_failure(KeyboardInterrupt())[1]}", file=sys.stderr)
        code = 130
    except SystemExit:
        raise
    except BaseException as exc:  # DcptoolError, OSError, Ctrl-C, and bugs (exit 3); under torchrun the other ranks stop too
        from dcptool import distributed  # again: a Ctrl-C may have cut the first import short

        code, message = distributed.describe_failure(exc)
        if _state["debug"] and code != 130:
            traceback.print_exc()
        if code == distributed.EXIT_INTERNAL:
            hint = "a bug in dcptool: please report it, with the traceback above" if _state["debug"] else distributed.BUG_HINT
            print(f"dcptool: {message} ({hint})", file=sys.stderr)
        else:
            print(f"dcptool: {'' if code == 130 else 'error: '}{message}", file=sys.stderr)
        error = exc
    code = code if isinstance(code, int) else 0
    if handling:  # the outcome is decided and told: from now on Ctrl-C ends the process at once, with it
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: Python reports it at exit, as it would have
                pass
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
        if signal.getsignal(signal.SIGTERM) is storage.raise_interrupted:  # torchrun stopping the job, likewise
            signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))
    from dcptool import distributed

    distributed.leave(code, error)
    del error  # its traceback holds a failed writer's open files: close them now, not during interpreter shutdown
    sys.exit(code)
