"""Formats: the interface every module of ``converters/`` implements, and the registry that finds them.

A format is one module of ``dcptool/converters/`` (a file or a package) that defines ``FORMAT``, an
instance of a ``format_interface.Format`` subclass. The registry lists the package, so a new format is one new module
and nothing else names it: callers ask the interface (``detect``, ``read``, ``plan_output``,
``writer``, and what the format declares it can take) and never compare a format's name.

The path of a conversion: ``open_checkpoint`` (detect and read: a ``core.Checkpoint``, the
format-neutral description) -> renames and computed views (``dcptool.families``, ``dcptool.planning.quant``)
-> ``Format.plan_output`` (what the output holds: ``Output``) -> ``Writer.plan`` / ``place`` (where
each piece's bytes go) -> ``dcptool.engine.transfer`` (the bytes, streamed) -> ``Writer.finish_*`` and the
atomic commit (``dcptool.storage``).

>>> sorted(names())
['accelerate', 'dcp', 'fsdp1', 'hf', 'hf-dcp', 'megatron', 'torch']
>>> get("hf").writes_folder, get("torch").writes_folder, get("accelerate").writable
(True, False, False)
>>> get("dcp").sharding.value, get("fsdp1").sharding.value, get("torch").sharding.value
('mesh', 'data-parallel', 'none')
"""

from __future__ import annotations

import contextvars
import importlib
import os
import pkgutil
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from functools import cache
from pathlib import Path

from dcptool import converters
from dcptool.storage import hub
from dcptool.engine.core import Checkpoint
from dcptool.errors import CheckpointError, CheckpointNotFoundError, UsageError, option
from dcptool.format_interface import Format, FormatOptions
from dcptool.safe_pickle import add_safe_globals
from dcptool.storage import CheckpointFiles, stale_temporaries


@cache
def all_formats() -> dict[str, Format]:
    """Every format, by name: the ``FORMAT`` of each module of the ``converters`` package. The classes each
    declares its pickles may hold are let through the restricted unpickler."""
    found = {}
    for module_info in pkgutil.iter_modules(converters.__path__):
        declared = importlib.import_module(f"dcptool.converters.{module_info.name}").FORMAT
        add_safe_globals(declared.safe_globals)
        found[declared.name] = declared
    return found


def names() -> list[str]:
    return sorted(all_formats())


def writable() -> list[str]:
    """The formats dcptool writes (some, like accelerate's Trainer folders, are read only)."""
    return [name for name in names() if all_formats()[name].writable]


def options(name: str, **values) -> FormatOptions | None:
    """The options of format ``name`` (its ``Format.options``) set to ``values``, as ``dcptool.format_options``
    builds them; None for a format that takes none and none given. A value the format does not take is refused,
    naming the formats that take it.

    >>> options("fsdp1", optim_form="flat")
    Fsdp1Options(world_size=None, keep_rank_state=False, optim_form='flat', model_values=None)
    >>> options("torch", compress="zstd")
    Traceback (most recent call last):
    dcptool.errors.UsageError: compress='zstd' goes with to='dcp'
    """
    fmt = get(name)
    taken = {f.name for f in fields(fmt.options)} if fmt.options else set()
    for key, value in values.items():
        if key not in taken and value not in (None, False):
            _refuse_option(key, value)
    if fmt.options is None:
        return None
    made = fmt.options(**{key: value for key, value in values.items() if key in taken})
    made.check()
    return made


def check_options(fmt: Format, given: FormatOptions | None) -> None:
    """Refuse options of another format than ``fmt``, naming the format they go with, and values ``fmt`` cannot take."""
    if given is None:
        return
    if type(given) is fmt.options:
        given.check()
        return
    for key, value in given.given().items():
        _refuse_option(key, value)
    owner = next(f.name for f in all_formats().values() if f.options is type(given))
    raise UsageError(f"{type(given).__name__}: the options of {option('to', owner)}, not of {option('to', fmt.name)}")


def _refuse_option(key: str, value) -> None:
    takers = [f.name for f in all_formats().values() if f.options and key in {o.name for o in fields(f.options)}]
    given = option(key) if value is True else option(key, value)
    if not takers:
        raise UsageError(f"{given}: no format takes it")
    raise UsageError(f"{given} goes with {' or '.join(option('to', taker) for taker in takers)}")


def get(name: str) -> Format:
    try:
        return all_formats()[name]
    except KeyError:
        raise CheckpointError(f"unknown format {name!r} (known: {', '.join(names())})") from None


def detect(path: str | Path) -> str:
    """The format of the checkpoint at ``path`` (a local path or a URL), judged from the files present."""
    return _format_of(_files_at(path))


def open_checkpoint(path: str | Path, format: str | None = None) -> Checkpoint:
    """Read the description of the checkpoint at ``path`` (format detected unless given).

    ``path`` is a local path, a URL that fsspec opens (``s3://bucket/step-100`` with s3fs installed), or a
    Hugging Face hub repo (``Qwen/Qwen3-8B``, ``hf://Qwen/Qwen3-8B@main``), read through the hub cache (dcptool.storage.hub).

    >>> ckpt = open_checkpoint("step-100")                     # doctest: +SKIP
    >>> ckpt.format, len(ckpt.tensors), ckpt.total_bytes       # doctest: +SKIP
    ('dcp', 291, 16060522496)
    """
    files = _files_at(path)
    files.verify_records = _VERIFY_RECORDS.get()
    checkpoint = get(format or _format_of(files)).read(files)
    if "hf_config_dir" not in checkpoint.info and files.is_file(CONFIG):
        # The model's config in the checkpoint's own folder (where a model folder keeps it, and every output of
        # dcptool's but a single file: Format.config_home): what later commands use without --config-dir.
        checkpoint.info["hf_config_dir"] = files.root
    return checkpoint


_VERIFY_RECORDS: contextvars.ContextVar[bool] = contextvars.ContextVar("dcptool_verify_records", default=True)


@contextmanager
def records_checked(verify: bool) -> Iterator[None]:
    """While it lasts, the checkpoints opened check their records (``torch.save`` archives: zip structure and
    CRC-32s) as they are read, or, with ``verify=False`` (``--no-verify-records``), do not."""
    token = _VERIFY_RECORDS.set(verify)
    try:
        yield
    finally:
        _VERIFY_RECORDS.reset(token)


def _files_at(path: str | Path) -> CheckpointFiles:
    files = CheckpointFiles(hub.local_path(path))  # a hub repo id: its snapshot in the hub cache
    problem = wrong_path(path, files)
    if problem and not files.exists():
        raise CheckpointNotFoundError(problem, path=str(path))
    if problem:
        raise CheckpointError(problem, path=str(path))
    return files


# One file of a checkpoint that is a folder: DCP's data and metadata files, verl's per-rank files.
_DCP_PART = re.compile(r"(.*\.distcp|\.metadata)$")
_RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt$")
# A Hugging Face hub repo id: one slash, neither part starting with a dot.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
_NUMBER = re.compile(r"\d+")
SHOWN_INSIDE = 5  # checkpoints named when a folder of checkpoints is given
CONFIG = "config.json"  # a model's Hugging Face config


def wrong_path(path: str | Path, files: CheckpointFiles, unrecognized: bool = False) -> str | None:
    """The one-line refusal of a path that is not a checkpoint itself, saying what to pass instead; None if it may be one.

    Checked before the format is detected (a missing path, a hub id, one file of a folder
    checkpoint) and, with ``unrecognized``, once no format recognized it (a folder of checkpoints).

    >>> wrong_path("run-7/step-100/__0_0.distcp", CheckpointFiles("run-7/step-100/__0_0.distcp"))   # doctest: +SKIP
    'run-7/step-100/__0_0.distcp: one file of a DCP checkpoint, not a checkpoint: pass its folder run-7/step-100'
    """
    where, name = files.location, files.single_file
    if not files.exists():
        if _HUB_ID.fullmatch(str(path)):
            return (f"{path}: no such local folder; it looks like a Hugging Face hub repo id: download it "
                    f"(hf download {path} --local-dir DIR) and pass DIR")
        return f"{where}: no such file or folder"
    if name and _DCP_PART.fullmatch(name):
        return f"{where}: one file of a DCP checkpoint, not a checkpoint: pass its folder {files.root}"
    if name and _RANK_FILE.fullmatch(name):
        return f"{where}: one rank's file of an FSDP1 (verl) checkpoint: pass its folder {files.root}"
    if unrecognized and files.local_folder and not name:
        inside, unreadable = checkpoints_inside(Path(files.local_folder))
        left_out = ""
        if unreadable:
            named = [f"{file} ({why})" for file, why in sorted(unreadable.items())]
            left_out = f"{len(named)} checkpoint file{'s' if len(named) > 1 else ''} that cannot be read: {_shown(named)}"
        if len(inside) == 1:
            return (f"{where}: a folder holding 1 checkpoint, not a checkpoint: pass {files.root / inside[0]}"
                    + (f"; left out, {left_out}" if left_out else ""))
        if inside:
            return (f"{where}: a folder holding {len(inside)} checkpoints, not a checkpoint: pass one of them "
                    f"(newest first): {_shown(inside)}" + (f"; left out, {left_out}" if left_out else ""))
        if left_out:
            return f"{where}: a folder, not a checkpoint; it holds {left_out}"
    return None


def _shown(names: list[str]) -> str:
    extra = len(names) - SHOWN_INSIDE
    return ", ".join(names[:SHOWN_INSIDE]) + (f" and {extra} more" if extra > 0 else "")


def checkpoints_inside(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Checkpoints in ``folder``, one or two levels down (``step-200``, ``global_step_10/actor``), newest first;
    and the checkpoint files there that cannot be read (a torch.save file cut short), each with what is wrong.

    Newest is the largest step number in the name when every name has one, else the latest modified.
    """
    found, unreadable = [], {}
    for entry, name in _candidates(folder):
        problem = _unreadable(entry)
        if problem is None:
            found.append(name)
        else:
            unreadable[name] = problem

    def step(name: str) -> int:
        return int(_NUMBER.findall(name.split("/")[0])[-1])

    if all(_NUMBER.search(name.split("/")[0]) for name in found):
        return sorted(found, key=lambda name: (step(name), name), reverse=True), unreadable
    return sorted(found, key=lambda name: os.path.getmtime(folder / name), reverse=True), unreadable


def _candidates(folder: Path) -> Iterator[tuple[os.DirEntry, str]]:
    """What looks like a checkpoint in ``folder``, one or two levels down, with its name there."""
    for entry in _entries(folder):
        if _is_checkpoint(entry):
            yield entry, entry.name
        elif entry.is_dir():
            yield from ((inner, f"{entry.name}/{inner.name}") for inner in _entries(Path(entry.path)) if _is_checkpoint(inner))


def _entries(folder: Path) -> list[os.DirEntry]:
    try:
        return [entry for entry in os.scandir(folder) if not entry.name.startswith(".")]
    except OSError:
        return []


def _is_checkpoint(entry: os.DirEntry) -> bool:
    """A folder some format recognizes, or a torch.save file (``step-100.pt``)."""
    if entry.is_dir():
        files = CheckpointFiles(entry.path)
        return any(module.detect(files) for module in all_formats().values())
    return entry.name.endswith((".pt", ".pth")) and not _RANK_FILE.fullmatch(entry.name)


def _unreadable(entry: os.DirEntry) -> str | None:
    """What is wrong with a checkpoint that is one file (read whole: its pickle, not its tensors); None when it reads.

    A folder is judged by its file names only: reading it is what the command given it does.
    """
    if entry.is_dir():
        return None
    files = CheckpointFiles(entry.path)
    try:
        get(_format_of(files)).read(files)
    except CheckpointError as exc:
        return str(exc).removeprefix(f"{files.location}: ")
    finally:
        files.close()
    return None


def _format_of(files: CheckpointFiles) -> str:
    found = [name for name, module in all_formats().items() if module.detect(files)]
    refined = {general for name in found for general in all_formats()[name].refines}
    found = [name for name in found if name not in refined]  # the more specific format reads it
    if len(found) == 1:
        return found[0]
    if not found:
        problem = wrong_path(files.location, files, unrecognized=True)
        if problem:
            raise CheckpointError(problem)
        stale = stale_temporaries(files.local_folder) if files.local_folder and not files.single_file else []
        left = (f"; it holds {len(stale)} temporaries of dcptool runs that died ({', '.join(stale[:3])}"
                f"{' ...' if len(stale) > 3 else ''}), which the next run writing there removes") if stale else ""
        raise CheckpointError(f"{files.location}: not a checkpoint dcptool recognizes (formats: {', '.join(names())}){left}")
    raise CheckpointError(f"{files.location}: looks like several formats ({', '.join(found)}); choose one with {option('format')}")
