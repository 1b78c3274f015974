"""dtype names as torch spells them (without ``torch.``), with item sizes and the other names they go by.

Kept free of torch so that commands which only move bytes never import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from dcptool.errors import CheckpointError


@dataclass(frozen=True)
class DType:
    name: str  # torch's name: "bfloat16"
    itemsize: int
    # Legacy typed storage class that torch.save pickles ("BFloat16Storage"); None where torch has none
    # (float8, uint16...): torch.save then pickles an UntypedStorage of bytes and the dtype beside it.
    storage_class: str | None
    safetensors: str  # safetensors header name: "BF16"
    numpy: str | None  # numpy dtype with the same bits, None when numpy has no such type


_TABLE = [
    DType("float64", 8, "DoubleStorage", "F64", "float64"),
    DType("float32", 4, "FloatStorage", "F32", "float32"),
    DType("float16", 2, "HalfStorage", "F16", "float16"),
    DType("bfloat16", 2, "BFloat16Storage", "BF16", None),
    DType("int64", 8, "LongStorage", "I64", "int64"),
    DType("int32", 4, "IntStorage", "I32", "int32"),
    DType("int16", 2, "ShortStorage", "I16", "int16"),
    DType("int8", 1, "CharStorage", "I8", "int8"),
    DType("uint8", 1, "ByteStorage", "U8", "uint8"),
    DType("bool", 1, "BoolStorage", "BOOL", "bool"),
    DType("uint16", 2, None, "U16", "uint16"),
    DType("uint32", 4, None, "U32", "uint32"),
    DType("uint64", 8, None, "U64", "uint64"),
    DType("complex64", 8, "ComplexFloatStorage", "C64", "complex64"),
    # The float8 types torch has, under safetensors' names (F8_E8M0: the MX block-scale type).
    DType("float8_e4m3fn", 1, None, "F8_E4M3", None),
    DType("float8_e5m2", 1, None, "F8_E5M2", None),
    DType("float8_e4m3fnuz", 1, None, "F8_E4M3FNUZ", None),
    DType("float8_e5m2fnuz", 1, None, "F8_E5M2FNUZ", None),
    DType("float8_e8m0fnu", 1, None, "F8_E8M0", None),
]

BY_NAME = {d.name: d for d in _TABLE}
BY_STORAGE_CLASS = {d.storage_class: d for d in _TABLE if d.storage_class}
BY_SAFETENSORS = {d.safetensors: d for d in _TABLE}

# torch spells some dtypes two ways; checkpoints may carry either.
_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32", "short": "int16"}

CASTABLE = ("bfloat16", "float16", "float32")

# The float8 types decoded to float32: (exponent bits, mantissa bits, exponent bias, special values).
# "ieee": an all-ones exponent is Inf (zero mantissa) or NaN; "fn": no Inf, only S.1111.111 is NaN;
# "fnuz": no Inf and no -0, the pattern of -0 (0x80) is the one NaN.
FLOAT8 = {"float8_e4m3fn": (4, 3, 7, "fn"), "float8_e5m2": (5, 2, 15, "ieee"),
          "float8_e4m3fnuz": (4, 3, 8, "fnuz"), "float8_e5m2fnuz": (5, 2, 16, "fnuz")}


def dtype(name: str) -> DType:
    """Look up a dtype by torch name (``"bfloat16"``, ``"torch.float32"`` and aliases such as ``"half"``)."""
    name = name.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    try:
        return BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {name!r}") from None


def raw_view_type(itemsize: int) -> np.dtype:
    """An unsigned numpy type of the given width, for moving elements without interpreting them."""
    return np.dtype(f"u{itemsize}")


def cast(values: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Convert raw element bits (an unsigned view) from float dtype ``src`` to ``dst``, rounding as torch does.

    >>> bits = np.array([0x3F80], dtype=np.uint16)   # 1.0 in bfloat16
    >>> cast(bits, "bfloat16", "float32").view(np.float32)
    array([1.], dtype=float32)
    """
    if src == dst:
        return values
    if src not in CASTABLE or dst not in CASTABLE:
        raise CheckpointError(f"cannot convert {src} to {dst}: only {', '.join(CASTABLE)} are cast")
    # Work on a 1-d view: numpy turns results of 0-d arrays into scalars.
    as_f32 = _to_float32(values.reshape(-1), src)
    if dst == "float32":
        return as_f32.view(np.uint32).reshape(values.shape)
    result = np.empty(as_f32.shape, raw_view_type(dtype(dst).itemsize))
    from_float32(as_f32, dst, result)
    return result.reshape(values.shape)


def from_float32(values: np.ndarray, dst: str, out: np.ndarray, work: np.ndarray | None = None) -> None:
    """Write float32 ``values`` as the bits of ``dst`` (float64 or one of ``CASTABLE``) into ``out`` (an
    unsigned view of its item size, of the same shape), rounding as torch's ``.to(dst)`` does; for
    computations that reuse their buffers (``core.Computed``): ``work``, a uint32 array of the same shape,
    holds bfloat16's rounding instead of a fresh one.

    >>> out = np.empty(2, np.uint16)
    >>> from_float32(np.array([1.0, 1.00390625], np.float32), "bfloat16", out); [hex(b) for b in out]
    ['0x3f80', '0x3f80']
    """
    values, out = np.atleast_1d(values), np.atleast_1d(out)  # 0-d arrays as views of one element: no scalars
    work = None if work is None else np.atleast_1d(work)
    if dst == "float32":
        out[...] = values.view(np.uint32)
    elif dst == "float64":
        out.view(np.float64)[...] = values
    elif dst == "float16":
        with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
            out.view(np.float16)[...] = values
    elif dst == "bfloat16":
        _float32_to_bfloat16(values, out, work)
    else:
        raise CheckpointError(f"cannot convert float32 to {dst}: only float64, {', '.join(CASTABLE)} are cast")


def float8_to_float32(bits: np.ndarray, dtype: str) -> np.ndarray:
    """float8 elements (raw bits, ``uint8``) of ``dtype``, one of ``FLOAT8``, as float32 values of the
    same shape; exact, since every float8 value is a float32 one.

    >>> float8_to_float32(np.array([0x38, 0xC0, 0x01, 0x7E, 0x7F], dtype=np.uint8), "float8_e4m3fn").tolist()
    [1.0, -2.0, 0.001953125, 448.0, nan]
    >>> float8_to_float32(np.array([0x3C, 0x7B, 0xFC, 0x7D], dtype=np.uint8), "float8_e5m2").tolist()
    [1.0, 57344.0, -inf, nan]
    """
    return _float8_values(dtype)[bits]


@cache
def _float8_values(dtype: str) -> np.ndarray:
    """The float32 value of each of the 256 bit patterns of a float8 dtype (read-only: it is shared)."""
    exponent_bits, mantissa_bits, bias, special = FLOAT8[dtype]
    bits = np.arange(256)
    exponent, mantissa = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1), bits & ((1 << mantissa_bits) - 1)
    # A zero exponent field is subnormal: no implicit leading 1, and the exponent of the smallest normal.
    significand = np.where(exponent == 0, mantissa, mantissa + (1 << mantissa_bits))
    magnitude = np.ldexp(significand.astype(np.float64), np.maximum(exponent, 1) - bias - mantissa_bits)
    top = exponent == (1 << exponent_bits) - 1
    if special == "ieee":
        magnitude[top] = np.where(mantissa[top] == 0, np.inf, np.nan)
    elif special == "fn":
        magnitude[top & (mantissa == (1 << mantissa_bits) - 1)] = np.nan
    values = np.where(bits & 0x80, -magnitude, magnitude)  # NaN too takes the pattern's sign, as torch's do
    if special == "fnuz":
        values[0x80] = np.nan
    table = values.astype(np.float32)
    table.flags.writeable = False
    return table


def _to_float32(values: np.ndarray, src: str) -> np.ndarray:
    if src == "float32":
        return values.view(np.float32)
    if src == "float16":
        return values.view(np.float16).astype(np.float32)
    return (values.astype(np.uint32) << 16).view(np.float32)


def _float32_to_bfloat16(values: np.ndarray, out: np.ndarray, work: np.ndarray | None = None) -> None:
    # Round to nearest even on the dropped 16 bits, as torch does; torch's CPU kernels turn every NaN into 0xFFFF.
    # In place on one temporary: fresh arrays per slab cost more in page faults than the arithmetic.
    bits = values.view(np.uint32)
    rounded = np.right_shift(bits, 16, out=work)
    rounded &= 1
    rounded += np.uint32(0x7FFF)
    rounded += bits
    rounded >>= 16
    out[...] = rounded
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(values.sum(dtype=np.float32))  # NaN anywhere makes the sum NaN: one pass, no array
    if not finite:
        out[np.isnan(values)] = 0xFFFF


def to_float64(bits: np.ndarray, name: str) -> np.ndarray:
    """Elements (raw bits, an unsigned view) of dtype ``name`` as float64 numbers: floats exactly, integers and
    bool as their values, a type numpy lacks (``float8_e8m0fnu``) as its bits.

    >>> to_float64(np.array([0x3F80, 0xC000], dtype=np.uint16), "bfloat16")   # 1.0 and -2.0
    array([ 1., -2.])
    """
    if name == "float64":
        return bits.view(np.float64)
    if name in CASTABLE:
        return cast(bits, name, "float32").view(np.float32).astype(np.float64)
    if name in FLOAT8:
        return float8_to_float32(bits, name).astype(np.float64)
    kind = dtype(name).numpy
    return (bits if kind is None else bits.view(kind)).astype(np.float64)


def float32_to_float8(values: np.ndarray, dst: str, out: np.ndarray, work: np.ndarray | None = None) -> None:
    """Write float32 ``values`` as ``float8_e4m3fn`` bits into ``out`` (uint8, the same shape), rounding as torch's
    ``.to(torch.float8_e4m3fn)`` does (2.13): to nearest, ties to even; what rounds beyond 448, Inf too, saturates
    to 448, of the value's sign; NaN stays NaN. ``work``, a uint32 array of the same shape, holds the look-up keys
    instead of a fresh one.

    One look-up of the value's top 16 bits, with the bits below them folded into their lowest: every rounding
    of float32 to a float8 drops at least 20 bits, so whether any dropped bit below the top 16 is set is all
    it needs of them.

    >>> out = np.empty(5, np.uint8)
    >>> float32_to_float8(np.array([1.0, -2.0, 0.001953125, 448.0, 480.0], np.float32), "float8_e4m3fn", out)
    >>> [hex(b) for b in out]
    ['0x38', '0xc0', '0x1', '0x7e', '0x7e']
    """
    if dst != "float8_e4m3fn":
        raise CheckpointError(f"cannot convert float32 to {dst}: only float8_e4m3fn is encoded")
    bits = np.atleast_1d(values).view(np.uint32)
    keys = np.empty(bits.shape, np.uint32) if work is None else np.atleast_1d(work)
    np.bitwise_and(bits, 0xFFFF, out=keys)
    keys += 0xFFFF  # carries into bit 16 when any of the low 16 bits is set
    keys |= bits
    keys >>= 16
    np.take(_float8_codes(dst), keys, out=np.atleast_1d(out), mode="clip")  # every key is in the table


@cache
def _float8_codes(dtype: str) -> np.ndarray:
    """The float8 bits of every float32 whose low 16 bits are zero, by its top 16 bits, rounded to nearest even
    (read-only: it is shared). Worked out in float64, where each step is exact."""
    exponent_bits, mantissa_bits, bias, _ = FLOAT8[dtype]
    top = np.arange(65536, dtype=np.uint32)
    smallest_normal = 2.0 ** (1 - bias)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        magnitude = np.abs((top << 16).view(np.float32).astype(np.float64))
        # Subnormals: multiples of the smallest step; rint rounds half to even. Eight steps make the smallest normal.
        subnormal = np.rint(magnitude / 2.0 ** (1 - bias - mantissa_bits))
        mantissa, exponent = np.frexp(magnitude)  # magnitude = mantissa * 2 ** exponent, mantissa in [0.5, 1)
        steps = np.rint((2 * mantissa - 1) * 2 ** mantissa_bits)  # may round up to the next power of two
        normal = (exponent - 1 + bias) * 2 ** mantissa_bits + steps
    codes = np.where(magnitude < smallest_normal, subnormal, normal)
    # S.1111.110 is the largest (448), S.1111.111 NaN: torch saturates what rounds beyond the largest (Inf too).
    largest = 2 ** (exponent_bits + mantissa_bits) - 2
    codes = np.where(np.isnan(magnitude), largest + 1, np.minimum(codes, largest)).astype(np.uint8)
    codes |= ((top >> 15) << 7).astype(np.uint8)
    codes.flags.writeable = False
    return codes
