"""MXFP4: the OCP Microscaling format with FP4 (E2M1) elements, as GPT-OSS's release stores its experts.

The format's facts, as the OCP MX specification v1.0 gives them and transformers reads them
(``transformers/integrations/mxfp4.py``):

- an element is a 4-bit E2M1 code: sign in bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (``E2M1``);
- two codes a byte, the first element of a pair in the low nibble;
- one scale a block of 32 elements (16 bytes), a uint8 E8M0 exponent: the block's values are the codes'
  times ``2 ** (scale - 127)``. transformers computes that as ``torch.ldexp``, exactly, then rounds once to
  its dtype; so does ``decode`` (the scale 255, NaN in the specification, is ``2 ** 128`` there too);
- ``X_blocks`` is uint8 ``[..., blocks, 16]`` and ``X_scales`` uint8 ``[..., blocks]``: the rows of the
  tensor, each ``32 * blocks`` elements long.

Which tensors are so stored, and how GPT-OSS lays its dequantized experts out, is ``dcptool.planning.quant``'s.
Kept free of torch so that the light install reads MXFP4 too.

>>> bits = np.empty(4, np.uint32)
>>> decode(np.array([0x21, 0xF7], np.uint8), np.array(128, np.uint8), "float32", bits); bits.view(np.float32).tolist()
[1.0, 2.0, 12.0, -12.0]
"""

from __future__ import annotations

from functools import cache

import numpy as np

from dcptool import dtypes

ELEMENTS_PER_SCALE = 32
BYTES_PER_SCALE = ELEMENTS_PER_SCALE // 2
SCALE_BIAS = 127  # E8M0: the scale byte s stands for 2 ** (s - 127)
# The value of each E2M1 code, as transformers' FP4_VALUES lists them: code 8 is -0.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def decode(packed: np.ndarray, scales: np.ndarray, dtype: str, out: np.ndarray, index: np.ndarray | None = None) -> None:
    """Write the values of the bytes ``packed`` (uint8, two codes each) as the bits of ``dtype`` (one of
    ``dtypes.CASTABLE``) into ``out``, an unsigned view of its item size with twice ``packed``'s last dim.
    ``scales`` (uint8) broadcasts against ``packed``: each byte's block scale (``[..., blocks, 1]`` against
    ``[..., blocks, 16]``). ``index``, a uint16 array of ``packed``'s shape, is used for the look-ups instead of a
    fresh one (``core.Computed`` reuses its buffers)."""
    index = np.empty(packed.shape, np.uint16) if index is None else index
    np.left_shift(scales, 8, out=index, dtype=np.uint16)
    index |= packed
    pairs = out.view(_pair_type(dtype)).reshape(packed.shape)
    np.take(_pair_table(dtype), index, out=pairs, mode="clip")  # every index is in the table: no checks, no buffer


@cache
def _values(dtype: str) -> np.ndarray:
    """The bits of ``dtype`` of every (scale, code), ``[256, 16]`` (read-only: it is shared)."""
    exponents = np.arange(256) - SCALE_BIAS
    with np.errstate(over="ignore"):  # beyond float32's range is inf, as torch's ldexp gives it
        exact = np.ldexp(E2M1[None, :], exponents[:, None].astype(np.int32)).astype(np.float32)
    table = np.empty(exact.shape, dtypes.raw_view_type(dtypes.dtype(dtype).itemsize))
    dtypes.from_float32(exact, dtype, table)  # exact in float32 (or inf): rounded once, to dtype
    table.flags.writeable = False
    return table


def _pair_type(dtype: str) -> np.dtype:
    return dtypes.raw_view_type(2 * dtypes.dtype(dtype).itemsize)


@cache
def _pair_table(dtype: str) -> np.ndarray:
    """The two values of every (scale, byte), as one element twice the dtype's width, at ``scale << 8 | byte``:
    decoding a byte is one look-up."""
    table = _values(dtype)
    scale, byte = np.divmod(np.arange(65536), 256)
    pairs = np.empty((65536, 2), table.dtype)
    pairs[:, 0], pairs[:, 1] = table[scale, byte & 0x0F], table[scale, byte >> 4]
    pairs = pairs.view(_pair_type(dtype)).reshape(65536)  # low nibble first in memory, whatever the byte order
    pairs.flags.writeable = False
    return pairs
