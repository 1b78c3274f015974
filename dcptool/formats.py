"""The registry of formats: each module of ``converters/`` is one format, found by listing the package."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType

import converters
from dcptool.core import Checkpoint
from dcptool.errors import CheckpointError


@cache
def all_formats() -> dict[str, ModuleType]:
    modules = {}
    for found in pkgutil.iter_modules(converters.__path__):
        module = importlib.import_module(f"converters.{found.name}")
        modules[module.NAME] = module
    return modules


def names() -> list[str]:
    return sorted(all_formats())


def get(name: str) -> ModuleType:
    try:
        return all_formats()[name]
    except KeyError:
        raise CheckpointError(f"unknown format {name!r} (known: {', '.join(names())})") from None


def detect(path: Path) -> str:
    """The format of what is at ``path``, judged from the files present."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    found = [name for name, module in all_formats().items() if module.detect(path)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(f"{path}: not a checkpoint dcptool recognizes (formats: {', '.join(names())})")
    raise CheckpointError(f"{path}: looks like several formats ({', '.join(found)}); choose one with --from")


def open_checkpoint(path: str | Path, format: str | None = None) -> Checkpoint:
    """Read the description of the checkpoint at ``path`` (format detected unless given).

    >>> ckpt = open_checkpoint("step-100")                     # doctest: +SKIP
    >>> ckpt.format, len(ckpt.tensors), ckpt.total_bytes       # doctest: +SKIP
    ('dcp', 291, 16060522496)
    """
    path = Path(path)
    name = format or detect(path)
    return get(name).read(path)
