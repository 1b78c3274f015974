"""Executing a conversion: every piece's bytes go from the source chunks to their place in an output file.

Writers fix where each piece's bytes go before any is written (``Writer.place``), so the work is cut
into tasks of bounded size that a few threads run in any order: reading (``preadv``), copying
(numpy), checksumming (zlib-ng's ``crc32``) and writing (``pwrite``) all release the GIL, so the threads
keep the disk and the cores busy together. A task whose bytes are one run in a source file and one
run in the output is copied by the kernel (``os.copy_file_range``), as ``cp`` does, unless its CRC-32 is
wanted: then it is read, checksummed and written a cache-sized window at a time, which costs no more CPU
than the kernel copy alone. The CRC-32 of a run serves twice: a zip-based output stores it, and the source
record's stored CRC-32 is checked against the runs that cover it (``torch_archive.records``). Every other task is assembled in a
buffer owned by its thread and reused for the whole run; all buffers together stay within ``max_memory``.

>>> crcs = copy_pieces(checkpoint, [(piece, "model.safetensors", 4096)], out, crc=False)   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import errno
import gc
import math
import os
import queue
import signal
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
from zlib_ng.zlib_ng import (  # zlib-ng's CRC-32 runs at 17 GB/s, zlib's at 3
    crc32,
    crc32_combine,
)

from dcptool import dtypes, encodings
from dcptool.engine.chunks import Chunk, ChunkTable
from dcptool.engine.core import Checkpoint, Piece
from dcptool.engine.reading import is_contiguous, overlapping
from dcptool.errors import CheckpointError
from dcptool.sizes import check_memory_budget
from dcptool.storage import OutputFiles, deferred_interrupts
from dcptool.torch_archive import row_major
from dcptool.torch_archive.records import record_checks

# Threads moving bytes: beyond the cores, extra threads still overlap waiting on the disk.
IO_THREADS = min(8, 2 * (os.cpu_count() or 1))
# The largest task: progress and checks on the other ranks come at least this often.
TASK_BYTES = 64 * 2**20
# The most a task assembled in a buffer holds: its bytes are still in the core's cache when written out
# (32 MB slabs made the write from them cost three times the read into them).
SLAB_BYTES = 2 * 2**20
# Source runs shorter than this on average are read into a slab rather than copied run by run: the
# system calls and CRC-32s of a copy per run cost more than the bytes.
SMALL_RUN = 2**20
# Runs shorter than this are read and written through the thread's window even when no CRC-32 is wanted:
# a kernel copy costs more than such bytes (chunks of a thousand ranks are a few KB each).
KERNEL_COPY_RUN = 2**18
# Bytes of a run copied through the thread's window at a time (read, checksummed when wanted, written): they
# stay in the core's cache throughout (larger windows made the write cost up to five times the read).
COPY_WINDOW = 2**18
# The most one kernel copy moves while it holds the output file (a whole record may be gigabytes).
KERNEL_COPY_STEP = 16 * 2**20
_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>
# copy_file_range cannot copy between these filesystems or files: fall back to read and write.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}
# Errors of the output's side: a copy that fails with one of these names the output file alone.
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
# Once stopped (a failure, Ctrl-C), how long to wait for the threads to finish the task each has.
JOIN_SECONDS = 30.0


@dataclass(frozen=True)
class Task:
    """Bytes of one piece: where they go, and either a run of source bytes or a slab to assemble."""

    piece: Piece
    index: int  # its place among the piece's tasks: CRC-32s combine in this order
    file: str  # the output file
    offset: int  # where its bytes start in that file
    nbytes: int
    source: tuple[str, int] | None = None  # (file, offset) of source bytes copied as they are
    region: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # else (offsets, sizes) within the piece
    chunk: Chunk | None = None  # the source chunk the copied bytes lie in (its record's CRC-32 is checked over them)


def copy_pieces(checkpoint: Checkpoint, placed: list[tuple[Piece, str, int]], out: OutputFiles, *, crc: bool,
                max_memory: int, flush: bool = False, threads: int = IO_THREADS,
                on_bytes: Callable[[int], None] | None = None) -> dict[Piece, int]:
    """Write every ``(piece, file, offset)``; returns the CRC-32 of each piece's bytes when ``crc``.

    ``flush`` starts writing each task's bytes to disk as soon as they are written (the caller
    fsyncs at the end, which then has little left to wait for). ``on_bytes`` is called from this
    thread as tasks finish (progress, and checks on the other ranks, which may raise to stop the work).
    """
    check_memory_budget(max_memory)
    largest = max((piece.nbytes for piece, _, _ in placed), default=0)
    threads = max(1, min(threads, len(placed)))
    # Two buffers per thread (a slab and its reads), none larger than the work needs.
    buffer_bytes = max(2**15, min(max_memory // (2 * threads), 3 * largest))
    tasks = _across_files([task for piece, file, offset in placed
                           for task in plan_tasks(checkpoint, piece, file, offset, min(TASK_BYTES, buffer_bytes))])
    jobs = _in_order(tasks)
    mover = _Mover(checkpoint, out, crc, buffer_bytes, _start_writeback() if flush else None)
    parts: dict[Piece, list[tuple[int, int, int]]] = {piece: [] for piece, _, _ in placed}
    report = on_bytes or (lambda n: None)
    collecting = gc.isenabled()
    gc.disable()  # tasks and their results hold no cycles; collections would walk the whole plan again and again
    try:
        with _Workers(mover.run, jobs, threads) as finished:
            for task, value in finished:
                parts[task.piece].append((task.index, value, task.nbytes))
                report(task.nbytes)
        for read in [checkpoint, *computed_sources(piece for piece, _, _ in placed)]:
            checks = record_checks(read.files)
            if checks is not None:
                checks.finish()  # the records the tasks read only in part
    finally:
        if collecting:
            gc.enable()
    if not crc:
        return {}
    result = {}
    for piece, found in parts.items():
        (_, value, _), *rest = sorted(found) or [(0, 0, 0)]
        for _, part_crc, nbytes in rest:
            value = crc32_combine(value, part_crc, nbytes)
        result[piece] = value
    return result


def computed_sources(pieces) -> list[Checkpoint]:
    """The checkpoints other than the source that computed tensors among ``pieces`` read (an average's)."""
    found: dict[int, Checkpoint] = {}
    for piece in pieces:
        transform = piece.tensor.source.transform
        if transform is not None:
            found.update((id(other), other) for other in transform.others())
    return list(found.values())


def _in_order(tasks: list[Task]) -> list[list[Task]]:
    """The tasks as jobs a thread runs in turn. Records read front to back (zstd streams) are read in order by
    one thread, each read resuming the stream where the one before stopped (on threads of their own, each would
    decompress from the record's start again): the tasks that copy bytes of one such record form one job, in
    the order of those bytes, and so do the tasks that assemble slabs of one tensor stored in such records."""
    jobs: list[list[Task]] = []
    ordered: dict[object, list[Task]] = {}
    streamed: dict[int, bool] = {}
    for task in tasks:
        key = _stream_of(task, streamed)
        if key is None:
            jobs.append([task])
        elif key in ordered:
            ordered[key].append(task)
        else:
            ordered[key] = [task]
            jobs.append(ordered[key])
    for job in ordered.values():
        job.sort(key=lambda task: task.source[1] if task.source is not None else
                 tuple(p + r for p, r in zip(task.piece.offsets, task.region[0])))
    return jobs


def _stream_of(task: Task, streamed: dict[int, bool]) -> object | None:
    """What ``task`` reads front to back: its source record, or the tensor its slab is assembled from; None
    when it reads only records that allow reads anywhere. ``streamed``: whether each source tensor's records are
    read front to back, by ``id``, filled as tensors are met (a tensor of a million chunks has many slabs)."""
    if task.source is not None:
        return task.source[0] if _front_to_back([task.chunk]) else None
    source = task.piece.tensor.source
    found = streamed.get(id(source))
    if found is None:
        found = streamed[id(source)] = _front_to_back(source.chunks)
    return id(source) if found else None


def _front_to_back(chunks: list[Chunk] | ChunkTable) -> bool:
    """Whether any of ``chunks`` is stored in a record read front to back (``encodings.Encoding.front_to_back``)."""
    names = {chunks.encoding} if isinstance(chunks, ChunkTable) else \
        {(chunk.view.base if chunk.view is not None else chunk).encoding for chunk in chunks}
    return any(encoding is not None and encoding.front_to_back for encoding in map(encodings.get, names))


def _across_files(tasks: list[Task]) -> list[Task]:
    """The tasks of each output file in their order, the files taken in turn: threads that write different
    files at once do not queue on one file's lock."""
    by_file: dict[str, deque[Task]] = {}
    for task in tasks:
        by_file.setdefault(task.file, deque()).append(task)
    files, ordered = list(by_file.values()), []
    while files:
        ordered += [pending.popleft() for pending in files]
        files = [pending for pending in files if pending]
    return ordered


class _Workers:
    """Threads running jobs (lists of tasks, run in turn); ``with _Workers(run, jobs, n) as finished:``
    iterates ``(task, result)``.

    Stopping is safe wherever it comes from (a task's error, raised here; the caller's, e.g. another
    rank failed; Ctrl-C, at any instant): the main thread waits only on a ``SimpleQueue``, which an
    interrupt cannot leave locked (``concurrent.futures.wait`` can: it takes every future's lock in
    turn, and the workers then block on them for ever); a Ctrl-C tells the workers to stop before
    it is raised; they take no task once told, and are joined with a bound (each finishes the task
    it has, at most ``TASK_BYTES``). They are daemons: one stuck in the kernel past the bound cannot
    keep the process from exiting.
    """

    def __init__(self, run: Callable[[Task], int], jobs: list[list[Task]], threads: int):
        self._run, self._count, self._wanted = run, sum(map(len, jobs)), max(1, min(threads, len(jobs)))
        self._jobs = deque(jobs)
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Iterator[tuple[Task, int]]:
        self._interrupts = _stopping_on_interrupt(self._stop)
        self._interrupts.__enter__()
        try:
            for number in range(self._wanted):
                thread = threading.Thread(target=self._work, name=f"dcptool-io-{number}", daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self._finished()

    def _finished(self) -> Iterator[tuple[Task, int]]:
        for _ in range(self._count):
            task, value, error = self._results.get()
            if error is not None:
                raise error
            yield task, value

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.popleft()
            except IndexError:
                return
            for task in job:
                if self._stop.is_set():
                    return
                try:
                    self._results.put((task, self._run(task), None))
                except BaseException as exc:
                    self._stop.set()
                    self._results.put((task, None, exc))
                    return

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        try:
            with deferred_interrupts():  # a second Ctrl-C waits until the threads are stopped
                deadline = time.monotonic() + JOIN_SECONDS
                for thread in self._threads:
                    thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            self._interrupts.__exit__(None, None, None)


@contextmanager
def _stopping_on_interrupt(stop: threading.Event) -> Iterator[None]:
    """While it lasts, Ctrl-C sets ``stop`` before the usual handler raises (in the main thread)."""
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if not callable(previous):
        yield
        return

    def handler(signum, frame):
        stop.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def plan_tasks(checkpoint: Checkpoint, piece: Piece, file: str, offset: int, task_bytes: int) -> list[Task]:
    """The tasks that write ``piece`` at ``offset`` of ``file``, each of at most ``task_bytes``."""
    runs = source_runs(checkpoint, piece)
    if runs is not None and len(runs) > 1 and piece.nbytes < SMALL_RUN * len(runs):
        runs = None  # many small runs (chunks of a thousand ranks): read into a slab, one read each
    tasks: list[Task] = []
    if runs is not None:
        for start, source_file, source_offset, length, chunk in runs:
            for step in range(0, length, task_bytes):
                size = min(task_bytes, length - step)
                tasks.append(Task(piece, len(tasks), file, offset + start + step, size,
                                  source=(source_file, source_offset + step), chunk=chunk))
        return tasks
    itemsize = dtypes.dtype(piece.tensor.dtype).itemsize
    strides = row_major(piece.sizes)
    source_itemsize = dtypes.dtype(piece.tensor.source.dtype).itemsize
    cast = piece.tensor.source.dtype != piece.tensor.dtype
    per_element = source_itemsize + (itemsize if cast else 0)  # a cast allocates its result beside the buffer
    transform = piece.tensor.source.transform
    if transform is not None:  # and a computation its temporaries
        per_element += transform.work_bytes
    elements = max(1, min(task_bytes, SLAB_BYTES) // per_element)
    rows = transform.rows_together if transform is not None and len(piece.sizes) >= 2 else 1
    if rows > 1:  # slabs of whole blocks of rows (``Computed.rows_together``), where a task holds one
        elements = max(elements, min(rows * piece.sizes[-1], task_bytes // per_element))
    for offsets, sizes in slabs(piece.sizes, elements, rows):
        start = sum(o * s for o, s in zip(offsets, strides)) * itemsize
        tasks.append(Task(piece, len(tasks), file, offset + start, math.prod(sizes) * itemsize,
                          region=(offsets, sizes)))
    return tasks


def source_runs(checkpoint: Checkpoint, piece: Piece) -> list[tuple[int, str, int, int, Chunk]] | None:
    """``(start in piece, source file, source offset, length, chunk)`` of every source run, in bytes, when
    the piece is the concatenation of contiguous runs of source bytes (no cast, no reordering);
    else None. Dim-0 shards (FSDP) and whole chunks are; a column block of a TP row-wise weight is not.
    ``chunk`` is the source chunk the run lies in.
    """
    source = piece.tensor.source
    if source.dtype != piece.tensor.dtype or source.transform is not None:  # computed values are no source bytes
        return None
    itemsize = dtypes.dtype(source.dtype).itemsize
    piece_strides = row_major(piece.sizes)
    runs = []
    for chunk in overlapping(source, piece.offsets, piece.sizes):
        lo = [max(o, c) for o, c in zip(piece.offsets, chunk.offsets)]
        hi = [min(o + s, c + n) for o, s, c, n in zip(piece.offsets, piece.sizes, chunk.offsets, chunk.sizes)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        extent = [h - l for l, h in zip(lo, hi)]
        raw = checkpoint.raw_bytes(source, chunk)
        if not (is_contiguous(extent, raw.strides) and is_contiguous(extent, piece_strides)):
            return None
        source_offset = raw.offset + sum((l - c) * s for l, c, s in zip(lo, chunk.offsets, raw.strides)) * itemsize
        start = sum((l - o) * s for l, o, s in zip(lo, piece.offsets, piece_strides)) * itemsize
        length = math.prod(extent) * itemsize
        runs.append((start, raw.file, source_offset, length, chunk))
    return sorted(runs, key=lambda run: run[0])


def slabs(sizes: tuple[int, ...], max_elements: int, rows: int = 1):
    """Split a region into row-major contiguous sub-regions of at most ``max_elements`` elements, in order; those
    of its matrices (the last two dims) hold a multiple of ``rows`` rows where they hold more than that.

    >>> list(slabs((4, 3), 6))
    [((0, 0), (2, 3)), ((2, 0), (2, 3))]
    >>> [sizes for _, sizes in slabs((7, 3), 12, rows=3)]
    [(3, 3), (3, 3), (1, 3)]
    """
    if math.prod(sizes) <= max_elements or not sizes:
        yield tuple(0 for _ in sizes), tuple(sizes)
        return
    inner = math.prod(sizes[1:])
    if inner <= max_elements:
        step = max(1, max_elements // max(inner, 1))
        if len(sizes) == 2 and step > rows:
            step -= step % rows
        for start in range(0, sizes[0], step):
            yield (start,) + tuple(0 for _ in sizes[1:]), (min(step, sizes[0] - start),) + tuple(sizes[1:])
        return
    for index in range(sizes[0]):
        for offsets, sub in slabs(sizes[1:], max_elements, rows):
            yield (index,) + offsets, (1,) + sub


class _Mover:
    """Runs tasks; each thread gets its own two buffers on first use (fresh memory is touched only as used)."""

    def __init__(self, checkpoint: Checkpoint, out: OutputFiles, crc: bool, buffer_bytes: int,
                 start_writeback: Callable[[int, int, int], None] | None):
        self.checkpoint, self.out, self.crc, self.buffer_bytes = checkpoint, out, crc, buffer_bytes
        self.start_writeback = start_writeback
        self._local = threading.local()

    def _window(self) -> memoryview:
        local = self._local
        if not hasattr(local, "window"):
            local.window = memoryview(bytearray(COPY_WINDOW))
        return local.window

    def _buffers(self) -> tuple[np.ndarray, memoryview]:
        local = self._local
        if not hasattr(local, "slab"):
            local.slab = np.empty(self.buffer_bytes, np.uint8)
            local.scratch = memoryview(np.empty(self.buffer_bytes, np.uint8)).cast("B")
        return local.slab, local.scratch

    def run(self, task: Task) -> int:
        """Write the task's bytes; returns their CRC-32 (0 when not wanted)."""
        crc = self._write(task)
        if self.start_writeback:
            self.start_writeback(self.out.fd(task.file), task.offset, task.nbytes)
        return crc

    def _write(self, task: Task) -> int:
        files = self.checkpoint.files
        if task.source is None:
            data = self._assemble(task)
            self.out.write_at(task.file, task.offset, data)
            return crc32(data) if self.crc else 0
        file, source_offset = task.source
        files.check_range(file, source_offset, task.nbytes)
        stored = self.checkpoint.record_of(task.piece.tensor.source, task.chunk) if task.chunk is not None else None
        checksum = self.crc or stored is not None
        # Bytes to checksum pass through a window the core's cache holds (``_copy_through_window``); a kernel
        # copy, then reading its output back to checksum it, costs a third more CPU.
        crc = None
        if not checksum and task.nbytes >= KERNEL_COPY_RUN:
            source_fd = files.local_fd(file)
            crc = self._kernel_copy(source_fd, task) if source_fd is not None else None
        if crc is None:
            crc = self._copy_through_window(task, checksum)
        if stored is not None:
            record_checks(files).add_part(stored, task.piece.tensor.source.key, source_offset, task.nbytes, crc)
        return crc if self.crc else 0

    def _kernel_copy(self, source_fd: int, task: Task) -> int | None:
        """Copy the run inside the kernel; 0, or None where the filesystems cannot."""
        file, source_offset = task.source
        done = 0
        while done < task.nbytes:
            try:
                with self.out.writing(task.file) as target_fd:
                    copied = os.copy_file_range(source_fd, target_fd, min(task.nbytes - done, KERNEL_COPY_STEP),
                                                source_offset + done, task.offset + done)
            except OSError as exc:
                if exc.errno in _NO_KERNEL_COPY and done == 0:
                    return None
                operation = "writing" if exc.errno in _FULL else f"copying {self.checkpoint.files.path(file)} to"
                raise self.out.failed(exc, task.file, task.offset + done, operation) from None
            if copied == 0:
                raise CheckpointError(f"{self.checkpoint.files.path(file)}: file shrank while reading at byte "
                                      f"{source_offset + done}")
            done += copied
        return 0

    def _copy_through_window(self, task: Task, checksum: bool) -> int:
        """Copy the run a window at a time (read, checksum, write); its CRC-32 (0 unless ``checksum``). The
        window stays in the core's cache from the read to the write: this costs the CPU of a kernel copy alone
        (0.115 s for 0.5 GB here, 0.12 for ``copy_file_range``, 0.15 for it and reading the output back to
        checksum; 256 KB windows beat 64 KB and 1 MB ones)."""
        files, (file, source_offset) = self.checkpoint.files, task.source
        window, crc = self._window(), 0
        for step in range(0, task.nbytes, len(window)):
            data = window[:min(len(window), task.nbytes - step)]
            files.read_into(file, source_offset + step, data)
            if checksum:
                crc = crc32(data, crc)
            self.out.write_at(task.file, task.offset + step, data)
        return crc

    def _assemble(self, task: Task) -> memoryview:
        piece = task.piece
        source = piece.tensor.source
        offsets, sizes = task.region
        region = tuple(o + p for o, p in zip(offsets, piece.offsets))
        values = self.checkpoint.region_in(source, region, sizes, *self._buffers(), passing=True)
        if source.dtype != piece.tensor.dtype:
            values = dtypes.cast(values, source.dtype, piece.tensor.dtype)
        return memoryview(values.reshape(-1)).cast("B")


def _start_writeback() -> Callable[[int, int, int], None] | None:
    """Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which starts writing a range to disk and
    returns at once (the os module has no binding for it); None elsewhere. It is only a hint."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return lambda fd, offset, nbytes: function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
