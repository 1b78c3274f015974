"""``dcptool diff``: what changed between two checkpoints, per tensor and in total (a report: exit 0)."""

from __future__ import annotations

import json
from typing import Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import READING, SELECTION, grouped, side
from dcptool.cli.render import shown
from dcptool.errors import UsageError
from dcptool.options import Reading, Selection, Side


@app.command(name="diff")
@grouped
def diff_command(
    a: str = typer.Argument(..., metavar="A", help="The checkpoint before (any format or layout; a path, a URL or a hub repo)."),
    b: str = typer.Argument(..., metavar="B", help="The checkpoint after."),
    show_all: bool = typer.Option(False, "--all", help="One row per tensor (by default numbered layers fold into one row, as inspect folds them)."),
    top: Optional[int] = typer.Option(None, "--top", metavar="K", help="Also list the K tensors of the largest relative change."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (every tensor)."),
    selection: Selection = SELECTION.only("include", "exclude"),
    side_a: Side = side("a"),
    side_b: Side = side("b"),
    reading: Reading = READING.only("revision", "max_memory", "verify_records"),
) -> None:
    """What changed from A to B, per tensor and in total, across formats, layouts, naming families and meshes.

    Both are read region by region within --max-memory. Per tensor: elements changed (their values differ), bit-identical elements (same dtype, same bits), the largest absolute change and the relative L2 change ||B-A||/||A|| (float64 sums). The first line sums it up. --json is strict JSON (json.loads, jq): a change that is no finite number (a NaN on one side, opposite infinities, a relative change of an all-zero A) is null there, and the tensor's non_finite names it ({"max_abs_change": "inf"}). Exit 0: a report, not a check (verify is the gate).

    [bold]Examples[/bold]:
      [cyan]dcptool diff step-100 step-101[/cyan]   (what one RL step changed)
      [cyan]dcptool diff step-100 step-200 --top 10 --all[/cyan]
      [cyan]dcptool diff step-1000 hf-export --json > diff.json[/cyan]
    """
    from dcptool import api

    if top is not None and top < 1:
        raise UsageError(f"--top {top}: give a number of tensors, at least 1")
    report = api.diff(a, b, selection=selection, side_a=side_a, side_b=side_b, reading=reading)
    if as_json:
        print(json.dumps(report.to_json(top), indent=2, allow_nan=False))
        return
    print(report.summary())
    if report.note:
        print(shown(report.note))
    header = ("key", "dtype", "elements", "changed", "bit-identical", "max abs change", "rel L2 change")
    rows = [_row(change) for change in (report.changes if show_all else report.grouped())]
    print("\n".join(render.aligned(header, rows, right={2, 3, 4, 5, 6})))
    if top:
        print(f"largest relative changes (top {top}):")
        print("\n".join(render.aligned(header, [_row(change) for change in report.top(top)], right={2, 3, 4, 5, 6})))
    for what, keys in (("only in A", report.only_a), ("only in B", report.only_b),
                       ("shape changed", [f"{k} {list(x)} -> {list(y)}" for k, x, y in report.reshaped])):
        if keys:
            print(f"{what} ({len(keys)}): {render.grouped(keys)}")
    if report.left_out:
        print(f"not compared ({report.left_out_why}): {render.grouped(report.left_out)}")


def _row(change) -> tuple[str, ...]:
    share = f"{100 * change.identical / change.numel:.1f}%" if change.numel else "-"
    changed = f"{change.changed:,} ({100 * change.changed / change.numel:.1f}%)" if change.numel else "0"
    return (shown(change.key), change.dtype, f"{change.numel:,}", changed, share, f"{change.max_abs:.3g}",
            f"{change.relative:.3g}")
