"""The registry of formats: each module of ``converters/`` is one format, found by listing the package."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from pathlib import Path
from types import ModuleType

from dcptool import converters
from dcptool.core import Checkpoint
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles, stale_temporaries


@cache
def all_formats() -> dict[str, ModuleType]:
    modules = {}
    for found in pkgutil.iter_modules(converters.__path__):
        module = importlib.import_module(f"dcptool.converters.{found.name}")
        modules[module.NAME] = module
    return modules


def names() -> list[str]:
    return sorted(all_formats())


def get(name: str) -> ModuleType:
    try:
        return all_formats()[name]
    except KeyError:
        raise CheckpointError(f"unknown format {name!r} (known: {', '.join(names())})") from None


def detect(path: str | Path) -> str:
    """The format of the checkpoint at ``path`` (a local path or a URL), judged from the files present."""
    return _format_of(_files_at(path))


def open_checkpoint(path: str | Path, format: str | None = None) -> Checkpoint:
    """Read the description of the checkpoint at ``path`` (format detected unless given).

    ``path`` is a local path or a URL that fsspec opens (``s3://bucket/step-100`` with s3fs installed).

    >>> ckpt = open_checkpoint("step-100")                     # doctest: +SKIP
    >>> ckpt.format, len(ckpt.tensors), ckpt.total_bytes       # doctest: +SKIP
    ('dcp', 291, 16060522496)
    """
    files = _files_at(path)
    return get(format or _format_of(files)).read(files)


def _files_at(path: str | Path) -> CheckpointFiles:
    files = CheckpointFiles(path)
    if not files.exists():
        raise CheckpointError(f"{files.location}: no such file or folder")
    return files


def _format_of(files: CheckpointFiles) -> str:
    found = [name for name, module in all_formats().items() if module.detect(files)]
    if len(found) == 1:
        return found[0]
    if not found:
        stale = stale_temporaries(files.local_folder) if files.local_folder and not files.single_file else []
        left = (f"; it holds {len(stale)} temporaries of dcptool runs that died ({', '.join(stale[:3])}"
                f"{' ...' if len(stale) > 3 else ''}), which the next run writing there removes") if stale else ""
        raise CheckpointError(f"{files.location}: not a checkpoint dcptool recognizes (formats: {', '.join(names())}){left}")
    raise CheckpointError(f"{files.location}: looks like several formats ({', '.join(found)}); choose one with --from")
