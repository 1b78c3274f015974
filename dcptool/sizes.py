"""Sizes given as a number of bytes or as text: ``--max-memory 256MiB``, ``--max-shard-size 5GB``.

The one parser of sizes, for the command line and the Python API alike. Decimal units are powers
of ten, as the Hugging Face hub counts (``5GB`` is 5,000,000,000 bytes); binary units are powers
of two (``256MiB`` is 268,435,456 bytes).
"""

from __future__ import annotations

import re

from dcptool.errors import UsageError, option

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?\s*(?P<unit>[A-Za-z]*)\s*")


def parse_size(value: int | str, name: str) -> int:
    """Bytes in ``value``: a number of bytes, or text such as ``"256MB"``, ``"5GB"``, ``"256MiB"``, ``"4096"``.

    Units are read in any case; a fraction of a unit is rounded down to whole bytes. ``name`` is the
    option the value came with (``"max_memory"``), named in the UsageError raised for anything else.

    >>> parse_size("5GB", "max_shard_size"), parse_size("256MiB", "max_memory"), parse_size(4096, "max_memory")
    (5000000000, 268435456, 4096)
    >>> parse_size("1.5kb", "max_memory")
    1500
    >>> parse_size("12XB", "max_memory")
    Traceback (most recent call last):
    ...
    dcptool.errors.UsageError: max_memory='12XB': not a size such as 256MB, 5GB or 256MiB
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    found = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = _UNITS.get(found["unit"].upper()) if found else None
    if unit is None or not (found["whole"] or found["fraction"]):
        raise UsageError(f"{option(name, value)}: not a size such as 256MB, 5GB or 256MiB")
    fraction = found["fraction"] or ""
    return int(found["whole"] or 0) * unit + int(fraction or 0) * unit // 10 ** len(fraction)


DEFAULT_MAX_MEMORY = 256 * 2**20  # the memory budget for data buffers when none is given (--max-memory)
MIN_MEMORY = 2**16  # the smallest --max-memory: a few buffers of a page-multiple size each


def check_memory_budget(max_memory: int) -> None:
    """Refuse a ``--max-memory`` budget too small to hold the buffers of a read.

    >>> check_memory_budget(1000)
    Traceback (most recent call last):
    ...
    dcptool.errors.UsageError: max_memory=1000 is too small (at least 64KB)
    """
    if max_memory < MIN_MEMORY:
        raise UsageError(f"{option('max_memory', max_memory)} is too small (at least 64KB)")
