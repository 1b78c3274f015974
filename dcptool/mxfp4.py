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

Encoding (``encode``) follows the specification's conversion (section 6.3): a block's scale is
``2 ** (floor(log2(amax)) - 2)`` (2 is E2M1's largest exponent: 6 = 1.5 * 2 ** 2; ``-127`` for a block of zeros),
each element divided by it and rounded to the nearest E2M1 value, ties to the even code, magnitudes past 6
saturating to 6, the sign kept (a negative element that rounds to zero is -0, code 8).

Which tensors are so stored, and how GPT-OSS lays its dequantized experts out, is ``dcptool.planning.quant``'s.
Kept free of torch so that the light install reads and writes MXFP4 too.

>>> bits = np.empty(4, np.uint32)
>>> decode(np.array([0x21, 0xF7], np.uint8), np.array(128, np.uint8), "float32", bits); bits.view(np.float32).tolist()
[1.0, 2.0, 12.0, -12.0]
>>> packed, scales = np.empty((1, 16), np.uint8), np.empty(1, np.uint8)
>>> encode(np.array([1.0, 2.0, 12.0, -12.0] + [0.0] * 28, np.float32), packed, scales)
>>> packed[0, :2].tolist(), scales.tolist()
([33, 247], [128])
"""

from __future__ import annotations

from functools import cache

import numpy as np

from dcptool import dtypes

ELEMENTS_PER_SCALE = 32
BYTES_PER_SCALE = ELEMENTS_PER_SCALE // 2
SCALE_BIAS = 127  # E8M0: the scale byte s stands for 2 ** (s - 127)
LARGEST_EXPONENT = 2  # E2M1's: its largest value is 1.5 * 2 ** 2
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


def encode(values: np.ndarray, packed: np.ndarray, scales: np.ndarray, exponents: np.ndarray | None = None,
           work: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> None:
    """Write float32 ``values`` (``[..., 32 * blocks]``, or already ``[..., blocks, 32]``; any strides) as MXFP4:
    ``packed`` (uint8 ``[..., blocks, 16]``, two codes a byte) and ``scales`` (uint8 ``[..., blocks]``).
    ``exponents`` (int, ``[..., blocks]``): each block's scale exponent as given (a release's,
    ``dcptool.planning.quant``) instead of the specification's from its amax. ``work``: float32, uint32 and uint8
    arrays of the values' shape ``[..., blocks, 32]`` for the temporaries instead of fresh ones (``core.Computed``
    reuses its buffers)."""
    groups = _groups(values)
    scaled, keys, codes = work if work is not None else (np.empty(groups.shape, np.float32),
                                                         np.empty(groups.shape, np.uint32),
                                                         np.empty(groups.shape, np.uint8))
    if exponents is None:
        exponents = block_exponents(groups, keys)
    np.take(_e2m1_codes(), _keys(_scaled(groups, exponents, scaled), keys), out=codes, mode="clip")
    high = np.left_shift(codes[..., 1::2], 4, out=codes[..., 1::2])
    np.bitwise_or(codes[..., 0::2], high, out=packed.reshape(high.shape))
    scales[...] = exponents + SCALE_BIAS


def rounded(values: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """Float32 ``values``, each rounded to the E2M1 value times ``2 ** exponent`` (its block's, per element) that
    ``encode`` would store, as float32 values."""
    scaled = values * np.ldexp(np.float32(1), -exponents.astype(np.int32)).astype(np.float32)
    return np.ldexp(E2M1[np.take(_e2m1_codes(), _keys(scaled))], exponents.astype(np.int32)).astype(np.float32)


def block_exponents(groups: np.ndarray, work: np.ndarray | None = None) -> np.ndarray:
    """The specification's scale exponent of each block of 32 float32 values (``[..., blocks, 32]``, or the values
    ``[..., 32 * blocks]``): ``floor(log2(amax)) - 2``, within [-127, 127]; -127 for a block of zeros, 128 (the scale
    byte 255, NaN) for one holding a NaN. ``work``: a uint32 array of the blocks' shape, for the magnitudes."""
    # |x| as its bits (ordered as the values are, NaN above Inf), each 32's maximum by reduceat: numpy's reductions
    # over an axis of 32 cost several times as much
    groups = _groups(groups)
    magnitudes = np.bitwise_and(groups.view(np.uint32), np.uint32(0x7FFFFFFF), out=work).reshape(-1)  # contiguous
    starts = np.arange(0, magnitudes.size, ELEMENTS_PER_SCALE)
    amax = (np.maximum.reduceat(magnitudes, starts) if magnitudes.size else magnitudes).view(np.float32)
    amax = amax.reshape(groups.shape[:-1])
    _, exponent = np.frexp(amax)  # amax = m * 2 ** exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    exponents = np.clip(exponent.astype(np.int32) - 1 - LARGEST_EXPONENT, -SCALE_BIAS, SCALE_BIAS)
    exponents[amax == 0] = -SCALE_BIAS
    exponents[np.isnan(amax)] = 255 - SCALE_BIAS
    return exponents


def _groups(values: np.ndarray) -> np.ndarray:
    """``values`` as ``[..., blocks, 32]`` (a view where their strides allow)."""
    if values.shape[-1] == ELEMENTS_PER_SCALE and values.ndim >= 2:
        return values
    return values.reshape(*values.shape[:-1], -1, ELEMENTS_PER_SCALE)


def _scaled(groups: np.ndarray, exponents: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Each block over ``2 ** exponent``, contiguous: a product with a power of two, exact as ``ldexp``."""
    factors = np.ldexp(np.float32(1), -exponents.astype(np.int32)).astype(np.float32)
    return np.multiply(groups, factors[..., None], out=out, dtype=np.float32)


def _keys(scaled: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The look-up keys of float32 values: their top 16 bits, the lowest set where any bit below them is."""
    bits = scaled.view(np.uint32)
    keys = np.bitwise_and(bits, np.uint32(0xFFFF), out=out)
    keys += np.uint32(0xFFFF)  # carries into bit 16 when any of the low 16 bits is set
    keys |= bits
    keys >>= 16
    return keys


@cache
def _e2m1_codes() -> np.ndarray:
    """The E2M1 code (sign in bit 3) of every float32 whose low 16 bits are zero, by its top 16 bits: the nearest
    E2M1 value, ties to the even code, past 6 (Inf, NaN too) 6. Rounding to E2M1 drops at least 21 bits, so the
    bits below the top 16 matter only as whether any is set (``encode`` folds them into bit 16)."""
    top = np.arange(65536, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        magnitude = np.abs((top << 16).view(np.float32).astype(np.float64))
    distance = np.abs(np.minimum(magnitude, 6.0)[:, None] - E2M1[:8].astype(np.float64))
    nearest = distance == distance.min(axis=1, keepdims=True)
    even = np.where(nearest & (np.arange(8) % 2 == 0), np.arange(8), 8).min(axis=1)
    codes = np.where(even < 8, even, np.argmax(nearest, axis=1))  # a tie: the even code; else the one nearest
    codes[np.isnan(magnitude)] = 7
    codes = (codes | ((top >> 15) << 3)).astype(np.uint8)
    codes.flags.writeable = False
    return codes
