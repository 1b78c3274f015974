"""``dcptool convert``: a checkpoint in another format, keys kept as saved or renamed with --adapter."""

from __future__ import annotations

from typing import Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import (COMPLETENESS, FORMAT_OPTIONS, READING, SELECTION, WRITING, CastDtype, DtypeOption,
                                 Family, OutputFormat, OutputLocation, TargetFamilyOption, grouped)
from dcptool.format_interface import FormatOptions
from dcptool.options import Completeness, Reading, Selection, Writing
from dcptool.storage import output_path


@app.command(name="convert")
@grouped
def convert_command(
    source: str = typer.Argument(..., help="Checkpoint to read (a path, a URL or a hub repo ORG/NAME)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder (a file for --to torch); a path or a URL."),
    to: OutputFormat = typer.Option(..., "--to", help="Output format."),
    dtype: Optional[CastDtype] = DtypeOption,
    selection: Selection = SELECTION.only("include", "exclude"),
    format_options: FormatOptions | None = FORMAT_OPTIONS,
    family: Optional[Family] = TargetFamilyOption,
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder with the model's config.json, for --adapter (head counts, experts, tied embeddings)."),
    completeness: Completeness = COMPLETENESS,
    reading: Reading = READING,
    writing: Writing = WRITING,
) -> None:
    """Convert between formats, keeping every key as saved (nested keys flattened with '.'), or renamed with --adapter.

    With --adapter hf the model weights must be the whole model config.json describes, as export-hf checks them (--allow-missing, --allow-unexpected).

    [bold]Examples[/bold]:
      [cyan]dcptool convert step-1000 step-1000.pt --to torch[/cyan]
      [cyan]dcptool convert step-1000 hf-out --to hf --dtype bfloat16 --exclude '^optimizer\\.'[/cyan]
      [cyan]dcptool convert global_step_10/actor fsdp1-out --to fsdp1 --world-size 8[/cyan]
      [cyan]dcptool convert s3://bucket/run-7/step-1000 step-1000.pt --to torch[/cyan]   (with s3fs installed)
      [cyan]dcptool convert archon-step-200 fsdp-engine-step-200 --to dcp --adapter hf[/cyan]   (optimizer state follows)
    """
    from dcptool import api

    report = api.convert(source, destination, to, family=family, config_dir=config_dir, dtype=dtype,
                         selection=selection, format_options=format_options, completeness=completeness,
                         reading=reading, writing=writing)
    render.written(report)
