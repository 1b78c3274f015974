"""``dcptool convert``: a checkpoint in another format, keys kept as saved or renamed with --adapter."""

from __future__ import annotations

from typing import Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import (NoVerifyRecordsOption, CastDtype, CompressOption, Compression, DequantizeOption, DryRunOption, DtypeOption, ExcludeOption,
                                 Family, FormatName, FromOption, NoFsyncOption, IncludeOption, MaxMemoryOption,
                                 ModelValuesOption, OptimForm, OptimFormOption, OutputFormat, OutputLocation,
                                 OverwriteOption, RevisionOption, TargetAdapterOption)
from dcptool.storage import output_path


@app.command(name="convert")
def convert_command(
    source: str = typer.Argument(..., help="Checkpoint to read (a path, a URL or a hub repo ORG/NAME)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder (a file for --to torch); a path or a URL."),
    to: OutputFormat = typer.Option(..., "--to", help="Output format."),
    source_format: Optional[FormatName] = FromOption,
    dtype: Optional[CastDtype] = DtypeOption,
    include: Optional[str] = IncludeOption,
    exclude: Optional[str] = ExcludeOption,
    world_size: Optional[int] = typer.Option(None, "--world-size", help="Ranks to write for --to fsdp1 (default 1)."),
    keep_rank_state: bool = typer.Option(False, "--keep-rank-state", help="With --to fsdp1: give each new rank the state its source rank saved of its own (RNG) instead of dropping it."),
    optim_form: Optional[OptimForm] = OptimFormOption,
    model_values: Optional[str] = ModelValuesOption,
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="Largest safetensors file for --to hf (default 5GB, the hub's)."),
    adapter: Optional[Family] = TargetAdapterOption,
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder with the model's config.json, for --adapter (head counts, experts, tied embeddings)."),
    revision: Optional[str] = RevisionOption,
    dequantize: bool = DequantizeOption,
    compress: Optional[Compression] = CompressOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    no_fsync: bool = NoFsyncOption,
    dry_run: bool = DryRunOption,
    no_verify_records: bool = NoVerifyRecordsOption,
) -> None:
    """Convert between formats, keeping every key as saved (nested keys flattened with '.'), or renamed with --adapter.

    [bold]Examples[/bold]:
      [cyan]dcptool convert step-1000 step-1000.pt --to torch[/cyan]
      [cyan]dcptool convert step-1000 hf-out --to hf --dtype bfloat16 --exclude '^optimizer\\.'[/cyan]
      [cyan]dcptool convert global_step_10/actor fsdp1-out --to fsdp1 --world-size 8[/cyan]
      [cyan]dcptool convert s3://bucket/run-7/step-1000 step-1000.pt --to torch[/cyan]   (with s3fs installed)
      [cyan]dcptool convert archon-step-200 fsdp-engine-step-200 --to dcp --adapter hf[/cyan]   (optimizer state follows)
    """
    from dcptool import api

    report = api.convert(source, destination, to, source_format=source_format, revision=revision, dtype=dtype,
                         include=include, exclude=exclude, world_size=world_size, max_shard_size=max_shard_size,
                         adapter=adapter, config_dir=config_dir, keep_rank_state=keep_rank_state,
                         optim_form=optim_form, model_values=model_values, dequantize=dequantize, compress=compress,
                         max_memory=max_memory, overwrite=overwrite, fsync=not no_fsync, dry_run=dry_run,
                         progress=render.progress,
                        verify_records=not no_verify_records)
    render.written(report)
