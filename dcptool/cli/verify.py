"""``dcptool verify``: two checkpoints of any formats and layouts compared (exit 1 when they differ),
a round trip through a format, or a real dcp.load on a mesh (--load-on)."""

from __future__ import annotations

import json
from typing import Literal, Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import READING, SELECTION, OutputFormat, PlanOption, grouped, side
from dcptool.cli.render import shown
from dcptool.errors import DcptoolError, MismatchError
from dcptool.options import LoadOn, Reading, Selection, Side, Tolerance


@app.command(name="verify")
@grouped
def verify_command(
    a: str = typer.Argument(..., metavar="A", help="Reference checkpoint (any format or layout; a path, a URL or a hub repo ORG/NAME)."),
    b: Optional[str] = typer.Argument(None, metavar="B", help="Checkpoint to compare with it (any format or layout); none with --roundtrip."),
    roundtrip: Optional[OutputFormat] = typer.Option(None, "--roundtrip", help="Convert A to this format and back in a temporary folder ($TMPDIR), and compare with A."),
    atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance for floating-point values (default: bitwise)."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance (of A's values) for floating-point values (default: bitwise)."),
    dtype_as: Optional[str] = typer.Option(None, "--dtype-as", metavar="SIDE", help="B: cast A's floating-point tensors to B's dtypes before comparing (rounding as torch's .to(dtype) does), then bitwise; A: B's to A's."),
    values_only: bool = typer.Option(False, "--values-only", help="Equal values pass even where the layouts differ (the model at 'model.' in one, at the top level in the other)."),
    show_all: bool = typer.Option(False, "--all", help="List every difference (more than 20 are grouped by key prefix; --json always lists each)."),
    selection: Selection = SELECTION.only("include", "exclude"),
    side_a: Side = side("a"),
    side_b: Side = side("b"),
    load_on: Optional[str] = typer.Option(None, "--load-on", help="Load A with torch's dcp.load in a real multi-process job on this mesh (dp=2,tp=2[,ep=2,etp=tp]) and check every rank's shard against the files."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="With --load-on: processes to start (default: the mesh's world size)."),
    backend: Literal["auto", "gloo", "nccl"] = typer.Option("auto", "--backend", help="With --load-on: auto is nccl when GPUs are present, else gloo."),
    plan: str = PlanOption,
    timeout: float = typer.Option(600.0, "--timeout", help="With --load-on: seconds before the job is killed."),
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with the model's config.json: with --load-on, its heads, kv heads and experts are checked against tp and ep (a checkpoint with no config beside it needs it for tp); across naming families, Llama's q/k rows are matched by its heads."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report (exit codes stay the same)."),
    reading: Reading = READING.only("revision", "max_memory", "verify_records"),
) -> None:
    """Compare two checkpoints of any formats and layouts: keys, dtypes, shapes and values (bitwise unless --atol/--rtol).

    Tensors are read region by region within --max-memory. A training state against a model-only checkpoint (its HF export) compares the model part and lists the optimizer and other state as left out; two checkpoints whose layouts differ (model at 'model.' or at the top level) compare entry for entry and differ unless --values-only. Exit 0 when equal, 1 when they differ (missing from B, extra in B, dtype, shape, value with the first differing index, or layout), 2 when a checkpoint cannot be read.

    [bold]Examples[/bold]:
      [cyan]dcptool verify step-1000 step-1000.pt[/cyan]
      [cyan]dcptool verify step-1000 hf-out --json > verify.json[/cyan]   (model part)
      [cyan]dcptool verify step-1000 hf-bf16 --dtype-as B[/cyan]   (A cast to bf16)
      [cyan]dcptool verify step-1000 hf-bf16 --atol 1e-2 --rtol 1e-2[/cyan]
      [cyan]dcptool verify recover_checkpoint hf-out --prefix-a dcp.model[/cyan]
      [cyan]dcptool verify step-1000 --roundtrip hf[/cyan]
      [cyan]dcptool verify archon/step-200 archon-hf-export[/cyan]   (Archon names against HF names)
      [cyan]dcptool verify step-1000 --load-on dp=2,tp=2,ep=2,etp=tp[/cyan]
      [cyan]dcptool verify step-1000 --load-on dp=2,tp=2 --config-dir Llama-3.1-8B[/cyan]
    """
    from dcptool import api

    if load_on:
        on = LoadOn(load_on, nproc=nproc, backend=backend, plan=plan, timeout=timeout)
        _verify_load_on(a, on, selection, config_dir, as_json, reading)
        return
    report = api.verify(a, b, roundtrip=roundtrip, selection=selection, side_a=side_a, side_b=side_b,
                        tolerance=Tolerance(atol=atol, rtol=rtol, dtype_as=dtype_as, values_only=values_only),
                        config_dir=config_dir, reading=reading)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        if report.note:  # the first line of the output: the comparison is not the one asked for
            print(shown(report.note))
        render.print_verify(report, show_all)
        if not report.tensors and report.differences and all(d.kind in ("missing", "extra") for d in report.differences):
            print("no tensor name is on both sides: if one nests the model (dcp.model.*), try --prefix-a dcp.model or auto")
    if not report.equal:
        raise MismatchError(f"{a} and {b or 'its round trip via ' + roundtrip} differ: {report.summary()}")


def _verify_load_on(path, load_on: LoadOn, selection: Selection, config_dir, as_json: bool, reading: Reading) -> None:
    """verify --load-on: a real multi-process dcp.load of ``path`` on a mesh, every rank's shard checked."""
    from dcptool import api
    from dcptool.checks import loadcheck

    loadcheck.check_runnable(path)  # refusals before the line announcing the job
    loadcheck.check_nproc(load_on)
    if not as_json and not render.settings["quiet"]:
        render.stderr_console().print(f"loading {path} on {load_on.mesh} with dcp.load in a real multi-process job ...")
    report = api.verify(path, load_on=load_on, selection=selection, config_dir=config_dir, reading=reading)
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render.print_load_check(path, report)
    if report.problem or report.missing_ranks:
        raise DcptoolError(f"{path}: the load job did not finish ({report.problem or 'ranks missing'})")
    if not report.ok:
        failed = sorted({r.rank for r in report.ranks if r.failures or r.error})
        raise MismatchError(f"{path}: ranks {failed} failed the load check on {load_on.mesh}")
