"""Pictures of which rank holds which block of a tensor: a text grid for the terminal and an SVG.

The blocks are the tensor's chunks as saved (DCP records the rank whose file holds each), or as
``reshard`` would lay them out for another mesh (its planning, nothing written). A 2-D tensor is
drawn as a grid of rows (dim 0) and columns (dim 1); a 1-D tensor as a bar; a tensor of more dims
by its first two, at index 0 of the others. Every block boundary gets its own cells, so a small
block is never hidden behind a large one (unless there are more boundaries than cells: then the
grid samples, and says so). The legend gives each block's rank, mesh coordinates and region.

>>> picture = saved_layout(open_checkpoint("step-1000"), "model.norm.weight")    # doctest: +SKIP
>>> print("\\n".join(text_grid(picture)))                                           # doctest: +SKIP
>>> planned = planned_layout(open_checkpoint("step-1000"), "model.norm.weight", "dp=2,tp=4")   # doctest: +SKIP
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from dcptool import selection
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.errors import UsageError, counted, option
from dcptool.mesh import Axis, Mesh, local_chunk, spec_str
from dcptool.options import MeshOptions
from dcptool.storage import atomic_output, is_remote

GRID_ROWS, GRID_WIDTH = 16, 72  # the text grid's most cell rows and characters per row


@dataclass
class Block:
    """One rectangular piece: where it lies, the rank that stores it, and every rank that holds it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    label: str  # the rank number, or a letter for a data file when the format records no ranks
    holders: list[int] = field(default_factory=list)  # ranks holding a copy (known with a mesh)

    @property
    def empty(self) -> bool:
        return 0 in self.sizes


@dataclass
class Layout:
    key: str
    dtype: str
    shape: tuple[int, ...]
    blocks: list[Block]
    what: str  # "saved on 4 ranks: dp=2 x tp=2", "as reshard lays it out on ..."
    mesh: Mesh | None = None
    spec: tuple[Axis, ...] = ()
    legend: dict[str, str] = field(default_factory=dict)  # label -> coordinates or file
    labels: str = "rank"  # what a label names: "rank", or "data file" where the format records no ranks

    def to_json(self) -> dict[str, Any]:
        rows, columns, cells, sampled = _grid(self)
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "what": self.what,
                "placement": spec_str(self.spec) if self.mesh else None,
                "blocks": [{"offsets": list(b.offsets), "sizes": list(b.sizes), "label": b.label,
                            "holders": b.holders, "where": self.legend.get(b.label)} for b in self.blocks],
                "grid": {"rows": rows, "columns": columns, "cells": cells, "sampled": sampled}}


def _tensor(checkpoint: Checkpoint, key: str) -> TensorInfo:
    tensor = checkpoint.tensors.get(key)
    if tensor is None:
        close = difflib.get_close_matches(key, list(checkpoint.tensors), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (inspect lists the keys)"
        raise UsageError(f"{checkpoint.root}: no tensor {key!r}{hint}")
    return tensor


def _coordinates(mesh: Mesh, spec: tuple[Axis, ...], rank: int) -> str:
    """``fsdp=1 tp=0``: the rank's coordinates on the axes that place this tensor (all of them when it has none)."""
    coordinates = mesh.coordinates(rank)
    axes = [a.name for a in spec if a.size > 1] or [n for n, s in (("dp_replicate", mesh.dp_replicate),
                                                                    ("fsdp", mesh.fsdp), ("tp", mesh.tp)) if s > 1]
    return " ".join(f"{name}={coordinates[name]}" for name in axes) or "the only rank"


def _planned_spec(checkpoint: Checkpoint, key: str, options: MeshOptions):
    """The reshard plan's layout of ``key``, and the plan; refused with the planner's own line."""
    from dcptool.planning import resharding

    result = resharding.prepare(checkpoint, options)
    found = next((layout for layout in result.layouts if layout.tensor.source.key == key), None)
    if found is None:
        # Problems name the parameter a tensor follows, by its model name (without a dcp.model. wrapper).
        names = [key] + [name for name, info in selection.model_part(checkpoint).items() if info.key == key]
        problem = next((p for p in result.problems if any(p.startswith(f"{name}:") for name in names)),
                       "reshard leaves it out")
        raise UsageError(f"{checkpoint.root}: {key} has no layout on {result.mesh.describe()}: {problem}")
    return found, result


def _holders(mesh: Mesh, spec: tuple[Axis, ...], shape: tuple[int, ...], block: Block) -> list[int]:
    return [rank for rank in range(mesh.world)
            if local_chunk(shape, spec, mesh.coordinates(rank)) == (block.offsets, block.sizes)]


def saved_layout(checkpoint: Checkpoint, key: str) -> Layout:
    """The blocks of ``key`` as saved: labelled by rank where the format records it, else by data file."""
    from dcptool.planning import resharding

    tensor = _tensor(checkpoint, key)
    ranks = [chunk.rank for chunk in tensor.chunks]
    legend: dict[str, str] = {}
    if None in ranks:  # torch.save, safetensors: the data files are what there is to show
        letters = {}
        for chunk in tensor.chunks:
            letters.setdefault(chunk.file, _letter(len(letters)))
        legend = {letter: f"file {file}" for file, letter in letters.items()}
        blocks = [Block(c.offsets, c.sizes, letters[c.file]) for c in tensor.chunks]
        return Layout(key, tensor.dtype, tensor.shape, blocks, f"saved in {counted(len(letters), 'data file')}",
                      legend=legend, labels="data file")
    blocks = [Block(c.offsets, c.sizes, str(c.rank), [c.rank]) for c in tensor.chunks]
    inferred = resharding.infer_mesh(checkpoint)
    planned = None
    if inferred is not None:
        mesh, plan = inferred
        try:
            planned, _ = _planned_spec(checkpoint, key, MeshOptions(**mesh.as_dict(), plan=plan.name))
        except UsageError:  # a tensor the planner leaves out (one rank's dataloader state): no coordinates
            pass
    if planned is None:
        world = checkpoint.info.get("world_size") or len(set(ranks))
        how = f"on {mesh.describe()}" if inferred else "(a mesh no built-in plan reproduces)"
        return Layout(key, tensor.dtype, tensor.shape, blocks, f"saved by {counted(world, 'rank')} {how}")
    for block in blocks:
        block.holders = _holders(mesh, planned.spec, tensor.shape, block) or block.holders
    legend = {str(rank): _coordinates(mesh, planned.spec, rank) for rank in sorted(set(ranks))}
    return Layout(key, tensor.dtype, tensor.shape, blocks, f"saved on {mesh.describe()}", mesh, planned.spec, legend)


def planned_layout(checkpoint: Checkpoint, key: str, options: MeshOptions) -> Layout:
    """The blocks of ``key`` as ``reshard`` lays them out on the mesh (by its plan; dcp.save's choice of the
    storing rank among the holders included)."""
    tensor = _tensor(checkpoint, key)
    planned, result = _planned_spec(checkpoint, key, options)
    mesh = result.mesh
    blocks = []
    for offsets, chunk_sizes, rank in planned.chunks:
        block = Block(offsets, chunk_sizes, str(rank))
        block.holders = _holders(mesh, planned.spec, tensor.shape, block)
        blocks.append(block)
    legend = {str(rank): _coordinates(mesh, planned.spec, rank) for rank in sorted({c[2] for c in planned.chunks})}
    what = f"as reshard lays it out on {mesh.describe()} (plan {result.plan.name}: {spec_str(planned.spec)})"
    return Layout(key, tensor.dtype, tensor.shape, blocks, what, mesh, planned.spec, legend)


def _letter(index: int) -> str:
    letters = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        letters = chr(ord("A") + rest) + letters
    return letters


def _drawn(layout: Layout) -> tuple[list[int], list[Block]]:
    """The extents of the drawn dims (rows, columns; a bar has one row) and the blocks in the drawn plane."""
    shape = layout.shape
    plane = [b for b in layout.blocks if not b.empty and all(o == 0 for o in b.offsets[2:])]
    if len(shape) >= 2:
        return [shape[0], shape[1]], plane
    return [1, shape[0] if shape else 1], plane


def _segments(extent: int, cuts: set[int], cells: int) -> tuple[list[tuple[int, int]], bool]:
    """Split ``[0, extent)`` into at most ``cells`` element ranges, one or more per span between cuts,
    in proportion to its length; with more spans than cells, equal ranges (sampled: True)."""
    points = sorted({0, extent} | {c for c in cuts if 0 < c < extent})
    spans = list(zip(points, points[1:]))
    if len(spans) > cells:
        edges = [round(i * extent / cells) for i in range(cells + 1)]
        return [(a, b) for a, b in zip(edges, edges[1:]) if b > a], True
    cells = min(cells, extent)
    share = [max(1, round(cells * (b - a) / extent)) for a, b in spans]
    while sum(share) > cells:  # rounding gave too many: take from the largest
        share[share.index(max(share))] -= 1
    ranges = []
    for (a, b), count in zip(spans, share):
        edges = [a + round(i * (b - a) / count) for i in range(count + 1)]
        ranges += [(x, y) for x, y in zip(edges, edges[1:]) if y > x]
    return ranges, False


def _grid(layout: Layout, rows_max: int = GRID_ROWS, width: int = GRID_WIDTH):
    """Element ranges of the cell rows and columns, the label of each cell ('' where no block lies) and
    whether the grid samples."""
    extents, plane = _drawn(layout)
    two_d = len(layout.shape) >= 2
    label_width = max([len(b.label) for b in layout.blocks] + [1]) + 1
    row_cuts = {x for b in plane for x in (b.offsets[0], b.offsets[0] + b.sizes[0])} if two_d else set()
    col_dim = 1 if two_d else 0
    col_cuts = {x for b in plane for x in (b.offsets[col_dim], b.offsets[col_dim] + b.sizes[col_dim])} if layout.shape else set()
    rows, sampled_rows = _segments(extents[0], row_cuts, rows_max if two_d else 1)
    columns, sampled_columns = _segments(extents[1], col_cuts, max(1, width // label_width))

    def label_at(row: int, column: int) -> str:
        point = (row, column) if two_d else (column,)
        for block in plane:
            if all(o <= p < o + s for p, o, s in zip(point, block.offsets, block.sizes)):
                return block.label
        return ""

    cells = [[label_at(r0, c0) for c0, _ in columns] for r0, _ in rows]
    return rows, columns, cells, sampled_rows or sampled_columns


def text_grid(layout: Layout) -> list[str]:
    """The layout as lines of text: a heading, the grid with each cell's rank, and the legend."""
    rows, columns, cells, sampled = _grid(layout)
    width = max([len(b.label) for b in layout.blocks] + [1]) + 1
    dims = ("rows: dim 0, columns: dim 1" if len(layout.shape) >= 2 else "dim 0 as a bar" if layout.shape
            else "a scalar, one cell")
    if len(layout.shape) > 2:
        others = "dim 2" if len(layout.shape) == 3 else f"dims 2..{len(layout.shape) - 1}"
        dims += f" ({others} at index 0)"
    lines = [f"{layout.key}: {layout.dtype}{list(layout.shape)}, {counted(len(layout.blocks), 'block')}, {layout.what}",
             f"{dims}; each cell shows the {layout.labels} holding it"]
    margin = len(str(rows[-1][0])) if rows else 1
    lines.append(_column_ruler(columns, cells, margin + 2, width))
    previous = None
    for (r0, _), row in zip(rows, cells):
        start = str(r0) if row != previous else ""
        lines.append(f"{start:>{margin}} |" + "".join(label.rjust(width) if label else " " * (width - 1) + "." for label in row))
        previous = row
    if sampled:
        lines.append("(more block boundaries than cells: the grid samples; the legend lists every block)")
    lines.append("legend:")
    for block in sorted(layout.blocks, key=lambda b: (len(b.label), b.label, b.offsets)):
        region = ", ".join(f"{o}:{o + s}" for o, s in zip(block.offsets, block.sizes))
        where = layout.legend.get(block.label, "")
        copies = [r for r in block.holders if str(r) != block.label]
        extra = f"; also held by rank{'s' if len(copies) > 1 else ''} {', '.join(map(str, copies))}" if copies else ""
        lines.append(f"  {block.label:>{width - 1}}  [{region}]  {where}{extra}".rstrip())
    return lines


def _column_ruler(columns: list[tuple[int, int]], cells: list[list[str]], indent: int, width: int) -> str:
    """The first element index of each column where a block starts, above it, where it fits."""
    ruler = [" "] * (indent + len(columns) * width + 12)
    for i, (start, _) in enumerate(columns):
        if i and not any(row[i] != row[i - 1] for row in cells):
            continue
        text, at = str(start), indent + i * width + width - 1  # under the cell's last character, as labels are
        at = max(indent, at - len(text) + 1)
        if all(c == " " for c in ruler[max(0, at - 1):at + len(text)]):
            ruler[at:at + len(text)] = text
    return "".join(ruler).rstrip()


def svg(layout: Layout, width: int = 640) -> str:
    """The layout as an SVG picture: blocks drawn to scale in the drawn plane, coloured by rank, with a legend."""
    extents, plane = _drawn(layout)
    rows, columns = max(extents[0], 1), max(extents[1], 1)
    height = 40 if len(layout.shape) < 2 else max(60, min(width, round(width * rows / columns)))
    top, left = 40, 10
    parts = [f'<text x="{left}" y="16" font-size="13" font-family="monospace">'
             f'{escape(layout.key)}: {layout.dtype}{list(layout.shape)}</text>',
             f'<text x="{left}" y="32" font-size="11" font-family="monospace">{escape(layout.what)}</text>']
    for block in plane:
        if len(layout.shape) >= 2:
            y0, y1 = block.offsets[0], block.offsets[0] + block.sizes[0]
            x0, x1 = block.offsets[1], block.offsets[1] + block.sizes[1]
        else:
            y0, y1 = 0, 1
            x0, x1 = (block.offsets[0], block.offsets[0] + block.sizes[0]) if layout.shape else (0, 1)
        x, w = left + x0 * width / columns, (x1 - x0) * width / columns
        y, h = top + y0 * height / rows, (y1 - y0) * height / rows
        parts.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{_colour(block.label)}" '
                     f'stroke="#333" stroke-width="0.5"><title>{escape(_block_title(layout, block))}</title></rect>')
        if w >= 8 * len(block.label) + 4 and h >= 14:
            parts.append(f'<text x="{x + w / 2:.2f}" y="{y + h / 2 + 4:.2f}" font-size="12" font-family="monospace" '
                         f'text-anchor="middle">{escape(block.label)}</text>')
    y = top + height + 24
    for label in dict.fromkeys(b.label for b in layout.blocks):
        parts.append(f'<rect x="{left}" y="{y - 10}" width="12" height="12" fill="{_colour(label)}" stroke="#333" stroke-width="0.5"/>')
        text = f"{label}: {layout.legend.get(label, '')}".rstrip(": ")
        parts.append(f'<text x="{left + 18}" y="{y}" font-size="11" font-family="monospace">{escape(text)}</text>')
        y += 16
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 2 * left}" height="{y}" '
            f'viewBox="0 0 {width + 2 * left} {y}">\n' + "\n".join(parts) + "\n</svg>\n")


def write_svg(layout: Layout, path: Path) -> None:
    """Write ``svg(layout)`` to ``path`` atomically; an existing file there is replaced (a picture is remade at will)."""
    if is_remote(path):
        raise UsageError(f"{option('svg', path)}: give a local file")
    with atomic_output(Path(path), overwrite=True, is_dir=False) as temporary:
        temporary.write_text(svg(layout))


def _block_title(layout: Layout, block: Block) -> str:
    region = ", ".join(f"{o}:{o + s}" for o, s in zip(block.offsets, block.sizes))
    return f"{block.label} [{region}] {layout.legend.get(block.label, '')}".rstrip()


def _colour(label: str) -> str:
    """Well-separated hues by the golden angle: rank 0, 1, 2 ... (or file A, B ...) never look alike."""
    index = int(label) if label.isdigit() else sum((ord(c) - 64) * 26 ** i for i, c in enumerate(reversed(label))) - 1
    return f"hsl({index * 137.508 % 360:.1f}, 65%, 72%)"
