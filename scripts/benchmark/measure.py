"""Measuring a run: wall time, CPU time and the peak memory of its whole process tree; the warm page cache
every run starts from; removing outputs."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from benchmark import REPO

SAMPLE_S = 0.02  # RSS sampling period
PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (none once it is gone)."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all of its descendants, summed."""
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _rss(pid)
        todo += _children(pid)
    return total


class Sampler(threading.Thread):
    """Samples the process tree of ``pid`` every SAMPLE_S seconds until ``done`` is set; ``peak``: the most
    it held."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self.done.wait(SAMPLE_S)


def measure(argv: list[str], log: Path, timeout: float) -> tuple[float, float, int, int]:
    """Run argv; return (wall seconds, CPU seconds of the tree, peak tree RSS bytes, exit code)."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        killer.cancel()
        sampler.done.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime  # the child and every descendant it waited for
    return wall, cpu, max(sampler.peak, usage.ru_maxrss * 1024), proc.returncode


def warm(paths: list[Path]) -> None:
    """Read every file once so that the timed run finds it in the page cache."""
    buf = bytearray(8 << 20)
    for path in paths:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def remove(path: Path) -> None:
    """Remove a file or a folder, if there is one."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
