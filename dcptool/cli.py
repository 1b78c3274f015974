"""The ``dcptool`` command line. Bad input exits 2 with one line naming the file; ``--debug`` shows tracebacks."""

from __future__ import annotations

import json
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from dcptool import convert, dtypes, formats
from dcptool.errors import DcptoolError, UsageError

app = typer.Typer(
    name="dcptool",
    help="Inspect, convert and verify PyTorch distributed checkpoints offline: DCP, FSDP1, torch.save, HF safetensors.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)
err = Console(stderr=True)
_state = {"debug": False, "quiet": False}


def _size(text: str) -> int:
    """Parse ``256MB``, ``5GB``, ``1GiB`` or a number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    cleaned = text.strip().upper()
    number = cleaned.rstrip("KMGTIB")
    try:
        return int(float(number) * units[cleaned[len(number):]])
    except (ValueError, KeyError):
        raise typer.BadParameter(f"{text!r} is not a size such as 256MB or 5GB") from None


FromOption = typer.Option(None, "--from", help=f"Source format (detected when omitted): {', '.join(formats.names())}.")
OverwriteOption = typer.Option(False, "--overwrite", help="Replace DST if it exists (only once the new output is complete).")
MaxMemoryOption = typer.Option("256MB", "--max-memory", help="Budget for data buffers; larger tensors move in pieces.")
DtypeOption = typer.Option(None, "--dtype", help="Cast floating-point tensors to bfloat16, float16 or float32.")
IncludeOption = typer.Option(None, "--include", help="Only keys matching this regular expression.")
ExcludeOption = typer.Option(None, "--exclude", help="Leave out keys matching this regular expression.")
FsyncOption = typer.Option(True, "--fsync/--no-fsync", help="Flush outputs to disk before the final rename.")


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
) -> None:
    _state["debug"], _state["quiet"] = debug, quiet


@contextmanager
def _progress(total: int, what: str):
    """A byte progress bar on a terminal, unless --quiet; yields the callback to advance it."""
    if _state["quiet"] or not err.is_terminal:
        yield lambda n: None
        return
    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def _check_dtype(dtype: Optional[str]) -> None:
    if dtype and dtype not in dtypes.CASTABLE:
        raise UsageError(f"--dtype {dtype}: choose {', '.join(dtypes.CASTABLE)}")


def _summary(report: convert.Report) -> None:
    line = f"wrote {report.destination} ({report.format}): {report.tensors} tensors, {report.bytes_written:,} bytes"
    print(line)
    if report.left_out:
        shown = ", ".join(report.left_out[:8]) + (" ..." if len(report.left_out) > 8 else "")
        print(f"left out {len(report.left_out)} non-tensor entries the format cannot hold: {shown}")


def _chunking(tensor) -> str:
    if len(tensor.chunks) == 1:
        return "1 chunk"
    splits = [len({c.offsets[d] for c in tensor.chunks}) for d in range(len(tensor.shape))]
    split = " x ".join(f"{n} along dim {d}" for d, n in enumerate(splits) if n > 1)
    return f"{len(tensor.chunks)} chunks" + (f" ({split})" if split else "")


def _grouped(keys, limit: int = 12) -> str:
    """Keys as a short line: long lists are grouped by their first two parts (``optimizer.param_groups.* (230)``)."""
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
    path: Path = typer.Argument(..., help="Checkpoint folder or file."),
    source_format: Optional[str] = FromOption,
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of a table."),
) -> None:
    """Show a checkpoint's format, tensors (dtype, shape, bytes, chunking), other entries and files.

    [bold]Example[/bold]: [cyan]dcptool inspect checkpoints/step-1000 --json[/cyan]
    """
    checkpoint = formats.open_checkpoint(path, source_format)
    files = checkpoint.data_files()
    disk = sum(checkpoint.files.size(f) for f in files)
    if as_json:
        report = {
            "format": checkpoint.format,
            "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": len(t.chunks)}
                        for k, t in checkpoint.tensors.items()},
            "objects": list(checkpoint.objects),
            "total_bytes": checkpoint.total_bytes,
            "files": {"count": len(files), "bytes": disk},
            "info": {k: str(v) if isinstance(v, Path) else v for k, v in checkpoint.info.items()},
        }
        print(json.dumps(report, indent=2))
        return
    console = Console()
    table = Table(title=f"{path} ({checkpoint.format})")
    for column in ("key", "dtype", "shape", "bytes", "chunks"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for key, tensor in checkpoint.tensors.items():
        table.add_row(key, tensor.dtype, str(list(tensor.shape)), f"{tensor.nbytes:,}", _chunking(tensor))
    console.print(table)
    if checkpoint.objects:
        console.print(f"non-tensor entries ({len(checkpoint.objects)}): {_grouped(checkpoint.objects)}")
    console.print(f"{len(checkpoint.tensors)} tensors, {checkpoint.total_bytes:,} bytes of tensor data; "
                  f"{len(files)} data files, {disk:,} bytes on disk")
    for key, value in checkpoint.info.items():
        if value is not None:
            console.print(f"{key}: {value}")


@app.command(name="convert")
def convert_command(
    source: Path = typer.Argument(..., help="Checkpoint to read."),
    destination: Path = typer.Argument(..., help="Output folder (a file for --to torch)."),
    to: str = typer.Option(..., "--to", help=f"Output format: {', '.join(formats.names())}."),
    source_format: Optional[str] = FromOption,
    dtype: Optional[str] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    world_size: int = typer.Option(1, "--world-size", help="Ranks to write for --to fsdp1."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file for --to hf."),
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Convert between formats, keeping every key as saved (nested keys flattened with '.').

    [bold]Examples[/bold]:
      [cyan]dcptool convert step-1000 step-1000.pt --to torch[/cyan]
      [cyan]dcptool convert step-1000 hf-out --to hf --dtype bfloat16 --exclude '^optimizer\\.'[/cyan]
      [cyan]dcptool convert global_step_10/actor fsdp1-out --to fsdp1 --world-size 8[/cyan]
    """
    _check_dtype(dtype)
    checkpoint = formats.open_checkpoint(source, source_format)
    tensors, objects = convert.entries_for(checkpoint, to, dtype, include, exclude)
    options = {"fsdp1": {"world_size": world_size}, "hf": {"max_shard_size": _size(max_shard_size)}}.get(to, {})
    _write(checkpoint, destination, to, tensors, objects, max_memory, overwrite, fsync, options)


def _write(checkpoint, destination, to, tensors, objects, max_memory, overwrite, fsync, options) -> None:
    total = sum(t.nbytes for t in tensors)
    with _progress(total, f"writing {destination.name}") as advance:
        report = convert.write_checkpoint(
            checkpoint, destination, to, tensors, objects, overwrite=overwrite, max_memory=_size(max_memory),
            fsync=fsync, progress=advance, writer_options=options,
        )
    _summary(report)


@app.command(name="export-hf")
def export_hf(
    source: Path = typer.Argument(..., help="Training checkpoint (DCP, FSDP1 folder, torch.save file)."),
    destination: Path = typer.Argument(..., help="Output folder for safetensors, index and config."),
    config_dir: Optional[Path] = typer.Option(None, "--config-dir", help="Folder with config.json and tokenizer files to copy."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="Wrapper of the model's keys, e.g. 'dcp.model' (found automatically)."),
    source_format: Optional[str] = FromOption,
    dtype: Optional[str] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file (the hub's default 5GB)."),
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Export the model weights as Hugging Face safetensors, ready for transformers' from_pretrained.

    The model part is found from the checkpoint's nesting ({"dcp": {"model": ...}} in AReaL,
    {"model": ..., "optim": ...}, or model keys at the top level as in torchtitan); optimizer and
    other state are left out. A verl folder's huggingface/ config is used when --config-dir is not given.

    [bold]Example[/bold]: [cyan]dcptool export-hf recover_checkpoint hf-out --config-dir base-model --dtype bfloat16[/cyan]
    """
    _check_dtype(dtype)
    checkpoint = formats.open_checkpoint(source, source_format)
    tensors, config_dir = convert.hf_export_entries(checkpoint, config_dir, prefix, dtype, include, exclude)
    options = {"max_shard_size": _size(max_shard_size), "config_dir": config_dir}
    _write(checkpoint, destination, "hf", tensors, [], max_memory, overwrite, fsync, options)


@app.command(name="import-hf")
def import_hf(
    source: Path = typer.Argument(..., help="Hugging Face folder with safetensors (and index)."),
    destination: Path = typer.Argument(..., help="Output DCP folder."),
    dtype: Optional[str] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Turn Hugging Face safetensors into a DCP checkpoint that dcp.load reads.

    [bold]Example[/bold]: [cyan]dcptool import-hf Qwen3-8B qwen3-dcp[/cyan]
    """
    _check_dtype(dtype)
    checkpoint = formats.open_checkpoint(source, "hf")
    named = convert.select(checkpoint.tensors, include, exclude)
    if not named:
        raise UsageError(f"{source}: no tensor matches the --include/--exclude filters")
    tensors = convert.out_tensors(named, dtype, keep_paths=True)
    _write(checkpoint, destination, "dcp", tensors, [], max_memory, overwrite, fsync, {})


def main(argv: list[str] | None = None) -> None:
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="dcptool", standalone_mode=False)
    except click.exceptions.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except click.exceptions.Abort:
        code = 130
    except (DcptoolError, OSError) as exc:
        if _state["debug"]:
            traceback.print_exc()
        message = str(exc) if isinstance(exc, DcptoolError) else f"{exc.filename or ''}: {exc.strerror or exc}"
        print(f"dcptool: error: {message}", file=sys.stderr)
        code = exc.exit_code if isinstance(exc, DcptoolError) else 2
    except KeyboardInterrupt:
        print("dcptool: interrupted; nothing was written", file=sys.stderr)
        code = 130
    sys.exit(code if isinstance(code, int) else 0)
