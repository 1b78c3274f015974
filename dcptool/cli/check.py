"""``dcptool check``: what torch or an engine would trip on in one checkpoint (exit 1 naming every problem)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from dcptool.cli.app import app
from dcptool.cli.options import READING, JsonOption, grouped
from dcptool.cli.render import shown
from dcptool.errors import MismatchError
from dcptool.options import Reading


@app.command(name="check")
@grouped
def check_command(
    path: str = typer.Argument(..., help="Checkpoint to check (a path, a URL or a hub repo ORG/NAME)."),
    as_json: bool = JsonOption,
    show_all: bool = typer.Option(False, "--all", help="One line per problem (default: problems of keys that differ only in their numbers fold into one line)."),
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with the model's config.json to check the weights against (default: one that comes with the checkpoint)."),
    reading: Reading = READING.only("format", "revision"),
) -> None:
    """Check one checkpoint for everything torch or an engine would trip on, without loading it and without a manifest.

    Every record (torch.save archives: DCP chunks and objects, torch.save and FSDP1 files) is read once: its zip structure and the CRC-32 of each entry, and the tensor it holds against the metadata; the metadata against the files; the chunks' cover of each tensor; an HF index against its shards; every non-tensor entry through the restricted unpickler; the weights against a config.json (--config-dir, else one that comes with the checkpoint): their shapes, and parts of its model they lack (missing: a vision tower, MTP layers, an untied lm_head, ...) or tensors it has no place for (unexpected), as export-hf refuses them. Safetensors files store no checksum: their values are not checked, and the summary says so (--json: values_not_checked, else null); checksum --write makes a manifest that checks them. Exit 0 when fine, 1 naming every problem, 2 when PATH is no checkpoint.

    [bold]Examples[/bold]:
      [cyan]dcptool check step-1000[/cyan]
      [cyan]dcptool check step-1000 --json > check.json[/cyan]
      [cyan]dcptool check hf-out --all[/cyan]   (one line per problem)
    """
    from dcptool import api

    report = api.check(path, config_dir=config_dir, reading=reading)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        _print(report, show_all)
    if not report.ok:
        raise MismatchError(f"{report.path}: {report.summary()}")


def _print(report, show_all: bool) -> None:
    """check's text: one line per problem, or per group of problems of one kind whose keys differ only in
    their numbers (``record  model.layers.{0..19}.mlp.up_proj.weight: 20 problems, first: ...``), then the summary."""
    from dcptool.checks import stats

    print(f"{shown(report.path)} ({report.format or 'unknown format'})")
    details = {}
    for problem in report.problems:
        details.setdefault((problem.kind, problem.name), []).append(problem.detail)
    for kind in report.counts():
        names = [name for found, name in details if found == kind]
        minimum = len(names) + 1 if show_all else 2
        for name, members in stats.folded_rows(names, lambda key: (), minimum=minimum):
            found = [detail for member in members for detail in details[(kind, member)]]
            if len(found) == 1:
                print(f"{kind:<10} {shown(found[0])}")
            elif len(members) == 1 and show_all:
                print("\n".join(f"{kind:<10} {shown(detail)}" for detail in found))
            else:
                print(f"{kind:<10} {shown(name)}: {len(found)} problems, first: {shown(found[0])}")
    if report.completeness and report.completeness.startswith("not checked"):
        print(f"completeness {report.completeness}")
    print(f"{shown(report.path)}: {report.summary()}")
