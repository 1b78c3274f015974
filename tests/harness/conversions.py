"""Conversions with the writer's own knobs, for tests: what ``dcptool.convert`` plans, written with
``writer_options`` over the plan's (fsdp1's ``replicate``, hf's ``max_shard_size`` in bytes)."""

from __future__ import annotations

from pathlib import Path

from dcptool import formats
from dcptool.planning import conversion
from dcptool.planning.conversion import Report
from dcptool.format_interface import OutputRequest


def convert_checkpoint(
    source: str | Path,
    destination: str | Path,
    to: str,
    *,
    source_format: str | None = None,
    dtype: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    world_size: int | None = None,
    format_options: dict | None = None,
    writer_options: dict | None = None,
    **options,
) -> Report:
    """Convert a checkpoint to another format as ``dcptool.convert`` plans it (``world_size``: the ranks of a
    per-rank format, as ``OutputRequest`` has it; ``format_options``: the format's own, by name), with
    ``writer_options`` given to the format's writer over what planning chose (its own knobs, such as fsdp1's
    ``replicate``); ``options`` go to ``write_checkpoint`` (``across_ranks`` inside a job that has its own
    process group).

    """
    checkpoint = formats.open_checkpoint(source, source_format)
    request = OutputRequest(dtype=dtype, include=include, exclude=exclude, world_size=world_size,
                            format_options=formats.options(to, **format_options) if format_options else None)
    planned = conversion.plan_convert(checkpoint, to, request)
    planned.writer_options.update(writer_options or {})
    return planned.write(destination, **options)
