"""Scale out under torchrun: every rank plans the same output and writes its share of the files.

Under ``torchrun`` (``WORLD_SIZE`` > 1 with ``RANK`` and ``MASTER_ADDR`` set), ``convert.write_checkpoint``
splits the work by output file: every rank plans identically, writes only the files
``assign_files`` gives it (reading only what they need), and rank 0 writes the metadata or index
from the records the others send it, fsyncs and renames the output into place. The result is the
same, byte for byte, as one process writing it all. Only then is torch imported: a gloo process
group carries the few small messages (the temporary folder's path, the records), and the
rendezvous store carries failures and progress.

A rank that fails publishes its error; the others notice it within a fraction of a second (between
tasks, or while waiting), stop, and raise ``RankFailed`` with its message and exit code; rank 0
removes the temporary folder. Collectives start only once every rank has arrived, so
``COLLECTIVE_TIMEOUT`` bounds them however long the writing takes.

>>> assign_files({"__0_0.distcp": 300, "__1_0.distcp": 200, "__2_0.distcp": 200}, world_size=2)
{'__0_0.distcp': 0, '__1_0.distcp': 1, '__2_0.distcp': 1}
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

from dcptool import storage
from dcptool.errors import DcptoolError, UsageError
from dcptool.storage import Interrupted, atomic_output

COLLECTIVE_TIMEOUT = timedelta(minutes=10)
CHECK_SECONDS = 0.1  # how often a writing rank reports its bytes and looks for failures of others
REPORT_WAIT = timedelta(minutes=1)  # how long a failed rank waits for rank 0 to print the error
EXIT_GRACE = 2.0  # then how long it leaves rank 0 to exit first


def under_torchrun() -> bool:
    """True in a process that torchrun (or a launcher setting the same variables) started as one of several ranks."""
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world_size > 1 and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def assign_files(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """The rank that writes each file, balanced by bytes and the same on every rank.

    Largest file first, each to the rank with the fewest bytes so far (ties: the lower rank, then
    the file name), so a single-file output always goes to rank 0.

    >>> assign_files({"a": 10, "b": 6, "c": 5, "d": 1}, world_size=2)
    {'a': 0, 'b': 1, 'c': 1, 'd': 0}
    """
    loads = [0] * world_size
    owners = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += sizes[name]
    return owners


class RankFailed(DcptoolError):
    """Another rank of the job failed; carries its message and exit code (``rank`` names it)."""

    def __init__(self, message: str, exit_code: int, rank: int):
        super().__init__(message)
        self.exit_code, self.rank = exit_code, rank


class _RemoteTraceback(Exception):
    """The traceback of the rank that failed, shown as the cause with ``--debug``."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


INTERRUPTS = (KeyboardInterrupt, Interrupted)
EXIT_INTERNAL = 3  # a bug in dcptool (1: a check found a difference, 2: bad input, 130: interrupted)
BUG_HINT = "a bug in dcptool: please report it; rerun with --debug for the traceback"


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """The exit code and one-line message the CLI gives an exception.

    >>> describe_failure(ZeroDivisionError("division by zero"))
    (3, 'internal error: ZeroDivisionError: division by zero')
    """
    if isinstance(exc, DcptoolError):
        return exc.exit_code, str(exc)
    if _caused_by_interrupt(exc):
        return 130, _interrupted()
    if isinstance(exc, OSError):
        return 2, _os_error(exc)
    return EXIT_INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _caused_by_interrupt(exc: BaseException | None) -> bool:
    """An interrupt, or an error raised by one (Python wraps an error in ``__set_name__`` as RuntimeError)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, INTERRUPTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _interrupted() -> str:
    """What an interrupt left: the output being written is not there (its temporary is removed)."""
    state = storage.output_state()
    if state is None:
        return "interrupted"
    destination, in_place = state
    return f"interrupted after {destination} was written" if in_place else f"interrupted; {destination} not written"


def _os_error(exc: OSError) -> str:
    """``writing OUT/model-00002-of-00004.safetensors at byte 1,024: No space left on device``."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    operation = getattr(exc, "dcptool_operation", None)
    if operation:
        return f"{operation} {exc.filename}{getattr(exc, 'dcptool_where', '')}: {reason}"
    if exc.filename is not None and exc.filename2 is not None:
        return f"{exc.filename} -> {exc.filename2}: {reason}"
    if exc.filename is not None:
        return f"{exc.filename}: {reason}"
    return reason


# ---------------------------------------------------------------------------------------------
# The group of ranks (one per process, joined on first use)


class Group:
    """This process's place among the ranks: the rendezvous store now, a gloo process group once needed."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _, _ = next(dist.rendezvous("env://", timeout=COLLECTIVE_TIMEOUT))
        self.store = dist.PrefixStore("dcptool", store)
        self.jobs = 0  # writes started; every rank starts the same ones in the same order
        self._process_group = None

    def process_group(self):
        """A gloo group for the small messages (its own one when the job already has a group, e.g. NCCL's).

        Made only after every rank has arrived at a sync point, as it is itself a collective.
        """
        if self._process_group is None:
            dist = self.dist
            if dist.is_initialized():
                self._process_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
            else:
                dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
                self._process_group = dist.group.WORLD
            atexit.register(self._destroy)
        return self._process_group

    def _destroy(self) -> None:
        """Destroy the group while the interpreter is alive: gloo's threads, still holding the last
        collective's tensors, abort the process if the group outlives interpreter shutdown."""
        if self.dist.is_initialized():  # unless the job already tore its groups down
            self.dist.destroy_process_group(self._process_group)
        self._process_group = None  # the last reference: its destructor joins gloo's threads now

    def job_store(self, index: int):
        return self.dist.PrefixStore(f"job{index}", self.store)

    def publish_failure(self, index: int, exc: BaseException) -> None:
        """Tell the ranks in write ``index`` that this rank failed (once per error; not for ``RankFailed``)."""
        if isinstance(exc, RankFailed) or getattr(exc, "_dcptool_published", False):
            return
        exc._dcptool_published = True
        code, message = describe_failure(exc)
        details = "".join(traceback.format_exception(exc))
        store = self.job_store(index)
        number = store.add("failures", 1)
        store.set(f"failure{number}", json.dumps([self.rank, code, message, details]))


_group: Group | None = None


def join() -> Group:
    """This process's ``Group``, made on first use (imports torch.distributed)."""
    global _group
    if _group is None:
        _group = Group()
    return _group


# ---------------------------------------------------------------------------------------------
# One write, split across ranks or not


class OneProcess:
    """This process writes every file (no torchrun, or ``across_ranks=False``)."""

    rank, world_size = 0, 1

    def __init__(self, progress: Callable[[int], None] | None = None):
        self.progress = progress or (lambda n: None)

    def output(self, destination: Path, overwrite: bool, is_dir: bool, prepare: Callable[[], None] | None = None):
        """The temporary sibling of ``destination`` (see ``Ranks.output``); ``prepare`` runs first."""
        if prepare:
            prepare()
            return _staging(destination, is_dir)
        return atomic_output(destination, overwrite, is_dir)

    def my_files(self, sizes: dict[str, int]) -> set[str]:
        return set(sizes)

    def wrote(self, nbytes: int) -> None:
        self.progress(nbytes)

    def gather(self, records: Any) -> list[Any]:
        return [records]

    def from_rank_zero(self, value: Any) -> Any:
        return value


@contextmanager
def _staging(destination: Path, is_dir: bool) -> Iterator[Path]:
    """A private local staging place, uploaded from and then deleted: no rename into place needed."""
    if is_dir:
        destination.mkdir(parents=True)
    yield destination


class Ranks:
    """One write shared by the ranks of a torchrun job; every rank makes the same calls in the same order.

    ``convert.write_checkpoint`` drives it (``OneProcess`` has the same methods, for one process)::

        with ranks.output(destination, overwrite, is_dir=True) as temporary:   # made by rank 0
            mine = ranks.my_files(writer.files())          # this rank's share of the files
            ...                                            # write them, telling ranks.wrote(n)
            every_rank = ranks.gather(records)             # rank 0: every rank's records; others: None
        left_out = ranks.from_rank_zero(left_out)          # once the output is in place
    """

    def __init__(self, group: Group, progress: Callable[[int], None] | None = None):
        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.index = group.jobs
        group.jobs += 1
        self.store = group.job_store(self.index)
        self.progress = progress if self.rank == 0 and progress else (lambda n: None)
        self._syncs = 0
        self._unreported = 0  # bytes this rank wrote since it last told the store
        self._shown = 0  # bytes of all ranks shown to ``progress`` (rank 0)
        self._next_check = 0.0

    @contextmanager
    def output(self, destination: Path, overwrite: bool, is_dir: bool,
               prepare: Callable[[], None] | None = None) -> Iterator[Path]:
        """The temporary sibling of ``destination`` that rank 0 creates and renames into place on success.

        Every rank must name the same ``destination``; the folder must be one all ranks see (for
        several nodes, a shared filesystem). Any rank's failure is published to the others.
        With ``prepare`` (a remote destination, staged locally: ``convert._Upload``) each rank writes
        into a temporary folder of its own instead, once rank 0 has run ``prepare``.
        """
        try:
            if prepare:
                if self.rank == 0:
                    prepare()
                self._broadcast(None)
                with _staging(destination, is_dir) as temporary:
                    yield temporary
            elif self.rank == 0:
                with atomic_output(destination, overwrite, is_dir) as temporary:
                    self._broadcast((os.path.abspath(destination), temporary))
                    yield temporary
            else:
                expected, temporary = self._broadcast(None)
                if expected != os.path.abspath(destination):
                    raise UsageError(f"{destination}: under torchrun every rank writes the same output, and rank 0 "
                                     f"writes {expected} (pass across_ranks=False to write alone)")
                with storage.showing(temporary, destination):  # errors name destination/FILE
                    yield temporary
        except BaseException as exc:
            self.group.publish_failure(self.index, exc)
            raise

    def my_files(self, sizes: dict[str, int]) -> set[str]:
        """The files this rank writes (``assign_files``)."""
        return {name for name, rank in assign_files(sizes, self.world_size).items() if rank == self.rank}

    def wrote(self, nbytes: int) -> None:
        """Count bytes written; now and then report them and stop (``RankFailed``) if another rank failed."""
        self._unreported += nbytes
        if time.monotonic() >= self._next_check:
            self._check()

    def gather(self, records: Any) -> list[Any] | None:
        """Every rank's ``records`` on rank 0, once all have finished writing (None on the others)."""
        self._sync()
        gathered = [None] * self.world_size if self.rank == 0 else None
        self.group.dist.gather_object(records, gathered, dst=0, group=self.group.process_group())
        return gathered

    def from_rank_zero(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank; the others wait here until rank 0 has finished the output."""
        return self._broadcast(value)

    def _broadcast(self, value: Any) -> Any:
        self._sync()
        box = [value]
        self.group.dist.broadcast_object_list(box, src=0, group=self.group.process_group())
        return box[0]

    def _check(self) -> None:
        self._report_bytes()
        self._raise_if_failed()

    def _report_bytes(self) -> None:
        """Add this rank's new bytes to the job's count; rank 0 shows the count of all ranks."""
        total = self.store.add("bytes", self._unreported)
        self._unreported = 0
        self.progress(total - self._shown)
        self._shown = total
        self._next_check = time.monotonic() + CHECK_SECONDS

    def _raise_if_failed(self) -> None:
        if self.store.add("failures", 0):
            rank, code, message, details = json.loads(self.store.get("failure1"))
            where = f" (on rank {rank} of {self.world_size})" if rank != self.rank else ""
            raise RankFailed(message + where, code, rank) from _RemoteTraceback(details)

    def _sync(self) -> None:
        """Wait until every rank has arrived here, or raise ``RankFailed`` as soon as one has failed.

        Waiting on the store rather than in a collective: the wait lasts as long as the slowest
        rank's share of the work, which no fixed timeout fits.
        """
        self._syncs += 1
        arrived = f"arrived{self._syncs}"
        self.store.add(arrived, 1)
        pause = 0.001
        while self.store.add(arrived, 0) < self.world_size:
            self._check()
            time.sleep(pause)
            pause = min(pause * 2, CHECK_SECONDS)
        self._report_bytes()


def ranks_for(progress: Callable[[int], None] | None = None, across_ranks: bool | None = None) -> OneProcess | Ranks:
    """How one write is shared: across the ranks under torchrun (``across_ranks=None``), or by this process alone.

    >>> ranks_for(across_ranks=False).world_size
    1
    """
    if across_ranks is None:
        across_ranks = under_torchrun()
    elif across_ranks and not under_torchrun():
        raise UsageError("across_ranks=True needs a torchrun job (WORLD_SIZE > 1, RANK and MASTER_ADDR set)")
    return Ranks(join(), progress) if across_ranks else OneProcess(progress)


# ---------------------------------------------------------------------------------------------
# The command line under torchrun


def quiet_other_ranks() -> None:
    """Under torchrun: ranks other than 0 print nothing (rank 0 reports every rank's error), and
    SIGTERM (torchrun stopping the job) unwinds like Ctrl-C, so rank 0 removes its temporary output."""
    if not under_torchrun():
        return
    ours = threading.current_thread() is threading.main_thread() and storage.interrupts_handled()
    signal.signal(signal.SIGTERM, storage.raise_interrupted if ours else signal.default_int_handler)
    if os.environ["RANK"] != "0":
        sys.stdout = sys.stderr = open(os.devnull, "w")


def leave(exit_code: int, error: BaseException | None) -> None:
    """Under torchrun, before a failing command exits: tell ranks still at work, and let rank 0 report first.

    A rank that failed before any write (e.g. on opening the source) publishes its error, so rank 0
    stops and reports it. torchrun stops every rank as soon as one exits non-zero, so the others
    wait here until rank 0 has printed its line, and a moment longer so that rank 0 exits first.
    """
    if exit_code == 0 or not under_torchrun():
        return
    group = join()
    if error is not None:
        group.publish_failure(group.jobs, error)  # the write the other ranks are in (or about to start)
    if group.rank == 0:
        group.store.set("reported", "1")
        return
    try:
        group.store.wait(["reported"], REPORT_WAIT)
        time.sleep(EXIT_GRACE)
    except INTERRUPTS:  # torchrun stopping the job once rank 0 has exited: exit with this rank's code
        pass
