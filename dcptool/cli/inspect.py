"""``dcptool inspect``: a checkpoint's format, tensors, parameter count, entries, files and mesh; its
values with --stats, one tensor's layout over the ranks with --layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Optional

import typer

from dcptool import core, formats, hub, selection
from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import FormatName, FromOption, IncludeOption, MaxMemoryOption, RevisionOption
from dcptool.cli.render import shown
from dcptool.errors import UsageError, counted
from dcptool.sizes import parse_size


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
    path, = hub.with_revision(path, revision=revision)
    checkpoint = formats.open_checkpoint(path, source_format)
    if layout_key is not None:
        _draw_layout(checkpoint, layout_key, mesh, plan, svg, as_json)
        return
    if mesh or svg:
        raise UsageError("--mesh and --svg go with --layout KEY")
    contents = _contents(checkpoint, include, with_stats, threads, max_memory)
    if as_json:
        print(json.dumps(_json_report(checkpoint, contents), indent=2))
    else:
        _print_table(path, checkpoint, contents, show_all)


class _Contents(NamedTuple):  # not a dataclass: making one costs a millisecond of start-up
    """What inspect found: the tensors and entries --include chose, the data files, mesh, names, counts, stats."""

    tensors: dict
    objects: dict
    files: list
    disk: int  # bytes of the data files
    ranks_recorded: bool  # whether the chunks record the ranks that saved them
    inferred: tuple | None  # the mesh and plan a built-in plan reproduces the saved layout with
    names: dict | None
    parameters: dict
    summary: object | None  # the --stats summary


def _contents(checkpoint, include: Optional[str], with_stats: bool, threads: int, max_memory: str) -> _Contents:
    """Everything inspect shows of ``checkpoint``; the tensors' values are read only with --stats."""
    from dcptool import stats

    tensors, objects = stats.included(checkpoint.tensors, include), stats.included(checkpoint.objects, include)
    files = checkpoint.data_files()
    disk = sum(checkpoint.files.size(f) for f in files)
    ranks_recorded = any(core.ranks_recorded(t.chunks) for t in checkpoint.tensors.values())
    inferred = None
    if ranks_recorded:
        from dcptool import resharding

        inferred = resharding.infer_mesh(checkpoint)
    return _Contents(tensors, objects, files, disk, ranks_recorded, inferred, _naming(checkpoint),
                     stats.parameter_counts(checkpoint, tensors),
                     _read_stats(checkpoint, tensors, threads, max_memory) if with_stats else None)


def _json_report(checkpoint, contents: _Contents) -> dict:
    """inspect --json: the report as a dict."""
    tensors, inferred = contents.tensors, contents.inferred
    report = {
        "format": checkpoint.format,
        "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": len(t.chunks)}
                    for k, t in tensors.items()},
        "objects": list(contents.objects),
        "total_bytes": sum(t.nbytes for t in tensors.values()),
        "files": {"count": len(contents.files), "bytes": contents.disk},
        "info": {k: str(v) if isinstance(v, Path) else v for k, v in checkpoint.info.items()},
        "mesh": None if inferred is None else inferred[0].as_dict() | {"plan": inferred[1].name},
        "names": contents.names,
        "parameters": contents.parameters,
    }
    if contents.summary:
        report["stats"] = contents.summary.to_json()
    return report


def _print_table(path: str, checkpoint, contents: _Contents, show_all: bool) -> None:
    """inspect's text: one row per tensor (or per folded group of layers), then counts, names, mesh, stats."""
    from dcptool import stats

    tensors, objects, names, inferred, summary = (contents.tensors, contents.objects, contents.names,
                                                  contents.inferred, contents.summary)

    def describe(key):
        return tensors[key].dtype, str(list(tensors[key].shape)), _chunking(tensors[key])

    rows = []  # numbered keys that agree fold into one row (model.layers.{0..79}.mlp.up_proj.weight), unless --all
    for name, keys in stats.folded_rows(list(tensors), describe, minimum=len(tensors) + 1 if show_all else 3):
        dtype, shape, chunking = describe(keys[0])
        rows.append((shown(name), dtype, shape, f"{sum(tensors[k].nbytes for k in keys):,}", chunking))
    lines = [f"{path} ({checkpoint.format})", *render.aligned(("key", "dtype", "shape", "bytes", "chunks"), rows, right={3})]
    lines += stats.parameter_lines(contents.parameters, shown)
    if objects:
        lines.append(f"non-tensor entries ({len(objects)}): {render.grouped(objects)}")
    lines.append(f"{counted(len(tensors), 'tensor')}, {sum(t.nbytes for t in tensors.values()):,} bytes of tensor data; "
                 f"{counted(len(contents.files), 'data file')}, {contents.disk:,} bytes on disk")
    lines += [f"{key}: {value}" for key, value in checkpoint.info.items() if value is not None]
    if names:
        lines.append(f"names: {names['family']}" + (f" ({names['kind']})" if names["kind"] else ""))
    if inferred:
        lines.append(f"saved on mesh {inferred[0].describe()} (plan {inferred[1].name})")
    elif contents.ranks_recorded:
        lines.append("saved on a mesh no built-in plan reproduces")
    if summary:
        lines += render.aligned(stats.STATS_HEADER, stats.stats_rows(summary, shown), right=set(range(1, 9)))
        lines += stats.summary_lines(summary, shown)
    print("\n".join(lines))


def _chunking(tensor) -> str:
    if len(tensor.chunks) == 1:
        return "1 chunk"
    splits = core.chunk_splits(tensor.chunks, len(tensor.shape))
    split = " x ".join(f"{n} along dim {d}" for d, n in enumerate(splits) if n > 1)
    return f"{len(tensor.chunks)} chunks" + (f" ({split})" if split else "")


def _read_stats(checkpoint, tensors, threads: int, max_memory: str):
    """inspect --stats: every tensor read once, with a progress bar."""
    from dcptool import stats

    with render.progress(sum(t.nbytes for t in tensors.values()), "reading") as advance:
        return stats.compute(checkpoint, tensors, max_memory=parse_size(max_memory, "--max-memory"),
                             threads=threads or None, progress=advance)


def _draw_layout(checkpoint, key: str, mesh: Optional[str], plan: str, svg: Optional[Path], as_json: bool) -> None:
    """inspect --layout KEY: the text grid (or JSON) of who holds what, and the SVG picture when asked."""
    from dcptool import layout

    picture = layout.planned_layout(checkpoint, key, mesh, plan) if mesh else layout.saved_layout(checkpoint, key)
    if svg:
        layout.write_svg(picture, svg)
    print(json.dumps(picture.to_json(), indent=2) if as_json else "\n".join(map(shown, layout.text_grid(picture))))


def _naming(checkpoint) -> dict | None:
    """The naming family and model kind of the model weights (``dcptool.adapters``), or None for names no table knows."""
    from dcptool import adapters

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
