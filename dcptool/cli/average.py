"""``dcptool average``: the weighted mean of checkpoints of one model, written as the first is laid out."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import OPTIONAL_MESH, READING, WRITING, OutputFormat, grouped
from dcptool.errors import UsageError
from dcptool.options import MeshOptions, Reading, Writing
from dcptool.storage import output_path


@app.command(name="average")
@grouped
def average_command(
    paths: List[str] = typer.Argument(..., metavar="A B [C ...] DST", help="Checkpoints to average (any formats, naming families and meshes; paths, URLs or hub repos), then the output."),
    weights: Optional[str] = typer.Option(None, "--weights", metavar="W,W,...", help="One weight per checkpoint, e.g. 0.5,0.3,0.2 (default: equal). Weights that do not sum to 1 are divided by their sum; none negative."),
    to: Optional[OutputFormat] = typer.Option(None, "--to", help="Output format (default: the first checkpoint's)."),
    mesh: MeshOptions | None = OPTIONAL_MESH.helped(dp="With a mesh: FSDP shard degree, as reshard takes it (default: the first checkpoint's own chunks)."),
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder with the model's config.json: heads and experts, to map names across naming families (Llama's q/k rows) and, with mesh options, to check tp and ep."),
    include_optimizer: bool = typer.Option(False, "--include-optimizer", help="Average the optimizer state too (every checkpoint must hold it); by default it is left out."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    reading: Reading = READING.only("revision", "max_memory", "verify_records"),
    writing: Writing = WRITING,
) -> None:
    """Average checkpoints of one model ("souping"), streamed within --max-memory.

    Each checkpoint is paired with the first as verify pairs them (formats, layouts, naming families). Every floating-point tensor becomes w1*A + w2*B + ... computed in float32 (each product and sum rounded to float32, in the order given), then rounded to the first checkpoint's dtype as torch's .to(dtype) rounds. Integer, boolean and float8 tensors must be equal in every checkpoint (refused otherwise, naming the key) and are copied. Optimizer state is left out unless --include-optimizer; other non-tensor entries come from the first. The output has the first checkpoint's format and chunks, unless --to or mesh options (as reshard) are given.

    [bold]Examples[/bold]:
      [cyan]dcptool average step-800 step-900 step-1000 soup[/cyan]   (equal weights)
      [cyan]dcptool average step-800 step-900 step-1000 soup --weights 0.2,0.3,0.5[/cyan]
      [cyan]dcptool average run-a/step-1000 run-b-hf soup-hf --to hf[/cyan]   (DCP and HF safetensors)
      [cyan]dcptool average step-900 step-1000 soup --dp 4 --tp 2 --dry-run[/cyan]
    """
    from dcptool import api

    if len(paths) < 3:
        raise UsageError("give at least two checkpoints to average, then the output (dcptool average A B DST)")
    *sources, destination = paths
    report = api.average(sources, output_path(destination), weights=weights, to=to, mesh=mesh, config_dir=config_dir,
                         include_optimizer=include_optimizer, reading=reading, writing=writing)
    if as_json:
        print(json.dumps({"destination": str(report.destination), "format": report.format, "dry_run": report.dry_run,
                          "tensors": report.tensors, "bytes": report.bytes_written, "notes": report.notes,
                          "left_out": report.dropped, "planned_files": report.planned_files,
                          "warnings": getattr(report, "warnings", [])}, indent=2))
    else:
        render.written(report)
