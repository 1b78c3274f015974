"""What the commands that write share: --dequantize applied to the source, and a planned conversion
written with a progress bar, then summarized."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dcptool.cli import render
from dcptool.sizes import parse_size

# conversion is imported when a command writes, so that `inspect` starts fast (issue 5).
if TYPE_CHECKING:
    from dcptool import conversion


def dequantized(checkpoint, dequantize: bool, config_dir, dtype):
    """With --dequantize, the checkpoint with its block-scaled float8 weights as ``dtype`` ones (dcptool.quant), and notes."""
    if not dequantize:
        return checkpoint, []
    from dcptool import quant

    return quant.dequantized(checkpoint, config_dir, dtype)


def write(planned: conversion.Conversion, destination, max_memory, overwrite, fsync) -> None:
    """Write and summarize; the adapter's notes come after the summary, once the output exists."""
    from dcptool import conversion

    with render.progress(planned.total_bytes, f"writing {Path(str(destination)).name}") as advance:
        report = planned.write(destination, overwrite=overwrite, max_memory=parse_size(max_memory, "--max-memory"),
                               fsync=fsync, progress=advance)
    render.summary(report, conversion.left_out_by_kind(planned.checkpoint, planned.tensors, planned.objects),
                   planned.why_left_out, planned.reasons)
    render.notes([*report.notes, *(planned.checkpoint.info.get("not_read") or [])])  # files of the source no reader used
