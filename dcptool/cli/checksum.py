"""``dcptool checksum``: an integrity manifest written, or a checkpoint checked against one (exit 1
naming each change)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import READING, JsonOption, grouped
from dcptool.errors import MismatchError, counted
from dcptool.options import Reading


# The help writes out the manifest's name and the thread cap so that the other commands start without
# importing checksums (and blake3).
@app.command(name="checksum")
@grouped
def checksum_command(
    path: str = typer.Argument(..., help="Checkpoint folder or file the manifest belongs to (a path or a URL)."),
    write: bool = typer.Option(False, "--write", help="Hash every file and tensor and write the manifest."),
    check: bool = typer.Option(False, "--check", help="Check PATH against its manifest."),
    against: Optional[str] = typer.Option(None, "--against", help="Check this other checkpoint (any format or layout) against PATH's manifest, by tensor hashes."),
    manifest: Optional[str] = typer.Option(None, "--manifest", help="Manifest file (default: dcptool.manifest.json in the folder, <file>.dcptool.manifest.json beside a file)."),
    scan_nonfinite: bool = typer.Option(False, "--scan-nonfinite", help="Also count NaN and Inf in floating-point tensors; any found exits 1."),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="With --against: compare only the manifest's keys under this wrapper, stripped ('auto': the model part)."),
    against_prefix: Optional[str] = typer.Option(None, "--against-prefix", help="With --against: the same for the other checkpoint's keys."),
    threads: int = typer.Option(0, "--threads", help="Hashing threads (default: the CPUs, at most 16)."),
    as_json: bool = JsonOption,
    overwrite: bool = typer.Option(False, "--overwrite", help="With --write: replace an existing manifest."),
    reading: Reading = READING.only("format", "revision", "max_memory", "verify_records").helped(
        format="Format of the checkpoint read (detected when omitted)."),
) -> None:
    """Write or check an integrity manifest: a BLAKE3 hash per file and per tensor (of its global values).

    Tensor hashes do not depend on layout or format, so --against checks an export or a resharded copy against the original's manifest. Exit 0 when everything matches, 1 naming each change (changed, truncated, missing or extra file; missing or extra tensor; changed dtype, shape or values; NaN/Inf with --scan-nonfinite), 2 on bad input.

    [bold]Examples[/bold]:
      [cyan]dcptool checksum step-1000 --write --scan-nonfinite[/cyan]
      [cyan]dcptool checksum step-1000 --check --json > integrity.json[/cyan]
      [cyan]dcptool checksum step-1000 --against hf-out --prefix auto[/cyan]
      [cyan]dcptool checksum model.pt --write --manifest manifests/model.json[/cyan]
    """
    from dcptool import api

    result = api.checksum(path, write=write, check=check, against=against, manifest=manifest,
                          scan_nonfinite=scan_nonfinite, prefix=prefix, against_prefix=against_prefix, threads=threads,
                          overwrite=overwrite, reading=reading)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        render.print_checksum(result)
        if result.action == "against" and not result.compared and all(p.kind in ("missing tensor", "extra tensor") for p in result.problems):
            print("no tensor name is on both sides: if one nests the model (dcp.model.*), try --prefix dcp.model or auto")
    if not result.ok:
        written = " (the manifest was written)" if write else ""
        raise MismatchError(f"{result.path}: {counted(len(result.problems), 'problem')} against {result.manifest}{written}")
