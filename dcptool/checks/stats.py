"""What is inside a checkpoint: per-tensor statistics, suspicious tensors, parameter counts, folded key lists.

``compute`` streams every tensor through the same slab readers as ``verify`` and ``checksum``
(``RegionReader`` on a thread pool, each thread with its share of ``max_memory``) and gives each
its min, max, mean, standard deviation (population, ``ddof=0``), L2 norm, and counts of zeros, NaN
and Inf. Values are widened exactly first (bfloat16, float16 and float8 to float32) and summed in
float64; NaN and Inf are counted, and left out of the other numbers. It then flags what looks like
silent corruption: all-zero tensors, NaN or Inf, an expert whose weights are all zero while the
other experts' are not (grouped ``[E, ...]`` tensors and per-expert ``experts.N.`` keys of the
model), and tensors with exactly the values of another (constant tensors, such as norms at their
initial ones, are left out of that).

>>> report = compute(open_checkpoint("step-1000"))                       # doctest: +SKIP
>>> report.tensors["model.norm.weight"].mean, [f.kind for f in report.flags]   # doctest: +SKIP
(0.998, ['zero expert'])
>>> parameter_counts(open_checkpoint("step-1000"))["total"]              # doctest: +SKIP
751632384
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dcptool import dtypes, models, selection
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.errors import CheckpointError, UsageError, option
from dcptool.sizes import DEFAULT_MAX_MEMORY, check_memory_budget

# The readers (dcptool.checks.verification) and blake3 are imported by ``compute`` alone: plain inspect, which uses
# the counts and folded rows here, starts without them (issue 5's start-up time).

# More threads than this read no faster: between numpy's calls each block holds the GIL (2 GB of bf16 on
# 16 free cores: 443 MB/s on 1 thread, 640 MB/s on 2 to 4, 440 MB/s on 16).
MAX_THREADS = 4
# A model tensor whose name holds "experts" and that has this many dims is grouped experts [E, ...].
NUMBER_PART = re.compile(r"^\d+$")


@dataclass
class TensorStats:
    """The numbers of one tensor; ``min`` .. ``l2`` are over its finite values (None when there are none)."""

    dtype: str
    shape: tuple[int, ...]
    elements: int
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    l2: float | None = None
    zeros: int = 0
    nan: int = 0
    inf: int = 0
    hash: str | None = None  # BLAKE3 of the values in row-major order (dcptool checksum's tensor hash)
    expert_norms: list[float] | None = None  # grouped experts: the L2 norm of each slice along dim 0
    error: str | None = None  # why it could not be read or summarized

    def to_json(self) -> dict[str, Any]:
        return {k: (list(v) if k == "shape" else v) for k, v in vars(self).items() if v is not None or k in
                ("min", "max", "mean", "std", "l2")}


@dataclass
class Flag:
    """One suspicious finding: ``kind`` is "all zeros", "non-finite", "zero expert", "identical" or "unreadable"."""

    kind: str
    keys: list[str]
    detail: str


@dataclass
class StatsReport:
    tensors: dict[str, TensorStats]
    flags: list[Flag] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    threads: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"tensors": {k: s.to_json() for k, s in self.tensors.items()},
                "flags": [vars(f) for f in self.flags], "bytes": self.bytes, "seconds": round(self.seconds, 3)}


class _Moments:
    """Running count, mean, M2 (Chan et al.'s parallel update), min, max and zero / NaN / Inf counts, in float64."""

    def __init__(self) -> None:
        self.finite = self.zeros = self.nan = self.inf = 0
        self.mean = self.m2 = 0.0
        self.min, self.max = math.inf, -math.inf

    def add(self, values: np.ndarray, floating: bool) -> float:
        """Take a 1-D block of exact values (float32 or float64); returns the sum of squares of its finite values.

        Min and max come first: NaN and Inf show in them, so an all-finite block (the usual case) is
        never scanned for them. Sums are taken in float64.
        """
        low, high = values.min(), values.max()
        if floating and not (np.isfinite(low) and np.isfinite(high)):
            finite = np.isfinite(values)
            nan = int(np.count_nonzero(np.isnan(values)))
            self.nan += nan
            self.inf += values.size - int(np.count_nonzero(finite)) - nan
            values = values[finite]
            if not values.size:
                return 0.0
            low, high = values.min(), values.max()
        count = values.size
        wide = values.astype(np.float64, copy=False)
        mean = float(wide.sum()) / count
        deviation = wide - mean
        # Squared in place and summed: np.dot would call a multi-threaded BLAS, whose threads cost more
        # than they save on blocks this small (and fight the reading threads for the cores).
        m2 = float(np.square(deviation, out=deviation).sum())
        total = self.finite + count
        delta = mean - self.mean
        self.mean += delta * count / total
        self.m2 += m2 + delta * delta * self.finite * count / total
        self.finite = total
        self.zeros += count - int(np.count_nonzero(values))
        self.min, self.max = min(self.min, float(low)), max(self.max, float(high))
        return m2 + count * mean * mean


def widen(bits: np.ndarray, dtype: str) -> np.ndarray | None:
    """Raw element bits (an unsigned view, 1-D) as exact float32 or float64 values; None for complex and
    float8_e8m0fnu.

    Floats of 32 bits or fewer (bfloat16, float16, float8) become float32, which holds each exactly;
    the rest (float64, integers, bool) float64.

    >>> widen(np.array([0x3F80, 0xC000], dtype=np.uint16), "bfloat16")   # 1.0 and -2.0
    array([ 1., -2.], dtype=float32)
    """
    if dtype in ("bfloat16", "float16", "float32"):
        return dtypes.cast(bits, dtype, "float32").view(np.float32)
    if dtype in dtypes.FLOAT8:
        return dtypes.float8_to_float32(bits, dtype)
    numpy_type = dtypes.dtype(dtype).numpy
    if numpy_type is None or numpy_type.startswith("complex"):
        return None
    return bits.view(numpy_type).astype(np.float64)


class _Scanner:
    """Summarizes tensors on a thread pool; each thread reuses one buffer, its share of ``max_memory``."""

    def __init__(self, checkpoint: Checkpoint, max_memory: int, threads: int | None,
                 progress: Callable[[int], None] | None):
        check_memory_budget(max_memory)
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.threads = max(1, min(threads or min(available, MAX_THREADS), max_memory // 2**16))
        self.checkpoint, self.max_memory = checkpoint, max_memory
        self.progress = progress or (lambda n: None)
        self._local = threading.local()

    def run(self, tensors: dict[str, TensorInfo], grouped: set[str]) -> dict[str, TensorStats]:
        from dcptool.engine.regions import buffer_size

        size = buffer_size(self.max_memory, tensors.values(), self.threads)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="dcptool-stats") as pool:
            try:
                # Largest first, so that one big tensor does not start last and run alone.
                jobs = {key: pool.submit(self._summarize, tensor, size, key in grouped)
                        for key, tensor in sorted(tensors.items(), key=lambda item: -item[1].nbytes)}
                return {key: jobs[key].result() for key in tensors}
            except BaseException:  # Ctrl-C or a failure: what has not started is not read
                pool.shutdown(wait=False, cancel_futures=True)
                raise

    def _summarize(self, tensor: TensorInfo, size: int, grouped: bool) -> TensorStats:
        import blake3

        from dcptool.engine.regions import BLOCK, RegionReader

        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = bytearray(size)
        dtype = dtypes.dtype(tensor.dtype).name
        stats = TensorStats(dtype, tensor.shape, math.prod(tensor.shape))
        floating = dtype.startswith(("float", "bfloat"))
        moments, hasher = _Moments(), blake3.blake3()
        expert_squares = np.zeros(tensor.shape[0]) if grouped else None
        try:
            for offsets, values in RegionReader(self.checkpoint, buffer).slabs(tensor):
                hasher.update(values.reshape(-1).view(np.uint8))
                # Grouped experts go slice by slice along dim 0, to sum each expert's squares.
                rows = values.reshape(values.shape[0], -1) if grouped else values.reshape(1, -1)
                for index, row in enumerate(rows):
                    for start in range(0, row.size, BLOCK):
                        widened = widen(row[start:start + BLOCK], dtype)
                        if widened is None:
                            raise CheckpointError(f"{tensor.key}: {dtype} values are not summarized")
                        squares = moments.add(widened, floating)
                        if grouped:
                            expert_squares[offsets[0] + index] += squares
                self.progress(values.nbytes)
        except CheckpointError as exc:
            stats.error = str(exc)
            return stats
        stats.hash = hasher.hexdigest()
        stats.zeros, stats.nan, stats.inf = moments.zeros, moments.nan, moments.inf
        if moments.finite:
            stats.min, stats.max, stats.mean = moments.min, moments.max, moments.mean
            stats.std = math.sqrt(moments.m2 / moments.finite)
            stats.l2 = math.sqrt(moments.m2 + moments.finite * moments.mean ** 2)
        if grouped:
            stats.expert_norms = [math.sqrt(s) for s in expert_squares]
        return stats


def compute(checkpoint: Checkpoint, tensors: dict[str, TensorInfo] | None = None, *,
            max_memory: int = DEFAULT_MAX_MEMORY, threads: int | None = None,
            progress: Callable[[int], None] | None = None) -> StatsReport:
    """Statistics of ``tensors`` (default: all of the checkpoint's, by key) and the flags they raise.

    >>> report = compute(open_checkpoint("step-1000"), max_memory=2**28)   # doctest: +SKIP
    >>> [(f.kind, f.keys) for f in report.flags]                           # doctest: +SKIP
    [('non-finite', ['model.layers.7.mlp.down_proj.weight'])]
    """
    started = time.perf_counter()
    tensors = checkpoint.tensors if tensors is None else tensors
    model_keys = {info.key for info in selection.model_part(checkpoint).values()}
    grouped = {key for key, t in tensors.items()
               if key in model_keys and models.grouped_experts(key, t.shape)}
    scanner = _Scanner(checkpoint, max_memory, threads, progress)
    stats = scanner.run(tensors, grouped)
    report = StatsReport(stats, threads=scanner.threads, seconds=time.perf_counter() - started,
                         bytes=sum(t.nbytes for t in tensors.values()))
    report.flags = flags(stats, model_keys)
    return report


def flags(stats: dict[str, TensorStats], model_keys: set[str]) -> list[Flag]:
    """The suspicious among summarized tensors (see the module docstring); expert checks cover ``model_keys``."""
    found = []
    zero_experts = set()
    for key, s in stats.items():
        norms = s.expert_norms
        if norms and any(norms) and not all(norms):
            empty = [index for index, norm in enumerate(norms) if norm == 0]
            which = f"expert {empty[0]} of {len(norms)} is" if len(empty) == 1 else \
                f"experts {_ranges(empty)} of {len(norms)} are"
            found.append(Flag("zero expert", [key], f"{which} all zeros, the others are not"))
    per_expert: dict[tuple[str, str], dict[int, str]] = {}
    for key in stats:
        slot = models.expert_of(key)
        if key in model_keys and slot and stats[key].l2 is not None:
            prefix, number, rest = slot
            per_expert.setdefault((prefix, rest), {})[number] = key
    for (prefix, suffix), keys in per_expert.items():
        zero = [keys[n] for n in sorted(keys) if stats[keys[n]].l2 == 0 and not stats[keys[n]].nan]
        if zero and len(zero) < len(keys):
            zero_experts.update(zero)
            found.append(Flag("zero expert", zero, f"{len(zero)} of the {len(keys)} experts of {prefix}.*.{suffix} "
                                                   f"{'is' if len(zero) == 1 else 'are'} all zeros, the others are not"))
    for key, s in stats.items():
        if s.error:
            found.append(Flag("unreadable", [key], s.error))
        elif s.elements and s.zeros == s.elements and key not in zero_experts:
            found.append(Flag("all zeros", [key], f"all {s.elements:,} values are 0"))
        if s.nan or s.inf:
            found.append(Flag("non-finite", [key], f"{s.nan:,} NaN, {s.inf:,} Inf"))
    same: dict[tuple, list[str]] = {}
    for key, s in stats.items():
        constant = s.min is not None and s.min == s.max and not (s.nan or s.inf)
        if s.hash and s.elements > 1 and not constant:
            same.setdefault((s.hash, s.dtype, s.shape), []).append(key)
    found += [Flag("identical", keys, f"{len(keys)} tensors hold exactly the same values")
              for keys in same.values() if len(keys) > 1]
    return found


def _ranges(numbers) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0..2,5,7..8`` (repeats counted once)."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)


def parameter_counts(checkpoint: Checkpoint, tensors: dict[str, TensorInfo] | None = None) -> dict[str, Any]:
    """Model parameters (total, per top-level group, per routed expert) and the elements of everything else.

    Model parameters are the model part's tensors (``selection.model_part``: optimizer moments, step
    counters and other state are counted apart, as ``other_elements``). A group is the module path
    up to the first number (``model.layers``, ``model.embed_tokens``, ``lm_head``).

    >>> parameter_counts(open_checkpoint("qwen3-moe"))["experts"]          # doctest: +SKIP
    {'count': 128, 'per_expert': 14155776, 'total': 1811939328, 'layers': 48}
    """
    tensors = checkpoint.tensors if tensors is None else tensors
    params = {name: info for name, info in selection.model_part(checkpoint).items() if info.key in tensors}
    groups: dict[str, int] = {}
    for name, info in params.items():
        parts = name.split(".")[:-1] or name.split(".")
        head = next((i for i, part in enumerate(parts) if NUMBER_PART.match(part)), len(parts))
        group = ".".join(parts[:head] or parts[:1])
        groups[group] = groups.get(group, 0) + math.prod(info.shape)
    total = sum(groups.values())
    model_keys = {info.key for info in params.values()}
    other = sum(math.prod(t.shape) for key, t in tensors.items() if key not in model_keys)
    return {"total": total, "groups": dict(sorted(groups.items(), key=lambda item: -item[1])),
            "other_elements": other, "experts": _expert_counts(params)}


def _expert_counts(params: dict[str, TensorInfo]) -> dict[str, int] | None:
    """Routed experts: how many, parameters of one expert over all layers, their total and the MoE layers."""
    per_expert_total, experts, layers = 0, set(), set()
    for name, info in params.items():
        slot = models.expert_of(name)
        if slot:
            experts.add(slot[1])
            layers.add(slot[0])
            per_expert_total += math.prod(info.shape)
        elif models.grouped_experts(name, info.shape):
            experts.update(range(info.shape[0]))
            layers.add(name.rsplit(".", 1)[0])
            per_expert_total += math.prod(info.shape)
    if not experts:
        return None
    count = max(experts) + 1
    return {"count": count, "per_expert": per_expert_total // count, "total": per_expert_total, "layers": len(layers)}


def folded_rows(keys: list[str], describe: Callable[[str], tuple], minimum: int = 3) -> list[tuple[str, list[str]]]:
    """Keys folded where only their numbers differ and ``describe`` (dtype, shape, chunking) agrees.

    Runs of at least ``minimum`` keys become one row named with the numbers as ranges; the rest stay
    as they are. Rows keep the order of their first key.

    >>> keys = [f"layers.{i}.w" for i in range(4)] + ["norm"]
    >>> [name for name, _ in folded_rows(keys, lambda key: ())]
    ['layers.{0..3}.w', 'norm']
    """
    groups: dict[tuple, list[str]] = {}
    for key in keys:
        pattern = tuple("#" if NUMBER_PART.match(part) else part for part in key.split("."))
        groups.setdefault((pattern, describe(key)), []).append(key)
    rows = []
    for (pattern, _), members in groups.items():
        if len(members) < minimum or "#" not in pattern:
            rows += [(key, [key]) for key in members]
            continue
        parts = [key.split(".") for key in members]
        numbers = [{int(p[i]) for p in parts} if part == "#" else None for i, part in enumerate(pattern)]
        name = ".".join(part if found is None else str(*found) if len(found) == 1 else "{" + _ranges(found) + "}"
                        for part, found in zip(pattern, numbers))
        rows.append((name, members))
    order = {key: i for i, key in enumerate(keys)}
    return sorted(rows, key=lambda row: order[row[1][0]])


def included(entries: dict[str, Any], pattern: str | None) -> dict[str, Any]:
    """The entries whose key matches the regular expression ``pattern`` (all when None); a bad pattern is a usage error."""
    if pattern is None:
        return entries
    try:
        return selection.select(entries, pattern, None)
    except re.error as exc:
        raise UsageError(f"{option('include', pattern)}: not a regular expression ({exc})") from None


STATS_HEADER = ("key", "min", "max", "mean", "std", "l2", "zeros", "nan", "inf")


def stats_rows(report: StatsReport, show: Callable[[str], str] = str) -> list[tuple[str, ...]]:
    """One table row per tensor (``STATS_HEADER``); ``show`` makes keys printable. An unreadable tensor's
    row is dashes (its flag says why)."""
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    return [(show(key), *(number(getattr(s, name)) for name in ("min", "max", "mean", "std", "l2")),
             *((f"{s.zeros:,}", f"{s.nan:,}", f"{s.inf:,}") if not s.error else ("-", "-", "-")))
            for key, s in report.tensors.items()]


def summary_lines(report: StatsReport, show: Callable[[str], str] = str) -> list[str]:
    """The flags, one line each, and how much was read how fast."""
    lines = []
    for flag in report.flags:
        keys = ", ".join(map(show, flag.keys[:6])) + (f" and {len(flag.keys) - 6} more" if len(flag.keys) > 6 else "")
        lines.append(f"suspicious: {flag.kind}: {keys}: {flag.detail}")
    rate = report.bytes / max(report.seconds, 1e-9) / 1e6
    lines.append(f"{len(report.flags) or 'no'} suspicious finding{'s' if len(report.flags) != 1 else ''}; "
                 f"read {len(report.tensors)} tensors, {report.bytes:,} bytes in {report.seconds:.2f}s "
                 f"({rate:,.0f} MB/s, {report.threads} thread{'s' if report.threads > 1 else ''})")
    return lines


def parameter_lines(counts: dict[str, Any], show: Callable[[str], str] = str) -> list[str]:
    """The parameter count as lines: total, groups, experts, and the other tensors' elements."""
    if not counts["total"]:
        return [f"no model parameters found; {counts['other_elements']:,} elements in other tensors"]
    lines = [f"parameters: {counts['total']:,} in the model weights"
             + (f" ({counts['other_elements']:,} more elements of optimizer and other state, not counted)"
                if counts["other_elements"] else "")]
    lines += [f"  {show(group)}: {n:,}" for group, n in counts["groups"].items()]
    experts = counts["experts"]
    if experts:
        lines.append(f"  routed experts: {experts['count']} of {experts['per_expert']:,} parameters each "
                     f"(over {experts['layers']} MoE layer{'s' if experts['layers'] != 1 else ''}), "
                     f"{experts['total']:,} in all")
    return lines
