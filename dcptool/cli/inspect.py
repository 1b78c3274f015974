"""``dcptool inspect``: a checkpoint's format, tensors, parameter count, entries, files and mesh; its
values with --stats, one tensor's layout over the ranks with --layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from dcptool.engine import chunks
from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import READING, SELECTION, grouped
from dcptool.cli.render import shown
from dcptool.errors import MismatchError, UsageError, counted
from dcptool.options import MeshOptions, Reading, Selection


@app.command()
@grouped
def inspect(
    path: str = typer.Argument(..., help="Checkpoint folder or file (or a URL: s3://..., memory://...; or a hub repo ORG/NAME)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON report instead of a table."),
    selection: Selection = SELECTION.only("include"),
    show_all: bool = typer.Option(False, "--all", "--no-collapse", help="One row per key (by default numbered layers of one dtype, shape and chunking fold into one row)."),
    stats: bool = typer.Option(False, "--stats", help="Read every tensor: min, max, mean, std, L2 norm, zeros, NaN, Inf; flag all-zero tensors and experts, NaN/Inf, identical tensors; exit 1 when a tensor cannot be read (a damaged record)."),
    layout_key: Optional[str] = typer.Option(None, "--layout", metavar="KEY", help="Draw which rank holds which block of this tensor."),
    mesh: Optional[str] = typer.Option(None, "--mesh", help="With --layout: lay it out on this mesh (dp=2,tp=4; also ep, etp, cp, dp_replicate) as reshard would, instead of as saved."),
    plan: str = typer.Option("auto", "--plan", help="With --mesh: placement plan (auto, hf, torchtitan, transformers, fsdp, or a YAML/JSON plan file)."),
    svg: Optional[Path] = typer.Option(None, "--svg", help="With --layout: also write the picture to this SVG file (replaced if it exists)."),
    threads: int = typer.Option(0, "--threads", help="With --stats: reading threads (default: the CPUs, at most 4)."),
    reading: Reading = READING.only("format", "revision", "max_memory", "verify_records"),
) -> None:
    """Show a checkpoint's format, tensors (dtype, shape, bytes, chunking), parameter count, other entries and files.

    [bold]Examples[/bold]:
      [cyan]dcptool inspect checkpoints/step-1000 --json[/cyan]
      [cyan]dcptool inspect step-1000 --stats --include 'layers\\.1[0-9]\\.'[/cyan]
      [cyan]dcptool inspect step-1000 --layout model.layers.0.self_attn.q_proj.weight --mesh dp=2,tp=4 --svg q.svg[/cyan]
    """
    from dcptool import api

    if layout_key is not None:
        from dcptool.checks import layout

        on = MeshOptions.parse(mesh, plan=plan) if mesh else None
        picture = api.tensor_layout(path, layout_key, mesh=on, svg=svg, reading=reading)
        print(json.dumps(picture.to_json(), indent=2) if as_json else "\n".join(map(shown, layout.text_grid(picture))))
        return
    if mesh or svg:
        raise UsageError("--mesh and --svg go with --layout KEY")
    found = api.inspect(path, selection=selection, stats=stats, threads=threads, reading=reading)
    if as_json:
        print(json.dumps(found.to_json(), indent=2))
    else:
        _print_table(path, found, show_all)
    unreadable = [key for flag in found.stats.flags if flag.kind == "unreadable" for key in flag.keys] if found.stats else []
    if unreadable:  # damage a CI gate must see, as check and verify report it
        more = f" and {len(unreadable) - 1} more" if len(unreadable) > 1 else ""
        raise MismatchError(f"{path}: {counted(len(unreadable), 'tensor')} could not be read: {unreadable[0]}{more}")


def _print_table(path: str, found, show_all: bool) -> None:
    """inspect's text: one row per tensor (or per folded group of layers), then counts, names, mesh, stats."""
    from dcptool.checks import stats

    tensors, checkpoint = found.tensors, found.checkpoint

    def describe(key):
        return tensors[key].dtype, str(list(tensors[key].shape)), _chunking(tensors[key])

    rows = []  # numbered keys that agree fold into one row (model.layers.{0..79}.mlp.up_proj.weight), unless --all
    for name, keys in stats.folded_rows(list(tensors), describe, minimum=len(tensors) + 1 if show_all else 3):
        dtype, shape, chunking = describe(keys[0])
        rows.append((shown(name), dtype, shape, f"{sum(tensors[k].nbytes for k in keys):,}", chunking))
    lines = [f"{path} ({checkpoint.format})", *render.aligned(("key", "dtype", "shape", "bytes", "chunks"), rows, right={3})]
    lines += stats.parameter_lines(found.parameters, shown)
    if found.objects:
        lines.append(f"non-tensor entries ({len(found.objects)}): {render.grouped(found.objects)}")
    lines.append(f"{counted(len(tensors), 'tensor')}, {sum(t.nbytes for t in tensors.values()):,} bytes of tensor data; "
                 f"{counted(len(found.files), 'data file')}, {found.disk:,} bytes on disk")
    lines += [f"{key}: {value}" for key, value in checkpoint.info.items() if value is not None
              and not isinstance(value, dict)]  # a whole record (Megatron's args) is for --json
    if found.names:
        lines.append(f"names: {found.names['family']}" + (f" ({found.names['kind']})" if found.names["kind"] else ""))
    if found.lora:
        lines.append(_lora_line(found.lora))
    if found.mesh:
        lines.append(f"saved on mesh {found.mesh.describe()} (plan {found.plan})")
    elif found.ranks_recorded:
        lines.append("saved on a mesh no built-in plan reproduces")
    if found.stats:
        lines += render.aligned(stats.STATS_HEADER, stats.stats_rows(found.stats, shown), right=set(range(1, 9)))
        lines += stats.summary_lines(found.stats, shown)
    print("\n".join(lines))


def _lora_line(lora: dict) -> str:
    """The adapters of a peft model: names, ranks, targets, and whether lora_alpha is known."""
    if "problem" in lora:
        return f"LoRA: {lora['problem']}"
    ranks = "/".join(map(str, lora["rank"]))
    alpha = (f"lora_alpha {lora['alpha']} ({lora['alpha_from']})" if lora["alpha"] is not None else
             "lora_alpha unknown (no adapter_config.json beside it: export-hf --lora needs --lora-config or --lora-alpha)")
    saved = f"; modules_to_save {', '.join(lora['modules_to_save'])}" if lora["modules_to_save"] else ""
    targets = [*lora["target_modules"], *lora["target_parameters"]]
    return (f"LoRA{' (DoRA)' if lora['dora'] else ''}: adapter {', '.join(lora['adapters'])}, rank {ranks} on "
            f"{len(lora['ranks'])} modules ({', '.join(targets)}){saved}; {alpha}"
            f"{', rsLoRA' if lora['use_rslora'] else ''}")


def _chunking(tensor) -> str:
    if len(tensor.chunks) == 1:
        return "1 chunk"
    splits = chunks.chunk_splits(tensor.chunks, len(tensor.shape))
    split = " x ".join(f"{n} along dim {d}" for d, n in enumerate(splits) if n > 1)
    return f"{len(tensor.chunks)} chunks" + (f" ({split})" if split else "")

