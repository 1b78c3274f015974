"""FP8 block dequantization (``--dequantize``): float8 weights with per-block scales become ``--dtype`` weights.

DeepSeek-V3 and the Qwen3 FP8 releases store ``X.weight`` as ``float8_e4m3fn`` and ``X.weight_scale_inv``
as float32 of shape ``(ceil(rows / b0), ceil(cols / b1))``, one scale per ``b0 x b1`` block
(``quantization_config.weight_block_size`` in config.json, ``[128, 128]`` in both). The value is
``(w.float() * scale broadcast per block).to(dtype)``, bitwise as torch computes it: fp8 decoded
exactly to float32, one float32 multiply, then rounded to ``dtype`` as torch rounds.

Nothing is materialized: a dequantized weight is a tensor whose regions are computed when read
(``TensorInfo.transform``), a block row at a time, so every command streams it within ``--max-memory``.

>>> checkpoint, notes = dequantized(open_checkpoint("DeepSeek-V3"), "DeepSeek-V3", "bfloat16")   # doctest: +SKIP
>>> checkpoint.tensors["model.layers.0.mlp.down_proj.weight"].dtype                              # doctest: +SKIP
'bfloat16'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dcptool import dtypes
from dcptool.engine.core import Checkpoint, Computed, TensorInfo, workspace
from dcptool.errors import UsageError, option

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv


@dataclass(frozen=True)
class BlockDequant(Computed):
    """How the regions of a dequantized weight are computed (a ``TensorInfo.transform``)."""

    weight: TensorInfo  # the float8 weight as stored
    scale: TensorInfo  # one scale per block
    block: tuple[int, int]
    dtype: str  # the output's
    work_bytes = 9  # per element: the float8 bits, their float32 values, the rounding (``workspace``s)

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (an unsigned view of ``dtype``, shape ``sizes``) with the region at ``offsets``,
        a block row at a time."""
        (row0, col0), (rows, cols), (b0, b1) = offsets, sizes, self.block
        first_col_block, last_col_block = col0 // b1, (col0 + cols - 1) // b1 if cols else col0 // b1
        # Column j of the region is in block column (col0 + j) // b1: its index among those read.
        col_blocks = (np.arange(col0, col0 + cols) // b1) - first_col_block
        start = row0
        while start < row0 + rows:
            stop = min(row0 + rows, (start // b0 + 1) * b0)  # to the end of this block row
            shape = (stop - start, cols)
            bits = workspace("dequant.bits", shape, np.uint8)
            checkpoint.read_region(self.weight, (start, col0), shape, bits, scratch, passing=True)
            scales = self._scales(checkpoint, start // b0, first_col_block, last_col_block, scratch)
            values = workspace("dequant.values", shape, np.float32)
            np.take(dtypes.float8_to_float32(np.arange(256, dtype=np.uint8), self.weight.dtype), bits, out=values)
            values *= scales[col_blocks]  # float32 times float32, as torch's w.float() * scale
            dtypes.from_float32(values, self.dtype, out[start - row0:stop - row0],
                                workspace("dequant.rounding", shape, np.uint32))
            start = stop

    def _scales(self, checkpoint, block_row: int, first: int, last: int, scratch) -> np.ndarray:
        itemsize = dtypes.dtype(self.scale.dtype).itemsize
        raw = np.empty((1, last - first + 1), dtype=dtypes.raw_view_type(itemsize))
        checkpoint.read_region(self.scale, (block_row, first), raw.shape, raw, scratch, passing=True)
        return dtypes.cast(raw[0], self.scale.dtype, "float32").view(np.float32)


def block_size(config: dict | None, where: str) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of a config.json, checked."""
    quantization = (config or {}).get("quantization_config")
    block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
    if block is None:
        raise UsageError(f"{where}: {option('dequantize', True)} needs quantization_config.weight_block_size in config.json "
                         "(the block size of the weight_scale_inv scales)")
    if not (isinstance(block, list) and len(block) == 2 and all(type(n) is int and n > 0 for n in block)):
        raise UsageError(f"{where}: quantization_config.weight_block_size is {block!r}, not two positive integers")
    return block[0], block[1]


def dequantized(checkpoint: Checkpoint, config_dir: str | Path | None,
                dtype: str | None) -> tuple[Checkpoint, list[str]]:
    """The checkpoint with every block-scaled float8 weight as a ``dtype`` (default bfloat16) weight and
    its scale left out, and notes saying so. ``config_dir`` (else the folder the reader found) holds the
    config.json with the block size."""
    from dcptool.selection import read_config

    dtype = dtype or "bfloat16"
    pairs = {key: checkpoint.tensors[key + SCALE_SUFFIX] for key, t in checkpoint.tensors.items()
             if t.dtype in dtypes.FLOAT8 and key + SCALE_SUFFIX in checkpoint.tensors}
    if not pairs:
        return checkpoint, [f"{option('dequantize', True)}: no float8 weight with a {SCALE_SUFFIX} scale; nothing dequantized"]
    config_dir = config_dir or checkpoint.info.get("hf_config_dir")
    where = f"{config_dir}/config.json" if config_dir is not None else str(checkpoint.root)
    if config_dir is None:
        raise UsageError(f"{checkpoint.root}: {option('dequantize', True)} needs the model's config.json (its "
                         f"quantization_config): give its folder with {option('config_dir')}")
    block = block_size(read_config(config_dir), where)
    tensors = dict(checkpoint.tensors)
    for key, scale in pairs.items():
        weight = tensors[key]
        expected = tuple(-(-n // b) for n, b in zip(weight.shape, block))
        if len(weight.shape) != 2 or scale.shape != expected or scale.dtype not in dtypes.CASTABLE:
            raise UsageError(f"{checkpoint.root}: {scale.key} is {scale.dtype}{list(scale.shape)}, not float scales of "
                             f"the {list(block)} blocks of {key} {list(weight.shape)} ({list(expected)})")
        del tensors[scale.key]
        tensors[key] = dataclasses.replace(weight, dtype=dtype, transform=BlockDequant(weight, scale, block, dtype))
    left = [k for k, t in tensors.items() if t.dtype in dtypes.FLOAT8]
    notes = [f"dequantized {len(pairs)} float8 weights to {dtype} (blocks of {block[0]}x{block[1]})",
             f"left out {len(pairs)} {SCALE_SUFFIX} scales: folded into their weights by {option('dequantize', True)}"]
    if left:
        notes.append(f"kept {len(left)} float8 tensors that have no {SCALE_SUFFIX} scale as they are: {left[0]}, ...")
    info = checkpoint.info | {"dequantized": True}
    return dataclasses.replace(checkpoint, tensors=tensors, info=info), notes
