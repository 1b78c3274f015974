"""What the command line prints: names escaped, plain tables, grouped key lists, progress bars, notes,
and the reports of writes, reshard plans, verify and checksum."""

from __future__ import annotations

import io
import json
import re
import sys
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING

from dcptool.errors import counted

# rich is imported only for a bar or a note; these imports are for annotations only.
if TYPE_CHECKING:
    from dcptool.checks import checksums, loadcheck, verification
    from dcptool.planning import conversion

# What the global options ask of the output (set by the app's callback): tracebacks of errors
# (--debug) and no progress bars (--quiet).
settings = {"debug": False, "quiet": False}
# Control characters and lone surrogates, which a key read from a file may hold: shown as escapes,
# so a name cannot move the cursor, recolour the terminal or forge a line of output.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_CONTROL_OR_NEWLINE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(name: str) -> str:
    """A name from a checkpoint as one printable line: ``"a\\nb\\x1b[31m"`` for ``"a\nb\x1b[31m"``."""
    return _CONTROL_OR_NEWLINE.sub(_escape, name)


class EscapingStream(io.TextIOBase):
    """stdout or stderr with control characters escaped (newlines and tabs of our own output kept)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(_CONTROL.sub(_escape, text))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


@cache
def stderr_console():
    """The rich console on stderr, for progress bars and notes (its own escape codes must pass unescaped)."""
    from rich.console import Console

    stderr = sys.stderr.stream if isinstance(sys.stderr, EscapingStream) else sys.stderr
    return Console(file=stderr)


def notes(lines: list[str]) -> None:
    """What renaming to a naming family found and left out, on stderr (kept under --quiet: nothing is dropped without a line)."""
    for note in lines:
        stderr_console().print(shown(note), soft_wrap=True, markup=False, highlight=False)


@contextmanager
def progress(total: int, what: str):
    """A byte progress bar on a terminal, unless --quiet; yields the callback to advance it."""
    if settings["quiet"] or not sys.stderr.isatty():  # rich, imported only for a bar, costs 20 ms of start-up
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=stderr_console(), transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def aligned(header: tuple[str, ...], rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """A plain text table, columns padded to their widest cell (``right``: right-aligned columns).

    Plain text rather than a rich table: keys are never cut to the terminal's width, the lines
    grep and cut well, and 2,000 rows print in milliseconds instead of a second.
    """
    widths = [max(map(len, column)) for column in zip(header, *rows)]

    def line(cells):
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(header), *map(line, rows)]


def grouped(keys, limit: int = 12) -> str:
    """Keys as a short line: long lists are grouped by their first two parts (``optimizer.param_groups.* (230)``)."""
    keys = [shown(key) for key in keys]
    if len(keys) <= limit:
        return ", ".join(keys)
    groups: dict[str, int] = {}
    for key in keys:
        parts = key.split(".")
        group = ".".join(parts[:2]) + (".*" if len(parts) > 2 else "")
        groups[group] = groups.get(group, 0) + 1
    return ", ".join(f"{g} ({n})" if n > 1 else g for g, n in groups.items())


def written(report: conversion.Report) -> None:
    """What a writing command wrote (or, with --dry-run, would write), what it left out and why, then the notes."""
    if report.dry_run:
        files = report.planned_files
        print(f"would write {report.destination} ({report.format}): {counted(report.tensors, 'tensor')}, "
              f"{report.bytes_written:,} bytes of tensors in {counted(len(files), 'file')}: {grouped(list(files))}")
    else:
        print(f"wrote {report.destination} ({report.format}): {counted(report.tensors, 'tensor')}, "
              f"{report.bytes_written:,} bytes")
    _left_out(report)
    notes([*report.notes, *report.not_read])  # not_read: files of the source no reader used


def _left_out(report: conversion.Report) -> None:
    """One line of everything the output does not hold, grouped by why.

    ``report.dropped``: the source's entries planning did not choose, by kind; each for its reason in
    ``report.reasons``, else ``report.why_left_out``. The objects the writer could not hold
    (``report.left_out``) are said apart.
    """
    unheld = f"{report.format} cannot hold them"
    groups: dict[str, dict[str, list[str]]] = {}  # reason -> kind -> keys
    for kind, keys in report.dropped.items():
        for key in keys:
            reason = unheld if key in report.left_out else report.reasons.get(key, report.why_left_out or "not chosen")
            groups.setdefault(reason, {}).setdefault(kind, []).append(key)
    for key in report.left_out:
        if not any(key in keys for kinds in groups.values() for keys in kinds.values()):
            groups.setdefault(unheld, {}).setdefault("non-tensor entries", []).append(key)
    if groups:
        singular = {"non-tensor entries": "non-tensor entry", "optimizer tensors": "optimizer tensor", "other tensors": "other tensor"}
        said = "; ".join(", ".join(counted(len(keys), singular[kind], kind) for kind, keys in kinds.items()) + f" ({reason})"
                         for reason, kinds in groups.items())
        print(f"left out: {said}: {grouped([key for kinds in groups.values() for keys in kinds.values() for key in keys])}")


def print_plan(plan: dict, as_json: bool) -> None:
    """--dry-run of reshard: per tensor its source chunks -> target placement and chunks, the files the writer
    plans and their bytes, problems."""
    if as_json:
        print(json.dumps(plan, indent=2))
        return
    how = f"plan {plan['plan']}: {plan['plan_description']}" if plan["plan"] else \
        f"{plan['format']} lays out its data-parallel ranks itself"
    print(f"{plan['mesh']['description']} ({how})")
    if plan["plan_entries"]:
        entries = [(entry["entry"], entry["style"], str(entry["parameters"])) for entry in plan["plan_entries"]]
        print("\n".join(aligned(("plan entry", "places as", "parameters"), entries, right={2})))
    rows = [(shown(key), str(tensor["shape"]),
             tensor["placement"] + (f" (placed {tensor['placed']})" if "placed" in tensor else ""),
             f"{tensor['source_chunks']} -> {len(tensor['chunks'])}") for key, tensor in plan["tensors"].items()]
    print("\n".join(aligned(("key", "shape", "placement", "chunks"), rows, right=set())))
    if plan["objects"]:
        print(f"non-tensor entries carried over ({len(plan['objects'])}): {grouped(plan['objects'])}")
    names, sizes = list(plan["files"]), list(plan["files"].values())
    if names:
        print(f"{counted(len(sizes), 'file')} ({grouped(names)}), {min(sizes):,} to {max(sizes):,} bytes each")
    for warning in plan["warnings"]:
        print(f"warning: {warning}")
    for problem in plan["problems"]:
        print(f"problem: {problem}")
    if not plan["problems"]:
        print("no problems: run without --dry-run to write it")


def print_verify(report: verification.Report, show_all: bool = False) -> None:
    """verify's text report: the two sides, each difference (long lists grouped unless ``show_all``) and
    near-equal tensor, what was left out and not compared, a layout difference, then the summary."""
    print(f"A: {report.a}\nB: {report.b}")
    if show_all or len(report.differences) <= FOLD_DIFFERENCES:
        for difference in report.differences:
            print(f"{difference.kind:<8} {shown(difference.key)}: {difference.detail}")
    else:
        print("\n".join(grouped_differences(report.differences)))
    differing = {d.key for d in report.differences}
    for key, (most_abs, most_rel) in report.closeness.items():
        if key not in differing and (most_abs or most_rel):
            print(f"{'close':<8} {shown(key)}: max abs {most_abs:.3g}, max rel {most_rel:.3g}")
    for key, (most_abs, relative) in report.quantized.items():
        if key not in differing:
            print(f"{'quantized':<8} {shown(key)}: dequantized error max abs {most_abs:.3g}, "
                  f"relative L2 {relative:.3g}")
    if report.left_out:
        print(f"left out ({report.left_out_why}): {counted(len(report.left_out), 'entry', 'entries')}: "
              f"{grouped(report.left_out)}")
    if report.not_compared:
        print(f"non-tensor entries not compared (not plain data): {grouped(report.not_compared)}")
    print(report.summary())
    side = report.dtype_hint
    if side and not report.dtype_as:
        other = "B" if side == "a" else "A"
        print(f"every difference is a dtype difference: --dtype-as {side.upper()} compares {other} cast to "
              f"{side.upper()}'s dtypes (bitwise, rounding as torch does), --atol/--rtol within tolerances")


# More differences than this are grouped (verify --all lists each).
FOLD_DIFFERENCES = 20


def grouped_differences(differences) -> list[str]:
    """Differences grouped as inspect folds layers: by kind (and detail, where keys share it: "tensor only
    in A", "A float32, B bfloat16"), then by what all keys of the group share, at least their first two parts
    (``dcp.optim.state.* (63 missing)``, ``model.layers.* (18 dtype)``)."""
    from dcptool.checks import stats

    clusters: dict[tuple[str, str], list] = {}
    for difference in differences:
        shared = difference.kind in ("missing", "extra", "dtype")
        clusters.setdefault((difference.kind, difference.detail if shared else ""), []).append(difference)
    lines = []
    for (kind, detail), members in clusters.items():
        if len(members) <= 3:
            lines += [f"{kind:<8} {shown(d.key)}: {d.detail}" for d in members]
            continue
        parts = [d.key.split(".") for d in members]
        common = 0
        while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
            common += 1
        depth = max(common, 2)  # what the group shares, at least its root and the part below (optimizer.state)
        by_prefix: dict[str, list] = {}
        for difference, key_parts in zip(members, parts):
            prefix = ".".join(key_parts[:depth]) + (".*" if len(key_parts) > depth else "")
            by_prefix.setdefault(prefix, []).append(difference)
        for name, prefixes in stats.folded_rows(list(by_prefix), lambda prefix: ()):
            group = [d for prefix in prefixes for d in by_prefix[prefix]]
            said = detail or (f"first {shown(group[0].key)}: {group[0].detail}" if len(group) > 1 else group[0].detail)
            what = f"{shown(name)} ({len(group)} {kind})" if len(group) > 1 else shown(group[0].key)
            lines.append(f"{kind:<8} {what}: {said}")
    return lines + ["(--all lists every difference, --json gives each)"]


def print_load_check(path: str, report: loadcheck.Report) -> None:
    """verify --load-on's text report: the job's timing, then each rank's outcome and failures."""
    load = f"{report.load_seconds:.2f} s" if report.load_seconds is not None else "did not finish"
    print(f"{path}: {counted(report.nproc, 'rank')} ({report.backend}), dcp.load {load}")
    for result in report.ranks:
        state = "error" if result.error else ("FAIL" if result.failures else "ok")
        print(f"rank {result.rank}: {state}, {counted(result.tensors, 'tensor')} checked" + (f"; {result.error}" if result.error else ""))
        for failure in result.failures:
            print(f"  {failure['key']}: {failure['reason']}")
    if report.missing_ranks:
        print(f"no result from ranks {report.missing_ranks}" + (f": {report.problem}" if report.problem else ""))


def print_checksum(result: checksums.Result) -> None:
    """checksum's text report: each problem, then what was written or found intact."""
    for problem in result.problems:
        print(f"{problem.kind:<17} {shown(problem.name)}: {problem.detail}")
    rate = f"{result.bytes_hashed / max(result.seconds, 1e-9) / 1e6:,.0f} MB/s"
    if result.action == "write":
        print(f"wrote {result.manifest}: {counted(result.files, 'file')} and {counted(result.tensors, 'tensor')} hashed "
              f"({result.bytes_hashed:,} bytes in {result.seconds:.2f}s, {rate})")
    elif result.ok and result.action == "check":
        print(f"{result.path}: intact, {counted(result.files, 'file')} match {result.manifest}")
    elif result.ok:
        print(f"{result.path}: {counted(result.tensors, 'tensor')} match {result.manifest}")
