"""Integrity manifests: a hash of every file and of every tensor's global values, to check a checkpoint later.

A tensor's hash covers its values in row-major order whatever the layout, so the same model saved
on another mesh or converted to another format has the same tensor hashes; file hashes catch any
change to the bytes on disk, including bytes no reader looks at. Hashing is BLAKE3 (``blake3``
releases the GIL) on a thread pool, each thread with its share of the memory budget.

>>> write_manifest("step-1000").tensors                                   # doctest: +SKIP
84
>>> check_manifest("step-1000").problems                                 # doctest: +SKIP
[]
>>> check_against("step-1000", "hf-out", prefix="dcp.model").problems      # doctest: +SKIP
[]
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any, Callable

import blake3
import numpy as np

from dcptool import dtypes, formats
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.errors import CheckpointError, UsageError, option
from dcptool.sizes import DEFAULT_MAX_MEMORY, check_memory_budget
from dcptool.storage import CheckpointFiles, atomic_output, is_remote, output_path
from dcptool.checks.pairing import align_families, select_side
from dcptool.engine.regions import BLOCK, RegionReader, buffer_size

MANIFEST_NAME = "dcptool.manifest.json"
MANIFEST_VERSION = 1
HASH = "blake3"
MAX_THREADS = 16
FILE_READ_SIZE = 16 * 2**20  # file hashing gains nothing from larger reads


def manifest_path(path: str | Path, manifest: str | Path | None = None) -> Path | str:
    """Where a checkpoint's manifest is: ``manifest`` when given, else ``dcptool.manifest.json`` inside the
    checkpoint folder, or ``<file>.dcptool.manifest.json`` beside a single-file checkpoint (URLs for remote ones)."""
    if manifest is not None:
        return output_path(manifest)
    files = CheckpointFiles(path)
    if files.single_file:
        return files.path(f"{files.single_file}.{MANIFEST_NAME}")
    if not files.exists():
        # A single-file checkpoint that was deleted is still found by the manifest it left beside it.
        beside = CheckpointFiles(f"{str(path).rstrip('/')}.{MANIFEST_NAME}")
        if beside.single_file:
            return beside.location
    return files.path(MANIFEST_NAME)


def checkpoint_files(files: CheckpointFiles, manifest: Path | str) -> list[str]:
    """The files a manifest covers, by name relative to the checkpoint: every file of a folder (recursively),
    or the file itself (none when it is gone). Manifests (and their temporary siblings) are never part of it."""
    if files.single_file:
        return [files.single_file]
    if not files.is_dir():
        return []
    skip = _resolved(manifest)
    return [name for name in files.all_names()
            if MANIFEST_NAME not in name and _resolved(files.path(name)) != skip]


def _resolved(location: Path | str) -> Path | str:
    return location.resolve() if isinstance(location, Path) else location


@dataclass
class TensorDigest:
    hash: str | None = None
    nonfinite: tuple[int, int] | None = None  # (NaN, Inf) when scanned and floating point
    error: str | None = None  # why it could not be read


@dataclass
class Problem:
    """One finding: ``kind`` is e.g. "changed file", "missing tensor", "changed values", "non-finite"."""

    kind: str
    name: str  # the file or tensor
    detail: str


@dataclass
class Result:
    """What ``write_manifest``, ``check`` or ``check_against`` did and found."""

    action: str  # "write", "check" or "against"
    path: str
    manifest: str
    files: int = 0
    tensors: int = 0
    compared: int = 0  # tensors whose hashes were compared
    bytes_hashed: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "problems"}, "ok": self.ok,
                "problems": [vars(p) for p in self.problems]}


class _Hasher:
    """Hashes files and tensors on a thread pool; each thread reuses one buffer, a share of ``max_memory``."""

    def __init__(self, max_memory: int, threads: int | None, progress: Callable[[int], None] | None):
        check_memory_budget(max_memory)
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        wanted = threads or min(available, MAX_THREADS)
        self.threads = max(1, min(wanted, max_memory // 2**16))
        self.max_memory = max_memory
        self.progress = progress or (lambda n: None)
        self.bytes = 0
        self._count_lock = threading.Lock()

    def run(self, files: CheckpointFiles | None, names: list[str], checkpoint: Checkpoint | None,
            tensors: dict[str, TensorInfo], scan_nonfinite: bool = False) -> tuple[dict[str, str], dict[str, TensorDigest]]:
        """Hashes of the files ``names`` of ``files`` and digests of ``tensors``, by name; a tensor that cannot be
        read gets its error."""
        size = buffer_size(self.max_memory, tensors.values(), self.threads)
        if names:
            size = max(size, min(self.max_memory // self.threads, FILE_READ_SIZE))
        self._local = threading.local()  # fresh per run: buffer sizes differ between runs
        with ThreadPoolExecutor(self.threads, thread_name_prefix="dcptool-hash") as pool:
            try:
                # Largest first, so that one big item does not start last and run alone.
                file_jobs = {name: pool.submit(self._hash_file, files, name, size)
                             for name in sorted(names, key=lambda name: -files.size(name))}
                tensor_jobs = {name: pool.submit(self._hash_tensor, checkpoint, tensor, size, scan_nonfinite)
                               for name, tensor in sorted(tensors.items(), key=lambda item: -item[1].nbytes)}
                file_hashes = {name: file_jobs[name].result() for name in names}
                digests = {name: tensor_jobs[name].result() for name in tensors}
            except BaseException:  # Ctrl-C or a failure: what has not started is not hashed
                pool.shutdown(wait=False, cancel_futures=True)
                raise
        return file_hashes, digests

    def _buffer(self, size: int) -> bytearray:
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = bytearray(size)
        return buffer

    def _count(self, count: int) -> None:
        with self._count_lock:
            self.bytes += count
        self.progress(count)

    def _hash_file(self, files: CheckpointFiles, name: str, size: int) -> str:
        hasher = blake3.blake3()
        view = memoryview(self._buffer(size))[:FILE_READ_SIZE]
        total = files.size(name)
        for offset in range(0, total, len(view)):
            piece = view[:min(len(view), total - offset)]
            files.read_into(name, offset, piece)
            hasher.update(piece)
            self._count(len(piece))
        return hasher.hexdigest()

    def _hash_tensor(self, checkpoint: Checkpoint, tensor: TensorInfo, size: int, scan: bool) -> TensorDigest:
        hasher = blake3.blake3()
        nan = inf = 0
        dtype = dtypes.dtype(tensor.dtype).name
        floating = scan and dtype in FLOATING
        try:
            for _, values in RegionReader(checkpoint, self._buffer(size)).slabs(tensor):
                hasher.update(values.reshape(-1).view(np.uint8))
                if floating:
                    found_nan, found_inf = count_nonfinite(values, dtype)
                    nan, inf = nan + found_nan, inf + found_inf
                self._count(values.nbytes)
        except CheckpointError as exc:
            return TensorDigest(error=str(exc))
        return TensorDigest(hasher.hexdigest(), (nan, inf) if floating else None)


# IEEE-style float formats by (exponent bits, mantissa bits): an all-ones exponent is Inf (zero mantissa) or NaN.
_SPECIAL_BITS = {
    "float64": (0x7FF0000000000000, 0x000FFFFFFFFFFFFF),
    "float32": (0x7F800000, 0x007FFFFF),
    "float16": (0x7C00, 0x03FF),
    "bfloat16": (0x7F80, 0x007F),
}
FLOATING = (*_SPECIAL_BITS, "float8_e4m3fn", "float8_e5m2")  # the dtypes --scan-nonfinite counts NaN and Inf in


def count_nonfinite(bits: np.ndarray, dtype: str) -> tuple[int, int] | None:
    """(NaN, Inf) counts of raw float bits (an unsigned view); None for dtypes that are not floating point.

    >>> count_nonfinite(np.array([0x7FC0, 0xFF80, 0x3F80], dtype=np.uint16), "bfloat16")   # NaN, -Inf, 1.0
    (1, 1)
    >>> count_nonfinite(np.array([0x7F, 0xFC, 0x7B], dtype=np.uint8), "float8_e5m2")      # NaN, -Inf, 57344
    (1, 1)
    """
    flat = bits.reshape(-1)
    if dtype in dtypes.FLOAT8:
        return _float8_nonfinite(flat, dtype)
    if dtype not in _SPECIAL_BITS:
        return None
    exponent, mantissa = (flat.dtype.type(mask) for mask in _SPECIAL_BITS[dtype])
    nan = special = 0
    for start in range(0, flat.size, BLOCK):
        block = flat[start:start + BLOCK]
        is_special = (block & exponent) == exponent
        if is_special.any():
            special += int(np.count_nonzero(is_special))
            nan += int(np.count_nonzero(is_special & ((block & mantissa) != 0)))
    return nan, special - nan


def _float8_nonfinite(flat: np.ndarray, dtype: str) -> tuple[int, int]:
    """(NaN, Inf) counts of float8 bits, from the decoded values of the few elements that may be either.

    Those are found with one compare, at memory speed (decoding every element runs at a quarter of it):
    NaN and Inf are the largest magnitudes of the IEEE and "fn" types, 7-bit patterns from
    ``_first_nonfinite`` up.
    """
    first = _first_nonfinite(dtype)
    nan = inf = 0
    for start in range(0, flat.size, BLOCK):
        block = flat[start:start + BLOCK]
        maybe = (block & 0x7F) >= first
        if maybe.any():
            values = dtypes.float8_to_float32(block[maybe], dtype)
            nan += int(np.count_nonzero(np.isnan(values)))
            inf += int(np.count_nonzero(np.isinf(values)))
    return nan, inf


@cache
def _first_nonfinite(dtype: str) -> int:
    """The smallest magnitude (the bits but the sign) of a float8 pattern that is NaN or Inf."""
    values = dtypes.float8_to_float32(np.arange(256, dtype=np.uint8), dtype)
    return min(int(bits) & 0x7F for bits in np.flatnonzero(~np.isfinite(values)))


def write_manifest(path: str | Path, manifest: str | Path | None = None, *, source_format: str | None = None,
                   scan_nonfinite: bool = False, overwrite: bool = False,
                   max_memory: int = DEFAULT_MAX_MEMORY, threads: int | None = None,
                   progress: Callable[[int], None] | None = None) -> Result:
    """Hash every file and tensor of the checkpoint at ``path`` and write the manifest, atomically.

    With ``scan_nonfinite`` the NaN and Inf counts of floating-point tensors are recorded too, and
    tensors holding any are returned as problems (the manifest is written all the same).

    >>> write_manifest("step-1000", scan_nonfinite=True).problems           # doctest: +SKIP
    [Problem(kind='non-finite', name='model.norm.weight', detail='2 NaN, 0 Inf')]
    """
    started = time.perf_counter()
    target = manifest_path(path, manifest)
    if is_remote(target):
        raise UsageError(f"{target}: writing to remote storage is not supported yet; give a local {option('manifest')} file")
    checkpoint = formats.open_checkpoint(path, source_format)
    files = checkpoint_files(checkpoint.files, target)
    with atomic_output(target, overwrite, is_dir=False) as temporary:
        hasher = _Hasher(max_memory, threads, progress)
        file_hashes, digests = hasher.run(checkpoint.files, files, checkpoint, checkpoint.tensors, scan_nonfinite)
        broken = next((d.error for d in digests.values() if d.error), None)
        if broken:
            raise CheckpointError(broken)
        document = {
            "dcptool_manifest": MANIFEST_VERSION,
            "hash": HASH,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "format": checkpoint.format,
            "files": {name: {"bytes": checkpoint.files.size(name), "hash": h} for name, h in file_hashes.items()},
            "tensors": {key: _tensor_entry(tensor, digests[key]) for key, tensor in checkpoint.tensors.items()},
            "objects": sorted(checkpoint.objects),
        }
        temporary.write_text(json.dumps(document, indent=1) + "\n")
    result = Result("write", str(path), str(target), files=len(files), tensors=len(digests), bytes_hashed=hasher.bytes)
    result.problems = _nonfinite_problems(digests)
    result.seconds = time.perf_counter() - started
    return result


def run(path: str | Path, *, write: bool = False, check: bool = False, against: str | Path | None = None,
        manifest: str | Path | None = None, source_format: str | None = None, scan_nonfinite: bool = False,
        prefix: str | None = None, against_prefix: str | None = None, overwrite: bool = False,
        max_memory: int = DEFAULT_MAX_MEMORY, threads: int | None = None,
        progress: Callable[[int], None] | None = None) -> Result:
    """``dcptool checksum``: one of ``write_manifest`` (``write``), ``check_manifest`` (``check``) and
    ``check_against`` (``against``), refusing options that do not go with the one chosen."""
    if write + check + (against is not None) != 1:
        raise UsageError(f"choose one of {option('write', True)}, {option('check', True)} and {option('against')}")
    if (prefix or against_prefix) and against is None:
        raise UsageError(f"{option('prefix')} and {option('against_prefix')} go with {option('against')}")
    options = {"max_memory": max_memory, "threads": threads, "progress": progress}
    if write:
        return write_manifest(path, manifest, source_format=source_format, scan_nonfinite=scan_nonfinite,
                              overwrite=overwrite, **options)
    if check:
        return check_manifest(path, manifest, source_format=source_format, scan_nonfinite=scan_nonfinite, **options)
    return check_against(path, against, manifest, other_format=source_format, prefix=prefix,
                         other_prefix=against_prefix, **options)


def _tensor_entry(tensor: TensorInfo, digest: TensorDigest) -> dict[str, Any]:
    entry = {"path": list(tensor.path), "dtype": tensor.dtype, "shape": list(tensor.shape), "bytes": tensor.nbytes,
             "hash": digest.hash}
    if digest.nonfinite is not None:
        entry["nan"], entry["inf"] = digest.nonfinite
    return entry


def _nonfinite_problems(digests: dict[str, TensorDigest]) -> list[Problem]:
    return [Problem("non-finite", key, f"{d.nonfinite[0]:,} NaN, {d.nonfinite[1]:,} Inf")
            for key, d in digests.items() if d.nonfinite and any(d.nonfinite)]


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A manifest's contents, refused with one clear line when it is missing or not a dcptool manifest."""
    files = CheckpointFiles(path)
    if not files.single_file:
        raise CheckpointError(f"{path}: no manifest (write one first: checksum with {option('write', True)})")
    try:
        data = files.read_all(files.single_file)
    finally:
        files.close()
    try:
        document = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError included
        raise CheckpointError(f"{path}: not a dcptool manifest ({exc})") from None
    if not isinstance(document, dict) or document.get("dcptool_manifest") != MANIFEST_VERSION:
        raise CheckpointError(f"{path}: not a dcptool manifest (version {MANIFEST_VERSION})")
    if document.get("hash") != HASH or not all(isinstance(document.get(k), dict) for k in ("files", "tensors")):
        raise CheckpointError(f"{path}: not a dcptool manifest with {HASH} file and tensor hashes")
    return document


def check_manifest(path: str | Path, manifest: str | Path | None = None, *, source_format: str | None = None,
                   scan_nonfinite: bool = False, max_memory: int = DEFAULT_MAX_MEMORY,
                   threads: int | None = None, progress: Callable[[int], None] | None = None) -> Result:
    """Check the checkpoint at ``path`` against its manifest: every file, then the tensors a change touches.

    Files are compared first (missing, extra, truncated, changed bytes). When any differ, the
    checkpoint is read again and the tensors in changed data files (all tensors when metadata or an
    index changed) are hashed, so the problems name the tensors too; a checkpoint that can no longer
    be read is a problem of its own.

    >>> [(p.kind, p.name) for p in check_manifest("step-1000").problems]   # doctest: +SKIP
    [('changed file', '__2_0.distcp'), ('changed values', 'model.layers.0.mlp.up_proj.weight')]
    """
    started = time.perf_counter()
    target = manifest_path(path, manifest)
    source = CheckpointFiles(path)
    if not source.exists() and not CheckpointFiles(target).single_file:
        raise CheckpointError(f"{path}: no such file or folder")
    document = read_manifest(target)
    files = checkpoint_files(source, target)
    recorded = document["files"]
    hasher = _Hasher(max_memory, threads, progress)
    result = Result("check", str(path), str(target), files=len(recorded), tensors=len(document["tensors"]))

    changed = set()
    for name, entry in recorded.items():
        if name not in files:
            result.problems.append(Problem("missing file", name, "in the manifest, not on disk"))
            changed.add(name)
        elif source.size(name) != entry["bytes"]:
            size = source.size(name)
            kind = "truncated file" if size < entry["bytes"] else "resized file"
            result.problems.append(Problem(kind, name, f"{size:,} bytes, the manifest says {entry['bytes']:,}"))
            changed.add(name)
    extra = sorted(set(files) - set(recorded))
    result.problems += [Problem("extra file", name, "on disk, not in the manifest") for name in extra]
    same_size = [name for name in recorded if name not in changed]
    try:
        file_hashes, _ = hasher.run(source, same_size, None, {})
    finally:
        source.close()
    for name, digest in file_hashes.items():
        if digest != recorded[name]["hash"]:
            result.problems.append(Problem("changed file", name, "bytes differ from the manifest"))
            changed.add(name)

    if changed or extra or scan_nonfinite:
        try:
            checkpoint = formats.open_checkpoint(path, source_format or document.get("format"))
        except CheckpointError as exc:
            result.problems.append(Problem("unreadable", str(path), str(exc)))
        else:
            _check_tensors(checkpoint, document, changed | set(extra), scan_nonfinite, hasher, result)
    result.bytes_hashed = hasher.bytes
    result.seconds = time.perf_counter() - started
    return result


def _check_tensors(checkpoint: Checkpoint, document: dict, changed_files: set[str], scan_nonfinite: bool,
                   hasher: _Hasher, result: Result) -> None:
    recorded = document["tensors"]
    result.problems += _compare_descriptions(recorded, checkpoint.tensors)
    data_files = set(checkpoint.data_files())
    # A changed data file touches the tensors stored in it; any other changed file (.metadata, an index) may touch all.
    every = scan_nonfinite or any(name not in data_files for name in changed_files if name in document["files"])
    suspects = {key: tensor for key, tensor in checkpoint.tensors.items()
                if key in recorded and (every or any(c.file in changed_files for c in tensor.chunks))}
    _, digests = hasher.run(None, [], checkpoint, suspects, scan_nonfinite)
    result.compared = len(digests)
    result.problems += _compare_digests(recorded, digests)
    result.problems += _nonfinite_problems(digests)
    objects = set(document.get("objects", ()))
    result.problems += [Problem("missing object", key, "non-tensor entry in the manifest, not in the checkpoint")
                        for key in sorted(objects - set(checkpoint.objects))]
    result.problems += [Problem("extra object", key, "non-tensor entry in the checkpoint, not in the manifest")
                        for key in sorted(set(checkpoint.objects) - objects)]


def _compare_descriptions(recorded: dict[str, dict], tensors: dict[str, TensorInfo]) -> list[Problem]:
    """Missing and extra tensors, and changed dtypes and shapes (no data read)."""
    problems = [Problem("missing tensor", key, "in the manifest, not in the checkpoint") for key in recorded if key not in tensors]
    problems += [Problem("extra tensor", key, "in the checkpoint, not in the manifest") for key in tensors if key not in recorded]
    for key, tensor in tensors.items():
        entry = recorded.get(key)
        if entry is None:
            continue
        if dtypes.dtype(entry["dtype"]).name != dtypes.dtype(tensor.dtype).name:
            problems.append(Problem("changed dtype", key, f"{tensor.dtype}, the manifest says {entry['dtype']}"))
        elif list(tensor.shape) != entry["shape"]:
            problems.append(Problem("changed shape", key, f"{list(tensor.shape)}, the manifest says {entry['shape']}"))
    return problems


def _compare_digests(recorded: dict[str, dict], digests: dict[str, TensorDigest]) -> list[Problem]:
    problems = []
    for key, digest in digests.items():
        if digest.error:
            problems.append(Problem("unreadable tensor", key, digest.error))
        elif digest.hash != recorded[key]["hash"]:
            problems.append(Problem("changed values", key, "hash of its values differs from the manifest"))
    return problems


def check_against(path: str | Path, other: str | Path, manifest: str | Path | None = None, *,
                  other_format: str | None = None, prefix: str | None = None, other_prefix: str | None = None,
                  max_memory: int = DEFAULT_MAX_MEMORY, threads: int | None = None,
                  progress: Callable[[int], None] | None = None) -> Result:
    """Check another checkpoint (any format or layout) against the manifest of ``path``, by tensor hashes only.

    ``prefix`` keeps the manifest's keys under that wrapper, stripped, ``other_prefix`` those of
    ``other``; ``"auto"`` takes the model part, as export-hf finds it.

    >>> check_against("step-1000", "hf-out", prefix="dcp.model").ok       # doctest: +SKIP
    True
    """
    started = time.perf_counter()
    target = manifest_path(path, manifest)
    document = read_manifest(target)
    expected = select_side(_described_checkpoint(document, target), prefix)
    actual = select_side(formats.open_checkpoint(other, other_format), other_prefix)
    expected, actual, _ = align_families(expected, actual)  # an export in HF names against an Archon manifest
    recorded = {name: document["tensors"][tensor.key] for name, tensor in expected.tensors.items()}
    hasher = _Hasher(max_memory, threads, progress)
    result = Result("against", str(other), str(target), tensors=len(actual.tensors))
    result.problems += _compare_descriptions(recorded, actual.tensors)
    described_differently = {p.name for p in result.problems}
    comparable = {name: tensor for name, tensor in actual.tensors.items()
                  if name in recorded and name not in described_differently}
    _, digests = hasher.run(None, [], actual.checkpoint, comparable)
    result.compared = len(digests)
    result.problems += _compare_digests(recorded, digests)
    result.bytes_hashed = hasher.bytes
    result.seconds = time.perf_counter() - started
    return result


def _described_checkpoint(document: dict, manifest: Path | str) -> Checkpoint:
    """The manifest's tensors as a checkpoint description without data, so prefixes select from it as from any checkpoint."""
    tensors = {}
    for key, entry in document["tensors"].items():
        try:
            tensors[key] = TensorInfo(tuple(entry["path"]), entry["dtype"], tuple(entry["shape"]), [])
        except (KeyError, TypeError):
            raise CheckpointError(f"{manifest}: tensor {key}: malformed manifest entry") from None
    return Checkpoint(document.get("format", "manifest"), manifest, CheckpointFiles(manifest), tensors, {})
