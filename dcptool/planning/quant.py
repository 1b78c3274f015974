"""Quantized weights as computed tensors: dequantization (``--dequantize``: block-scaled float8 weights and MXFP4
experts become ``--dtype`` tensors), quantization (``export-hf --quantize``: the other way), and both sides of a
quantized export compared with its source (``folded``: verify, diff).

**FP8.** DeepSeek-V3 and the Qwen3 FP8 releases store ``X.weight`` as ``float8_e4m3fn`` and ``X.weight_scale_inv``
as float32 of shape ``(ceil(rows / b0), ceil(cols / b1))``, one scale per ``b0 x b1`` block
(``quantization_config.weight_block_size`` in config.json, ``[128, 128]`` in both). The value is
``(w.float() * scale broadcast per block).to(dtype)``, bitwise as torch computes it: fp8 decoded
exactly to float32, one float32 multiply, then rounded to ``dtype`` as torch rounds.

**MXFP4.** GPT-OSS's release stores its experts as ``X_blocks`` (uint8 ``[experts, rows, blocks, 16]``) and
``X_scales`` (uint8 ``[experts, rows, blocks]``), ``quantization_config.quant_method: mxfp4`` (the format:
``dcptool.mxfp4``). transformers dequantizes them (``convert_moe_packed_tensors``) into ``X``, the bf16 model's
tensor, of shape ``[experts, 32 * blocks, rows]``: each expert's matrix transposed, so ``gate_up_proj`` is
``[experts, hidden, 2 * intermediate]`` (gate and up columns interleaved, as stored) and ``down_proj``
``[experts, intermediate, hidden]``. The values are the codes times their block's scale, rounded once to
``dtype``, bitwise as transformers gives them.

**Quantizing** (``quantized``): each linear weight of the decoder layers becomes two computed tensors, its
``float8_e4m3fn`` codes (``Fp8Codes``) and its float32 scales (``Fp8Scales``): per block, scale = amax / 448
(``Fp8Blocks``; rounded up to a power of two for ``ue8m0``), codes = ``w / scale`` rounded as torch's
``.to(torch.float8_e4m3fn)`` (``dtypes.float32_to_float8``). A codes region reads the whole blocks it touches for
their scales; copies plan its slabs in whole block rows (``Computed.rows_together``), so nothing is read twice
but the scale tensor's own pass. ``compressed-tensors`` names the scales ``X_scale`` and says so in its own
``quantization_config``. GPT-OSS's experts become ``X_blocks`` and ``X_scales`` (``Mxfp4Encoded``,
``mxfp4.encode``). ``like=DIR`` (``LikeRelease``) takes a release's ``quantization_config`` and tensors, and a
block keeps the release's scale where that scale still holds its values exactly (``Release``).

Nothing is materialized: a dequantized or quantized tensor is one whose regions are computed when read
(``TensorInfo.transform``), so every command streams it within ``--max-memory``.

>>> checkpoint, notes = dequantized(open_checkpoint("DeepSeek-V3"), "DeepSeek-V3", "bfloat16")   # doctest: +SKIP
>>> checkpoint.tensors["model.layers.0.mlp.down_proj.weight"].dtype                              # doctest: +SKIP
'bfloat16'
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcptool import dtypes, mxfp4
from dcptool.engine.core import Checkpoint, Computed, OutTensor, TensorInfo, float32_region
from dcptool.engine.reading import workspace
from dcptool.errors import CheckpointError, UsageError, option
from dcptool.options import Quantize

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
COMPRESSED_SCALE_SUFFIX = "_scale"  # compressed-tensors' (llm-compressor's): X.weight -> X.weight_scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"  # MXFP4: X_blocks and X_scales -> X


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


@dataclass(frozen=True)
class Mxfp4Dequant(Computed):
    """How the regions of a dequantized MXFP4 tensor ``[experts, columns, rows]`` are computed from its
    blocks ``[experts, rows, columns / 32, 16]`` and scales (a ``TensorInfo.transform``)."""

    blocks: TensorInfo
    scales: TensorInfo
    dtype: str  # the output's
    # per element: its share of the packed bytes, their scales and look-up indexes, the values before the transpose
    work_bytes = 7

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (an unsigned view of ``dtype``, shape ``sizes``) with the region at ``offsets``: the
        bytes of its columns in each of its rows decoded, then transposed into place."""
        (expert, column, row), (experts, columns, rows) = offsets, sizes
        if not (experts and columns and rows):
            return
        first_byte, end_byte = column // 2, (column + columns + 1) // 2  # the bytes holding the region's columns
        first_block, end_block = first_byte // mxfp4.BYTES_PER_SCALE, -(-end_byte // mxfp4.BYTES_PER_SCALE)
        blocks = workspace("mxfp4.blocks", (experts, rows, end_block - first_block, mxfp4.BYTES_PER_SCALE), np.uint8)
        checkpoint.read_region(self.blocks, (expert, row, first_block, 0), blocks.shape, blocks, scratch, passing=True)
        scales = workspace("mxfp4.scales", (experts, rows, end_block - first_block), np.uint8)
        checkpoint.read_region(self.scales, (expert, row, first_block), scales.shape, scales, scratch, passing=True)
        skip = first_byte - first_block * mxfp4.BYTES_PER_SCALE
        packed = blocks.reshape(experts, rows, -1)[:, :, skip:skip + end_byte - first_byte]
        # each byte's scale: that of the block it is in
        byte_scales = workspace("mxfp4.byte_scales", packed.shape, np.uint8)
        np.take(scales, np.arange(first_byte, end_byte) // mxfp4.BYTES_PER_SCALE - first_block, axis=2,
                out=byte_scales)
        itemsize = dtypes.dtype(self.dtype).itemsize
        values = workspace("mxfp4.values", (experts, rows, 2 * packed.shape[2]), dtypes.raw_view_type(itemsize))
        mxfp4.decode(packed, byte_scales, self.dtype, values, workspace("mxfp4.index", packed.shape, np.uint16))
        start = column - 2 * first_byte
        out[...] = values[:, :, start:start + columns].transpose(0, 2, 1)


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


def fp8_layout(config: dict | None, where: str) -> tuple[str, tuple[int, int]]:
    """The scale suffix and block size of a config.json's block-scaled float8 weights: ``quant_method: fp8``'s
    ``weight_block_size`` (scales ``X_scale_inv``), or compressed-tensors' group of weights of strategy ``block``
    and its ``block_structure`` (scales ``X_scale``)."""
    quantization = (config or {}).get("quantization_config")
    if not (isinstance(quantization, dict) and quantization.get("quant_method") == "compressed-tensors"):
        return SCALE_SUFFIX, block_size(config, where)
    groups = quantization.get("config_groups")
    weights = [group.get("weights") for group in (groups.values() if isinstance(groups, dict) else [])
               if isinstance(group, dict) and isinstance(group.get("weights"), dict)]
    blocks = [w.get("block_structure") for w in weights if w.get("strategy") == "block"]
    if not blocks:
        raise UsageError(f"{where}: the compressed-tensors quantization_config has no group of weights of strategy "
                         "block (FP8 blocks with their block_structure)")
    block = blocks[0]
    if not (isinstance(block, list) and len(block) == 2 and all(type(n) is int and n > 0 for n in block)):
        raise UsageError(f"{where}: quantization_config's block_structure is {block!r}, not two positive integers")
    return COMPRESSED_SCALE_SUFFIX, (block[0], block[1])


def dequantized(checkpoint: Checkpoint, config_dir: str | Path | None,
                dtype: str | None) -> tuple[Checkpoint, list[str]]:
    """The checkpoint with every block-scaled float8 weight and every MXFP4 tensor as a ``dtype`` (default
    bfloat16) tensor, their scales left out, and notes saying so. ``config_dir`` (else the folder the reader
    found) holds the config.json with the float8 block size."""
    dtype = dtype or "bfloat16"
    checkpoint, notes = _float8_dequantized(checkpoint, config_dir, dtype)
    checkpoint, more = _mxfp4_dequantized(checkpoint, dtype)
    if not notes + more:
        nothing = (f"{option('dequantize', True)}: no float8 weight with a {SCALE_SUFFIX} scale and no MXFP4 "
                   f"{BLOCKS_SUFFIX}; nothing dequantized")
        return checkpoint, [nothing]
    return dataclasses.replace(checkpoint, info=checkpoint.info | {"dequantized": True}), notes + more


def _scale_pairs(checkpoint: Checkpoint, suffix: str) -> dict[str, TensorInfo]:
    """The float8 weights of ``checkpoint`` that have a ``suffix`` scale tensor, and those scales."""
    return {key: checkpoint.tensors[key + suffix] for key, t in checkpoint.tensors.items()
            if t.dtype in dtypes.FLOAT8 and key + suffix in checkpoint.tensors}


def _float8_dequantized(checkpoint: Checkpoint, config_dir, dtype: str) -> tuple[Checkpoint, list[str]]:
    if not (_scale_pairs(checkpoint, SCALE_SUFFIX) or _scale_pairs(checkpoint, COMPRESSED_SCALE_SUFFIX)):
        return checkpoint, []
    config_dir = config_dir or checkpoint.info.get("hf_config_dir")
    where = f"{config_dir}/config.json" if config_dir is not None else str(checkpoint.root)
    if config_dir is None:
        raise UsageError(f"{checkpoint.root}: {option('dequantize', True)} needs the model's config.json (its "
                         f"quantization_config): give its folder with {option('config_dir')}")
    from dcptool.selection import read_config

    suffix, block = fp8_layout(read_config(config_dir), where)
    pairs = _scale_pairs(checkpoint, suffix)
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
             f"left out {len(pairs)} {suffix} scales: folded into their weights by {option('dequantize', True)}"]
    if left:
        notes.append(f"kept {len(left)} float8 tensors that have no {suffix} scale as they are: {left[0]}, ...")
    return dataclasses.replace(checkpoint, tensors=tensors), notes


def _mxfp4_dequantized(checkpoint: Checkpoint, dtype: str) -> tuple[Checkpoint, list[str]]:
    """Every uint8 ``X_blocks`` with its ``X_scales`` as ``X`` (``Mxfp4Dequant``), in the blocks' place."""
    pairs = {}
    for key, blocks in checkpoint.tensors.items():
        if key.endswith(BLOCKS_SUFFIX) and blocks.dtype == "uint8":
            name = key.removesuffix(BLOCKS_SUFFIX)
            pairs[key] = (name, _mxfp4_scales(checkpoint, blocks, name))
    if not pairs:
        return checkpoint, []
    scales_keys = {scales.key for _, scales in pairs.values()}
    tensors = {}
    for key, tensor in checkpoint.tensors.items():
        if key in pairs:
            name, scales = pairs[key]
            experts, rows, count, _ = tensor.shape
            path = tensor.path[:-1] + (str(tensor.path[-1]).removesuffix(BLOCKS_SUFFIX),)
            tensors[name] = TensorInfo(path, dtype, (experts, count * mxfp4.ELEMENTS_PER_SCALE, rows),
                                       _transposed_chunks(tensor), Mxfp4Dequant(tensor, scales, dtype))
        elif key not in scales_keys:
            tensors[key] = tensor
    first = next(iter(pairs.values()))[0]
    made = (f"dequantized {len(pairs)} MXFP4 tensors to {dtype}, each X{BLOCKS_SUFFIX} with its X{SCALES_SUFFIX} as X "
            f"(each expert's matrix transposed, as transformers dequantizes them): {first}, ...")
    left = (f"left out {len(pairs)} {BLOCKS_SUFFIX} and {len(pairs)} {SCALES_SUFFIX} tensors: folded into their "
            f"dequantized tensors by {option('dequantize', True)}")
    return dataclasses.replace(checkpoint, tensors=tensors), [made, left]


def _mxfp4_scales(checkpoint: Checkpoint, blocks: TensorInfo, name: str) -> TensorInfo:
    """The scales of MXFP4 ``blocks`` (of the tensor ``name``), checked against them; CheckpointError naming the
    file where they are missing, of another shape, or where ``name`` is in the checkpoint as well."""
    where = checkpoint.files.path(blocks.chunks[0].file) if len(blocks.chunks) else str(checkpoint.root)
    scales = checkpoint.tensors.get(name + SCALES_SUFFIX)
    if scales is None:
        raise CheckpointError(f"{where}: {blocks.key} has no {name + SCALES_SUFFIX}: MXFP4 blocks cannot be "
                              f"dequantized without their scales (drop {option('dequantize', True)} to copy them as stored)")
    layout = (f"MXFP4 is uint8 blocks [experts, rows, blocks, {mxfp4.BYTES_PER_SCALE}] with uint8 scales "
              "[experts, rows, blocks]")
    if len(blocks.shape) != 4 or blocks.shape[3] != mxfp4.BYTES_PER_SCALE or scales.dtype != "uint8" \
            or scales.shape != blocks.shape[:3]:
        raise CheckpointError(f"{where}: {blocks.key} {list(blocks.shape)} and {scales.key} {scales.dtype}"
                              f"{list(scales.shape)} do not fit: {layout}")
    if name in checkpoint.tensors:
        raise CheckpointError(f"{where}: holds both {name} and {blocks.key}: which one is the tensor?")
    return scales


def _transposed_chunks(blocks: TensorInfo) -> list:
    """The chunks of the blocks as chunks of the dequantized tensor ``[experts, columns, rows]`` (a layout: the
    values are computed); one chunk where a chunk splits the 16 bytes of a block."""
    chunks = list(blocks.chunks)
    if any(c.offsets[3] or c.sizes[3] != mxfp4.BYTES_PER_SCALE for c in chunks) or not chunks:
        whole = (blocks.shape[0], blocks.shape[2] * mxfp4.ELEMENTS_PER_SCALE, blocks.shape[1])
        return [dataclasses.replace(chunks[0], offsets=(0, 0, 0), sizes=whole, strides=None, view=None)] if chunks else []
    width = mxfp4.ELEMENTS_PER_SCALE
    return [dataclasses.replace(c, offsets=(c.offsets[0], c.offsets[2] * width, c.offsets[1]),
                                sizes=(c.sizes[0], c.sizes[2] * width, c.sizes[1]), strides=None, view=None)
            for c in chunks]


# ---------------------------------------------------------------------------------------------------------
# Quantization (export-hf --quantize): float weights as block-scaled float8 codes and their scales
# ---------------------------------------------------------------------------------------------------------

FP8 = "float8_e4m3fn"
FP8_MAX = np.float32(448.0)  # float8_e4m3fn's largest
SCALE_FORMATS = ("float", "ue8m0")
# The most elements of a weight one step of a block-scaled computation holds in float32 (a block row's columns are
# taken this many at a time): its temporaries stay a few MB whatever the width of the weight.
GROUP_ELEMENTS = 2**18


@dataclass(frozen=True)
class Fp8Blocks:
    """How weights are quantized: ``block`` (rows, columns) of weight per scale, ``scale_format`` ``float`` (each
    block's amax / 448) or ``ue8m0`` (that rounded up to a power of two, DeepSeek-V3.1's ``scale_fmt``)."""

    block: tuple[int, int] = (128, 128)
    scale_format: str = "float"

    def scales(self, amax: np.ndarray) -> np.ndarray:
        """The float32 scale of blocks whose largest magnitude is ``amax`` (float32): ``amax / 448``, rounded up to
        a power of two for ``ue8m0``; 1 for a block of zeros, as transformers' ``Fp8Quantize`` stores it (its codes
        are zeros whatever the scale)."""
        scales = amax / FP8_MAX
        if self.scale_format == "ue8m0":
            mantissa, exponent = np.frexp(scales)  # scale = mantissa * 2 ** exponent, mantissa in [0.5, 1)
            exponent -= mantissa == 0.5  # a power of two already
            finite = np.isfinite(scales)  # Inf and NaN stay what they are
            scales = np.where(finite, np.ldexp(np.float32(1), exponent), scales).astype(np.float32)
        scales[amax == 0] = 1
        return scales

    def block_row(self, checkpoint: Checkpoint, weight: TensorInfo, at: tuple, block_row: int, first: int,
                  end: int, scratch, release: Release | None = None) -> tuple[np.ndarray, np.ndarray, int]:
        """The float32 values of the whole block row ``block_row`` of the matrix at ``at`` (its leading indexes), in
        columns ``[first, end)`` (block column boundaries, or the end), the scales of their blocks, and the row it
        starts at. With a ``release``, a block its scale still holds exactly keeps that scale (``Release``)."""
        (b0, b1), rows = self.block, weight.shape[-2]
        top = block_row * b0
        shape = (min(rows, top + b0) - top, end - first)
        values = float32_region(checkpoint, weight, (*at, top, first), (*(1,) * len(at), *shape), scratch,
                                workspace("fp8.values", (*(1,) * len(at), *shape), np.float32)).reshape(shape)
        # each column's largest magnitude (NaN wherever a NaN is), then each block's
        columns = np.maximum(values.max(axis=0), -values.min(axis=0))
        scales = self.scales(_per_block(columns, b1, np.zeros, np.max))
        if release is not None:
            given = release.scales(at, block_row, first // b1, len(scales), scratch)
            held = _per_block(release.holds(values, np.repeat(given, b1)[:shape[1]], weight.dtype), b1, np.ones,
                              np.all)
            scales = np.where(held, given, scales)
        return values, scales, top

    def column_groups(self, first: int, end: int) -> list[tuple[int, int]]:
        """``[first, end)`` in groups of whole blocks of columns, each of at most about ``GROUP_ELEMENTS`` a block row."""
        b0, b1 = self.block
        width = max(1, GROUP_ELEMENTS // (b0 * b1)) * b1
        return [(start, min(end, start + width)) for start in range(first, end, width)]


def _per_block(columns: np.ndarray, width: int, pad, reduce) -> np.ndarray:
    """``reduce`` of each ``width`` of ``columns``, the last padded with ``pad`` (``np.zeros``, ``np.ones``)."""
    count = -(-len(columns) // width)
    padded = pad(count * width, columns.dtype)
    padded[:len(columns)] = columns
    return reduce(padded.reshape(count, width), axis=1)


@dataclass(frozen=True)
class Release:
    """A weight's quantization in a released model (``--quantize like=DIR``): its scale tensor there. A block whose
    values that scale still holds exactly (a weight fine-tuning left alone, dequantized and quantized again) keeps
    it: requantizing it from its own amax would give other scales where the dequantization rounded (a bf16 copy
    of ``code x scale`` is not ``code x scale``, so its amax / 448 is not the scale), and so the release's codes
    and scales come back bitwise."""

    checkpoint: Checkpoint
    scale: TensorInfo

    def scales(self, at: tuple, block_row: int, first: int, count: int, scratch) -> np.ndarray:
        """The release's float32 scales of ``count`` blocks from block column ``first`` of a block row."""
        raw = np.empty((*(1,) * len(at), 1, count), dtypes.raw_view_type(dtypes.dtype(self.scale.dtype).itemsize))
        self.checkpoint.read_region(self.scale, (*at, block_row, first), raw.shape, raw, scratch, passing=True)
        return dtypes.cast(raw.reshape(count), self.scale.dtype, "float32").view(np.float32)

    @staticmethod
    def holds(values: np.ndarray, scales: np.ndarray, dtype: str) -> np.ndarray:
        """Per column of ``values`` (float32, of a weight stored as ``dtype``): whether every value is its code under
        ``scales`` (per column) times that scale, rounded to ``dtype``, as a dequantization gives it."""
        codes = np.empty(values.shape, np.uint8)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            dtypes.float32_to_float8(values / scales, FP8, codes)
            back = dtypes.float8_to_float32(codes, FP8) * scales
        if dtype in dtypes.CASTABLE and dtype != "float32":  # as the dequantization rounded it
            back = dtypes.cast(dtypes.cast(back.view(np.uint32), "float32", dtype), dtype, "float32").view(np.float32)
        return (back == values).all(axis=0)


# The most bytes of scales held for the scale tensors still to be written (``ScaleCache``), over every weight.
CACHED_SCALES_BYTES = 64 * 2**20
_cached = {"bytes": 0}
_cached_lock = threading.Lock()


class ScaleCache:
    """The scales ``Fp8Codes`` worked out for its codes, kept for the weight's scale tensor (``Fp8Scales``), which
    then need not read the weight again: each entry taken once, none kept once the whole scale tensor was read
    (``done``). All entries together hold at most ``CACHED_SCALES_BYTES``; one not kept is worked out again."""

    def __init__(self, count: int):
        self._scales: dict[tuple, np.ndarray] = {}
        self._left = count  # scales the scale tensor has yet to read
        self._lock = threading.Lock()

    def put(self, key: tuple, scales: np.ndarray) -> None:
        with self._lock, _cached_lock:
            if self._left and _cached["bytes"] + scales.nbytes <= CACHED_SCALES_BYTES:
                self._scales[key] = scales
                _cached["bytes"] += scales.nbytes

    def take(self, key: tuple) -> np.ndarray | None:
        with self._lock, _cached_lock:
            found = self._scales.pop(key, None)
            if found is not None:
                _cached["bytes"] -= found.nbytes
            return found

    def done(self, count: int) -> None:
        """``count`` more scales were read; once all were, nothing more is kept."""
        with self._lock, _cached_lock:
            self._left = max(0, self._left - count)
            if not self._left:
                _cached["bytes"] -= sum(scales.nbytes for scales in self._scales.values())
                self._scales.clear()


@dataclass(frozen=True)
class Fp8Codes(Computed):
    """The ``float8_e4m3fn`` codes of a float weight (a ``TensorInfo.transform``): each block of ``blocks.block`` in
    its last two dims divided by its scale (float32), rounded to nearest even as torch's ``.to(torch.float8_e4m3fn)``
    rounds."""

    weight: TensorInfo
    blocks: Fp8Blocks
    release: Release | None = None
    cache: ScaleCache | None = field(default=None, compare=False)
    work_bytes = 0  # its temporaries are a column group's (``GROUP_ELEMENTS``), whatever the region

    @property
    def rows_together(self) -> int:
        return self.blocks.block[0]

    def others(self) -> tuple[Checkpoint, ...]:
        return (self.release.checkpoint,) if self.release is not None else ()

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (uint8, shape ``sizes``) with the codes of the region at ``offsets``: block row by block row,
        a column group at a time, each group's whole blocks read for their scales."""
        (b0, b1), lead = self.blocks.block, len(sizes) - 2
        (row0, col0), (rows, cols) = offsets[lead:], sizes[lead:]
        if 0 in sizes:
            return
        first, end = col0 // b1 * b1, min(self.weight.shape[-1], -(-(col0 + cols) // b1) * b1)
        for index in np.ndindex(*sizes[:lead]):
            at = tuple(o + i for o, i in zip(offsets, index))
            for block_row in range(row0 // b0, (row0 + rows - 1) // b0 + 1):
                for start, stop in self.blocks.column_groups(first, end):
                    values, scales, top = self.blocks.block_row(checkpoint, self.weight, at, block_row, start, stop,
                                                                scratch, self.release)
                    if self.cache is not None:  # for the scale tensor (whose groups are these, read whole)
                        self.cache.put((at, block_row, start, stop), scales)
                    lo, hi = max(row0, top), min(row0 + rows, top + values.shape[0])
                    left, right = max(col0, start), min(col0 + cols, stop)
                    part = values[lo - top:hi - top, left - start:right - start]
                    part /= np.repeat(scales, b1)[left - start:right - start]  # float32 / float32, as torch's w / scale
                    dtypes.float32_to_float8(part, FP8, out[index][lo - row0:hi - row0, left - col0:right - col0],
                                             workspace("fp8.keys", part.shape, np.uint32))


@dataclass(frozen=True)
class Fp8Scales(Computed):
    """The float32 scales of the blocks of a float weight (``Fp8Codes``'), ``[..., ceil(rows / b0), ceil(cols / b1)]``
    (a ``TensorInfo.transform``): what ``weight_scale_inv`` holds, the factor that dequantizes the codes."""

    weight: TensorInfo
    blocks: Fp8Blocks
    release: Release | None = None
    cache: ScaleCache | None = field(default=None, compare=False)
    work_bytes = 0  # its temporaries are a column group's

    def others(self) -> tuple[Checkpoint, ...]:
        return (self.release.checkpoint,) if self.release is not None else ()

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (uint32, shape ``sizes``) with the scales of the region of blocks at ``offsets``."""
        b1, lead = self.blocks.block[1], len(sizes) - 2
        (row0, col0), (rows, cols) = offsets[lead:], sizes[lead:]
        if 0 in sizes:
            return
        first, end = col0 * b1, min(self.weight.shape[-1], (col0 + cols) * b1)
        for index in np.ndindex(*sizes[:lead]):
            at = tuple(o + i for o, i in zip(offsets, index))
            for block_row in range(row0, row0 + rows):
                for start, stop in self.blocks.column_groups(first, end):
                    scales = self.cache.take((at, block_row, start, stop)) if self.cache is not None else None
                    if scales is None:
                        _, scales, _ = self.blocks.block_row(checkpoint, self.weight, at, block_row, start, stop,
                                                             scratch, self.release)
                    out[index][block_row - row0, (start - first) // b1:(start - first) // b1 + len(scales)] = \
                        scales.view(np.uint32)
        if self.cache is not None:
            self.cache.done(math.prod(sizes))


@dataclass
class LikeRelease:
    """``--quantize like=DIR``: a released model folder's quantization. ``quantization`` is its config.json's
    ``quantization_config``; ``checkpoint`` its weights where the folder holds them (which weights it quantized,
    and their scales: ``Release``), else None."""

    folder: str
    quantization: dict
    checkpoint: Checkpoint | None

    @classmethod
    def read(cls, folder: str) -> LikeRelease:
        """The release in ``folder``; UsageError naming its config.json where that says no quantization."""
        from dcptool import formats
        from dcptool.selection import read_config

        config = read_config(folder)
        quantization = config.get("quantization_config")
        if not isinstance(quantization, dict) or not isinstance(quantization.get("quant_method"), str):
            raise UsageError(f"{folder}/config.json has no quantization_config with a quant_method: "
                             f"{option('quantize', 'like=' + folder)} takes the quantization of a quantized release")
        try:
            checkpoint = formats.open_checkpoint(folder)
        except (CheckpointError, FileNotFoundError):
            checkpoint = None  # a config folder without the weights: its quantization_config alone
        return cls(folder, quantization, checkpoint)

    def fp8_weights(self, suffix: str) -> dict[str, TensorInfo] | None:
        """The release's float8 weights with a ``suffix`` scale, by name, and their scales; None without its weights."""
        if self.checkpoint is None:
            return None
        return {key: scale for key, scale in _scale_pairs(self.checkpoint, suffix).items()
                if self.checkpoint.tensors[key].dtype == FP8}

    def not_converted(self, name: str) -> bool:
        """Whether the module of weight ``name`` is one the release's ``modules_to_not_convert`` (or ``ignored_layers``)
        names, matched as transformers matches them: from the start to a module boundary, as a regular expression
        to one, or as a suffix."""
        patterns = self.quantization.get("modules_to_not_convert") or self.quantization.get("ignored_layers") or []
        module = name.removesuffix(".weight")
        return any(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(pattern)
                   for pattern in patterns if isinstance(pattern, str))


def _module_weight(tensor: OutTensor) -> bool:
    """Whether a tensor left unquantized is the float weight of a module a loader could quantize (a matrix):
    what ``modules_to_not_convert`` names."""
    return tensor.key.endswith(".weight") and len(tensor.shape) >= 2 and tensor.dtype in (*dtypes.CASTABLE, "float64")


def quantized_fp8(tensors: list[OutTensor], blocks: Fp8Blocks, config: dict | None, where: str,
                  like: LikeRelease | None = None, layout: str = "native") -> tuple[list[OutTensor], dict, list[str]]:
    """The export's tensors with every linear weight of the decoder layers (``models.linear_weight``) as its
    ``float8_e4m3fn`` codes followed by its float32 scales (``X_scale_inv``; compressed-tensors' ``layout``:
    ``X_scale``), computed from the weight as stored; the ``quantization_config`` that says so, and notes. The
    other tensors stay as they are. ``like``: the weights the release quantized instead (those it holds; for
    others, ``linear_weight`` less its ``modules_to_not_convert``), each block its scale still holds keeping it
    (``Release``), and the release's ``quantization_config``."""
    from dcptool import models

    suffix = COMPRESSED_SCALE_SUFFIX if layout == "compressed-tensors" else SCALE_SUFFIX
    released = like.fp8_weights(suffix) if like is not None else None
    out, quantized, kept, notes = [], [], [], []
    for tensor in tensors:
        if released is not None and like.checkpoint is not None and tensor.key in like.checkpoint.tensors:
            chosen = tensor.key in released
        else:
            chosen = models.linear_weight(tensor.key, tensor.shape) and not (like and like.not_converted(tensor.key))
        if not chosen:
            out.append(tensor)
            if _module_weight(tensor):
                kept.append(tensor.key.removesuffix(".weight"))
            continue
        source = tensor.source
        if source.dtype not in (*dtypes.CASTABLE, "float64"):
            raise UsageError(f"{where}: {tensor.key} is {source.dtype}: quantizing takes float weights (dequantize a "
                             f"quantized source first with {option('dequantize', True)})")
        if len(tensor.shape) != 2:  # transformers 5.24 would load the codes of fused experts as their values
            raise UsageError(f"{where}: {tensor.key} {list(tensor.shape)} holds fused experts: FP8 releases store them "
                             f"one by one, as vLLM, SGLang and transformers read them: drop {option('hf_experts', 'fused')}")
        scale_shape = (*tensor.shape[:-2], *(-(-n // b) for n, b in zip(tensor.shape[-2:], blocks.block)))
        release = None
        if released is not None and tensor.key in released:
            scale = released[tensor.key]
            if like.checkpoint.tensors[tensor.key].shape == tensor.shape and scale.shape == scale_shape:
                release = Release(like.checkpoint, scale)
            else:
                notes.append(f"{tensor.key} {list(tensor.shape)} is {list(like.checkpoint.tensors[tensor.key].shape)} "
                             f"in {like.folder}: quantized afresh")
        cache = ScaleCache(math.prod(scale_shape))
        codes = TensorInfo(source.path, FP8, tensor.shape, source.chunks, Fp8Codes(source, blocks, release, cache))
        scale_key = tensor.key + suffix
        whole = [dataclasses.replace(source.chunks[0], offsets=(0,) * len(scale_shape), sizes=scale_shape,
                                     strides=None, view=None)] if len(source.chunks) else []
        scales = TensorInfo((scale_key,), "float32", scale_shape, whole, Fp8Scales(source, blocks, release, cache))
        out += [OutTensor(tensor.key, tensor.path, FP8, tensor.shape, codes),
                OutTensor(scale_key, (scale_key,), "float32", scale_shape, scales)]
        quantized.append(tensor.key)
    if not quantized:
        raise UsageError(f"{where}: {option('quantize', like and 'like=' + like.folder or 'fp8')} found no linear "
                         "weight of a decoder layer (model.layers.N...weight) to quantize")
    scale = "powers of two (ue8m0)" if blocks.scale_format == "ue8m0" else "float32"
    notes.insert(0, f"quantized {len(quantized)} linear weights to {FP8} with {scale} {suffix} scales per "
                    f"{blocks.block[0]}x{blocks.block[1]} block: {quantized[0]}, ...")
    if like is not None:
        notes.append(f"quantized as {like.folder} is (its quantization_config); blocks its scales still hold "
                     "exactly keep them")
        return out, like.quantization, notes
    not_converted = sorted(set(kept) | {name.removesuffix(".weight") for name in models.tied_outputs(config)})
    if layout == "compressed-tensors":
        notes.append(f"kept {len(not_converted)} modules unquantized (quantization_config.ignore)")
        return out, compressed_tensors_config(blocks.block, not_converted), notes
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(blocks.block),
                    **({"scale_fmt": "ue8m0"} if blocks.scale_format == "ue8m0" else {}),
                    "modules_to_not_convert": not_converted}
    notes.append(f"kept {len(not_converted)} modules unquantized (quantization_config.modules_to_not_convert)")
    return out, quantization, notes


# What compressed-tensors 0.20 writes (ModelCompressor.update_config) around its quantization config.
COMPRESSED_TENSORS_VERSION = "0.20.0"


def compressed_tensors_config(block: tuple[int, int], ignore: list[str]) -> dict:
    """compressed-tensors' ``quantization_config`` of FP8 blocks, as llm-compressor writes its ``FP8_BLOCK`` scheme
    and vLLM's compressed-tensors loader reads it: one group targeting every Linear, its weights float8 symmetric and
    static per ``block``, its activations quantized dynamically per group of ``block[1]``; ``ignore``: the modules
    left out (by name)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block",
               "block_structure": list(block), "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": block[1], "strategy": "group",
                   "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None,
             "format": None}
    return {"config_groups": {"group_0": group}, "format": "float-quantized", "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
            "version": COMPRESSED_TENSORS_VERSION}


@dataclass(frozen=True)
class Mxfp4Encoded(Computed):
    """``X_blocks`` (uint8 ``[experts, rows, blocks, 16]``) or ``X_scales`` (uint8 ``[experts, rows, blocks]``) of an
    expert tensor ``X`` laid out as transformers' GPT-OSS holds it, ``[experts, columns, rows]`` (``Mxfp4Dequant``'s
    inverse): each expert's matrix transposed, its rows in blocks of 32 (``mxfp4.encode``). ``release``: the
    release's ``X_scales``; a block its scale still holds exactly keeps it (``Release``)."""

    weight: TensorInfo
    part: str  # "blocks" or "scales"
    release: tuple[Checkpoint, TensorInfo] | None = None

    @property
    def work_bytes(self) -> int:
        """Per element of the output, the temporaries of the weight's elements it is made of (2 a byte, 32 a scale):
        their float32 values, magnitudes, scaled values, keys and codes, about 20 bytes each."""
        return 20 * (mxfp4.ELEMENTS_PER_SCALE if self.part == "scales" else 2)

    def others(self) -> tuple[Checkpoint, ...]:
        return (self.release[0],) if self.release is not None else ()

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (uint8, shape ``sizes``) with the region at ``offsets``: the whole blocks it touches encoded
        from the weight's columns ``32 * block ...`` of its rows."""
        (expert, row, block), (experts, rows, blocks) = offsets[:3], sizes[:3]
        if 0 in sizes:
            return
        width = mxfp4.ELEMENTS_PER_SCALE
        shape = (experts, blocks * width, rows)
        values = float32_region(checkpoint, self.weight, (expert, block * width, row), shape, scratch,
                                workspace("mxfp4.values", shape, np.float32))
        # [experts, rows, blocks, 32]: each expert's matrix transposed, as a view (the encoding copies it once)
        groups = values.transpose(0, 2, 1).reshape(experts, rows, blocks, width)
        work = (workspace("mxfp4.scaled", groups.shape, np.float32), workspace("mxfp4.keys", groups.shape, np.uint32),
                workspace("mxfp4.codes", groups.shape, np.uint8))
        exponents = mxfp4.block_exponents(groups, work[1])
        if self.release is not None:
            release, scales = self.release
            given = np.empty((experts, rows, blocks), np.uint8)
            release.read_region(scales, (expert, row, block), given.shape, given, scratch, passing=True)
            given = given.astype(np.int32) - mxfp4.SCALE_BIAS
            exponents = np.where(_mxfp4_holds(groups, given, self.weight.dtype), given, exponents)
        if self.part == "scales":
            out[...] = exponents + mxfp4.SCALE_BIAS
            return
        packed = workspace("mxfp4.packed", (experts, rows, blocks, mxfp4.BYTES_PER_SCALE), np.uint8)
        mxfp4.encode(groups, packed, np.empty((experts, rows, blocks), np.uint8), exponents, work)
        out[...] = packed[..., offsets[3]:offsets[3] + sizes[3]]


def _mxfp4_holds(groups: np.ndarray, exponents: np.ndarray, dtype: str) -> np.ndarray:
    """Per block of 32 float32 values (of a tensor stored as ``dtype``): whether the scale ``2 ** exponent`` holds
    it exactly, every value the decoding of its code under that scale, rounded to ``dtype`` as a dequantization
    rounds it."""
    packed = np.empty((*groups.shape[:-1], mxfp4.BYTES_PER_SCALE), np.uint8)
    scales = np.empty(groups.shape[:-1], np.uint8)
    mxfp4.encode(groups, packed, scales, exponents)
    bits = np.empty((*groups.shape[:-1], mxfp4.ELEMENTS_PER_SCALE), np.uint32)
    mxfp4.decode(packed, scales[..., None], "float32", bits)
    back = bits.view(np.float32)
    if dtype in dtypes.CASTABLE and dtype != "float32":
        back = dtypes.cast(dtypes.cast(bits, "float32", dtype), dtype, "float32").view(np.float32)
    return (back == groups).all(axis=-1)


def quantized_mxfp4(tensors: list[OutTensor], config: dict | None, where: str,
                    like: LikeRelease | None = None) -> tuple[list[OutTensor], dict, list[str]]:
    """The export's tensors with every routed-experts tensor (``mlp.experts.gate_up_proj``, ``down_proj``) as its
    ``X_blocks`` and ``X_scales`` (``Mxfp4Encoded``), the ``quantization_config`` that says so, and notes.
    ``like``: the release's tensors and scales (``Release``) and its ``quantization_config``."""
    from dcptool import models

    model_type = models.text_config(config).get("model_type")
    kind = models.kind_of(models.text_config(config))
    if kind is None or not kind.mxfp4_experts:
        takers = ", ".join(name for name, other in models.kinds().items() if other.mxfp4_experts)
        raise UsageError(f"{where}: {option('quantize', 'mxfp4')} lays out the experts of {takers} "
                         f"models, and the config says {model_type or 'no model_type'} (give the model's config folder "
                         f"with {option('config_dir')})")
    release = like.checkpoint if like is not None else None
    out, quantized, kept = [], [], []
    for tensor in tensors:
        if not (len(tensor.shape) == 3 and models.linear_weight(tensor.key, tensor.shape)):
            out.append(tensor)
            if _module_weight(tensor):
                kept.append(tensor.key.removesuffix(".weight"))
            continue
        source = tensor.source
        experts, columns, rows = tensor.shape
        if source.dtype not in (*dtypes.CASTABLE, "float64") or columns % mxfp4.ELEMENTS_PER_SCALE:
            raise UsageError(f"{where}: {tensor.key} is {source.dtype}{list(tensor.shape)}: MXFP4 takes float experts "
                             f"whose rows ({columns}) are whole blocks of {mxfp4.ELEMENTS_PER_SCALE}")
        blocks = columns // mxfp4.ELEMENTS_PER_SCALE
        given = None
        scales_key = tensor.key + SCALES_SUFFIX
        if release is not None and scales_key in release.tensors:
            if release.tensors[scales_key].shape == (experts, rows, blocks):
                given = (release, release.tensors[scales_key])
        for suffix, shape, part in ((BLOCKS_SUFFIX, (experts, rows, blocks, mxfp4.BYTES_PER_SCALE), "blocks"),
                                    (SCALES_SUFFIX, (experts, rows, blocks), "scales")):
            key = tensor.key + suffix
            whole = [dataclasses.replace(source.chunks[0], offsets=(0,) * len(shape), sizes=shape, strides=None,
                                         view=None)] if len(source.chunks) else []
            out.append(OutTensor(key, (key,), "uint8", shape,
                                 TensorInfo((key,), "uint8", shape, whole, Mxfp4Encoded(source, part, given))))
        quantized.append(tensor.key)
    if not quantized:
        raise UsageError(f"{where}: {option('quantize', 'mxfp4')} found no routed experts (mlp.experts.gate_up_proj, "
                         "down_proj) to quantize")
    notes = [f"quantized {len(quantized)} expert tensors to MXFP4 ({BLOCKS_SUFFIX} and {SCALES_SUFFIX}, "
             f"{mxfp4.ELEMENTS_PER_SCALE} elements a scale): {quantized[0]}, ..."]
    if like is not None:
        notes.append(f"quantized as {like.folder} is (its quantization_config); blocks its scales still hold "
                     "exactly keep them")
        return out, like.quantization, notes
    not_converted = sorted(set(kept) | {name.removesuffix(".weight") for name in models.tied_outputs(config)})
    notes.append(f"kept {len(not_converted)} modules unquantized (quantization_config.modules_to_not_convert)")
    return out, {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}, notes


SCHEMES = ("fp8", "mxfp4")
LAYOUTS = ("native", "compressed-tensors")


def quantized(tensors: list[OutTensor], quantize: Quantize, config: dict | None,
              where: str) -> tuple[list[OutTensor], dict | None, list[str]]:
    """export-hf's tensors quantized as ``quantize`` asks, the config.json that says so (its ``quantization_config``),
    and notes."""
    folder = quantize.like()
    if folder is None and quantize.scheme not in SCHEMES:
        raise UsageError(f"{option('quantize', quantize.scheme)}: choose {', '.join(SCHEMES)} or like=DIR (a released "
                         "model folder)")
    if quantize.layout is not None and quantize.layout not in LAYOUTS:
        raise UsageError(f"{option('quant_format', quantize.layout)}: choose {' or '.join(LAYOUTS)}")
    if quantize.scale_format is not None and quantize.scale_format not in SCALE_FORMATS:
        raise UsageError(f"{option('scale_format', quantize.scale_format)}: choose {' or '.join(SCALE_FORMATS)}")
    if folder is not None:
        given = [option(key) for key, value in (("block_size", quantize.block_size),
                                                ("scale_format", quantize.scale_format),
                                                ("quant_format", quantize.layout)) if value is not None]
        if given:
            raise UsageError(f"{option('quantize', quantize.scheme)} takes the quantization of {folder}: drop "
                             f"{' and '.join(given)}")
        like = LikeRelease.read(folder)
        method = like.quantization["quant_method"]
        if method not in ("fp8", "compressed-tensors", "mxfp4"):
            raise UsageError(f"{folder}/config.json: quant_method {method!r}: {option('quantize', 'like=DIR')} takes "
                             "block-scaled FP8 releases (fp8, compressed-tensors) and MXFP4 ones (mxfp4)")
        if method == "mxfp4":
            tensors, quantization, notes = quantized_mxfp4(tensors, config, where, like)
            return _with_quantization(tensors, config, quantization, notes)
        suffix, block = fp8_layout({"quantization_config": like.quantization}, f"{folder}/config.json")
        blocks = Fp8Blocks(block, "ue8m0" if like.quantization.get("scale_fmt") == "ue8m0" else "float")
        layout = "compressed-tensors" if suffix == COMPRESSED_SCALE_SUFFIX else "native"
        tensors, quantization, notes = quantized_fp8(tensors, blocks, config, where, like, layout)
    elif quantize.scheme == "mxfp4":
        given = [option(key) for key, value in (("block_size", quantize.block_size),
                                                ("scale_format", quantize.scale_format),
                                                ("quant_format", quantize.layout)) if value is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} go with {option('quantize', 'fp8')}: MXFP4's blocks and scales "
                             "are the format's")
        tensors, quantization, notes = quantized_mxfp4(tensors, config, where)
    else:
        if quantize.layout == "compressed-tensors" and quantize.scale_format == "ue8m0":
            raise UsageError(f"{option('scale_format', 'ue8m0')}: compressed-tensors' FP8 blocks have float scales "
                             f"(drop it, or {option('quant_format', 'compressed-tensors')})")
        blocks = Fp8Blocks(quantize.block() or (128, 128), quantize.scale_format or "float")
        tensors, quantization, notes = quantized_fp8(tensors, blocks, config, where, layout=quantize.layout or "native")
    return _with_quantization(tensors, config, quantization, notes)


def _with_quantization(tensors, config: dict | None, quantization: dict, notes: list[str]):
    if config is None:
        notes.append("warning: no config.json, so no quantization_config says how the weights are quantized")
        return tensors, None, notes
    return tensors, config | {"quantization_config": quantization}, notes


# ---------------------------------------------------------------------------------------------------------
# A quantized checkpoint compared with its source (verify, diff)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Stored(Computed):
    """A block-scaled float8 weight as stored, its codes, with the scales that go with them (``folded``): what
    verify quantizes the other side with, and diff dequantizes (``dequantized_view``)."""

    weight: TensorInfo
    scale: TensorInfo
    block: tuple[int, int]
    work_bytes = 0

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """The codes, as stored."""
        checkpoint.read_region(self.weight, offsets, sizes, out, scratch)

    def scales_for(self, checkpoint: Checkpoint, offsets, sizes, scratch) -> np.ndarray:
        """The float32 scale of every element of the region at ``offsets`` (``sizes``), from the scale tensor."""
        (b0, b1), lead = self.block, len(sizes) - 2
        rows = (offsets[lead] + np.arange(sizes[lead])) // b0
        cols = (offsets[lead + 1] + np.arange(sizes[lead + 1])) // b1
        at = (*offsets[:lead], int(rows[0]) if len(rows) else 0, int(cols[0]) if len(cols) else 0)
        shape = (*sizes[:lead], int(rows[-1] - rows[0] + 1) if len(rows) else 0,
                 int(cols[-1] - cols[0] + 1) if len(cols) else 0)
        itemsize = dtypes.dtype(self.scale.dtype).itemsize
        raw = np.empty(shape, dtypes.raw_view_type(itemsize))
        checkpoint.read_region(self.scale, at, shape, raw, scratch)
        scales = dtypes.cast(raw, self.scale.dtype, "float32").view(np.float32) if self.scale.dtype != "float32" \
            else raw.view(np.float32)
        return scales[..., rows - at[lead], :][..., cols - at[lead + 1]]

    def dequantized_view(self) -> TensorInfo:
        """The weight's values, codes times scales, as float32 (``BlockDequant``)."""
        return TensorInfo(self.weight.path, "float32", self.weight.shape, self.weight.chunks,
                          BlockDequant(self.weight, self.scale, self.block, "float32"))


@dataclass(frozen=True)
class Mxfp4Stored(Computed):
    """MXFP4 experts as stored (``X_blocks`` and ``X_scales``) folded into one tensor ``X`` (``folded``): its values,
    float32, as ``Mxfp4Dequant`` gives them; and each element's scale exponent, which verify quantizes the other
    side with."""

    blocks: TensorInfo
    scales: TensorInfo
    work_bytes = Mxfp4Dequant.work_bytes

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        Mxfp4Dequant(self.blocks, self.scales, "float32").read(checkpoint, offsets, sizes, out, scratch)

    def exponents_for(self, checkpoint: Checkpoint, offsets, sizes, scratch) -> np.ndarray:
        """The scale exponent of every element of the region at ``offsets`` of ``X`` ([experts, columns, rows])."""
        (expert, column, row), (experts, columns, rows) = offsets, sizes
        width = mxfp4.ELEMENTS_PER_SCALE
        first, end = column // width, -(-(column + columns) // width)
        scales = np.empty((experts, rows, end - first), np.uint8)
        checkpoint.read_region(self.scales, (expert, row, first), scales.shape, scales, scratch)
        per_column = scales[:, :, (column + np.arange(columns)) // width - first]  # [experts, rows, columns]
        return per_column.transpose(0, 2, 1).astype(np.int32) - mxfp4.SCALE_BIAS

    def dequantized_view(self) -> TensorInfo:
        """Its values, float32 (what it reads)."""
        path = self.blocks.path[:-1] + (str(self.blocks.path[-1]).removesuffix(BLOCKS_SUFFIX),)
        experts, rows, blocks, _ = self.blocks.shape
        return TensorInfo(path, "float32", (experts, blocks * mxfp4.ELEMENTS_PER_SCALE, rows),
                          _transposed_chunks(self.blocks), Mxfp4Dequant(self.blocks, self.scales, "float32"))


def folded(checkpoint: Checkpoint) -> tuple[Checkpoint, list[str]]:
    """The checkpoint with each block-scaled float8 weight and its scales as one tensor ``X`` whose transform is an
    ``Fp8Stored`` (read: the codes; where a config.json beside it gives the block size), and each pair of MXFP4
    ``X_blocks`` and ``X_scales`` as ``X`` of float32 values (``Mxfp4Stored``); and notes. As it is where it holds
    neither."""
    checkpoint, notes = _fp8_folded(checkpoint)
    pairs = {key: key.removesuffix(BLOCKS_SUFFIX) for key, t in checkpoint.tensors.items()
             if key.endswith(BLOCKS_SUFFIX) and t.dtype == "uint8" and len(t.shape) == 4
             and t.shape[3] == mxfp4.BYTES_PER_SCALE
             and getattr(checkpoint.tensors.get(key.removesuffix(BLOCKS_SUFFIX) + SCALES_SUFFIX), "shape", None)
             == t.shape[:3] and key.removesuffix(BLOCKS_SUFFIX) not in checkpoint.tensors}
    if not pairs:
        return checkpoint, notes
    tensors = {}
    for key, tensor in checkpoint.tensors.items():
        if key in pairs:
            stored = Mxfp4Stored(tensor, checkpoint.tensors[pairs[key] + SCALES_SUFFIX])
            tensors[pairs[key]] = dataclasses.replace(stored.dequantized_view(), transform=stored)
        elif not (key.endswith(SCALES_SUFFIX) and key.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX in pairs):
            tensors[key] = tensor
    notes.append(f"{len(pairs)} MXFP4 tensors of {checkpoint.root} compared as their values")
    return checkpoint.with_entries(tensors, dict(checkpoint.objects)), notes


def _fp8_folded(checkpoint: Checkpoint) -> tuple[Checkpoint, list[str]]:
    config_dir = checkpoint.info.get("hf_config_dir")
    if config_dir is None or not (_scale_pairs(checkpoint, SCALE_SUFFIX)
                                  or _scale_pairs(checkpoint, COMPRESSED_SCALE_SUFFIX)):
        return checkpoint, []
    from dcptool.selection import read_config

    try:
        suffix, block = fp8_layout(read_config(config_dir), f"{config_dir}/config.json")
    except UsageError:
        return checkpoint, []
    pairs = {key: scale for key, scale in _scale_pairs(checkpoint, suffix).items()
             if checkpoint.tensors[key].dtype == FP8 and scale.dtype in dtypes.CASTABLE}
    tensors = {key: t for key, t in checkpoint.tensors.items() if not (key.endswith(suffix)
                                                                          and key.removesuffix(suffix) in pairs)}
    for key, scale in pairs.items():
        weight = tensors[key]
        tensors[key] = dataclasses.replace(weight, transform=Fp8Stored(weight, scale, block))
    note = (f"{len(pairs)} float8 weights of {checkpoint.root} compared with their {suffix} scales "
            f"({block[0]}x{block[1]} blocks)")
    return checkpoint.with_entries(tensors, dict(checkpoint.objects)), [note]


def mxfp4_error(values: np.ndarray, stored: np.ndarray, exponents: np.ndarray) -> tuple[np.ndarray, float, float,
                                                                                          float]:
    """Float32 ``values`` quantized to MXFP4 with the scale exponents ``exponents`` (per element) against the
    ``stored`` float32 values: (those quantized values, the largest ``|value - stored|``, the sums of squares of
    those errors and of the values, float64)."""
    expected = mxfp4.rounded(values, exponents)
    error = values.astype(np.float64) - stored
    with np.errstate(invalid="ignore"):
        largest = float(np.abs(error).max()) if error.size else 0.0
    return expected, largest, float(np.square(error).sum()), float(np.square(values.astype(np.float64)).sum())


def fp8_error(values: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, float, float, float]:
    """Float32 ``values`` quantized with ``scales`` (the codes they give, as ``Fp8Codes`` computes them) against the
    stored ``codes``: (the codes they give, the largest ``|value - code * scale|``, the sums of squares of those
    errors and of the values, float64)."""
    expected = np.empty(values.shape, np.uint8)
    with np.errstate(divide="ignore", invalid="ignore"):
        dtypes.float32_to_float8(values / scales, FP8, expected)
    dequantized = dtypes.float8_to_float32(codes, FP8) * scales  # in float32, as transformers dequantizes
    error = values.astype(np.float64) - dequantized
    with np.errstate(invalid="ignore"):
        largest = float(np.abs(error).max()) if error.size else 0.0
    return expected, largest, float(np.square(error).sum()), float(np.square(values.astype(np.float64)).sum())
