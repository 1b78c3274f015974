"""Writing outputs: files written at planned offsets, and the atomic commit that puts an output in place.

An output is written under a temporary sibling name, then put in place by one rename; an interrupted
or failed run leaves nothing that looks like a checkpoint at its destination, and the temporaries of
a run killed outright are removed by the next run writing the same destination.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
from contextlib import contextmanager
from pathlib import Path, PurePath, PurePosixPath
from typing import Callable, Iterator

from dcptool.errors import OutputExistsError, UsageError, option
from dcptool.storage.files import is_remote, local_path
from dcptool.storage.interrupts import deferred_interrupts
from dcptool.storage.naming import annotate, showing, shown_path
from dcptool.storage.renames import rename2, rename_noreplace


def check_destination(location: str | Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; commands call it before any work is done."""
    if is_remote(location):
        from dcptool.storage.remote import exists  # fsspec only for URLs

        found = exists(str(location))
    else:
        found = Path(location).exists()
    if found and not overwrite:
        raise OutputExistsError(f"{location}: already exists (pass {option('overwrite', True)} to replace it)", path=str(location))


def check_apart(source: str | Path, destination: str | Path) -> None:
    """Refuse an output that is its source, lies inside it (the checkpoint read would gain a folder), or holds it
    (replacing the output would remove the source); commands call it before any work is done."""
    read, written = _comparable(source), _comparable(destination)
    if written == read:
        raise UsageError(f"{destination}: is the source checkpoint itself; write the output elsewhere")
    if read in written.parents:
        raise UsageError(f"{destination}: inside the source checkpoint {source}, which would then hold it; "
                         f"write the output outside {source}")
    if written in read.parents:
        raise UsageError(f"{destination}: holds the source checkpoint {source}, which replacing it would remove; "
                         "write the output elsewhere")


def _comparable(location: str | Path) -> PurePath:
    """``location`` as a path to compare: a local one absolute, its links resolved; a URL as a relative path
    (``s3:/bucket/run``), which no local path contains or lies in."""
    if is_remote(location):
        return PurePosixPath(str(location).rstrip("/"))
    return Path(os.path.realpath(local_path(location)))


def output_path(location: str | Path) -> Path | str:
    """Where an output goes: a local path, or a URL as given (written locally first, then uploaded)."""
    return str(location) if is_remote(location) else local_path(location)


class OutputFiles:
    """The files of one output, written at planned offsets (``pwrite``), from several threads at once.

    >>> out = OutputFiles(Path(tmp))                         # doctest: +SKIP
    >>> out.write_at("model.safetensors", 0, header)         # doctest: +SKIP
    >>> out.close()                                          # doctest: +SKIP
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._fds: dict[str, int] = {}
        self._writing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def fd(self, name: str) -> int:
        """The file's descriptor, creating the file on first use."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                path = self.folder / name
                fd = self._fds[name] = _attempt(
                    "creating", path, lambda: os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
                self._writing[name] = threading.Lock()
            return fd

    @contextmanager
    def writing(self, name: str) -> Iterator[int]:
        """The file's descriptor, held by this thread alone while it writes.

        A filesystem lets one write into a file at a time (ext4, xfs: the inode's lock), and a thread
        waiting there spins on a core; waiting here sleeps, leaving the core to threads that read."""
        fd = self.fd(name)
        with self._writing[name]:
            yield fd

    def write_at(self, name: str, offset: int, data) -> None:
        """Write ``data`` (any buffer) into the file ``name`` at ``offset``; an OSError names the file and where."""
        view, done = memoryview(data).cast("B"), 0
        try:
            with self.writing(name) as fd:
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise self.failed(exc, name, offset + done) from None

    def failed(self, exc: OSError, name: str, at: int, operation: str = "writing") -> OSError:
        """``exc`` naming the file (as in the destination) and where: ``writing OUT/x.safetensors at byte 1,024``."""
        return annotate(exc, operation, self.folder / name, f" at byte {at:,}")

    def close(self) -> None:
        """Close the files written (flushing them to disk is ``fsync_tree``'s)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


# ---------------------------------------------------------------------------------------------
# The atomic commit: written under a temporary sibling name, then put in place by one rename


@contextmanager
def atomic_output(destination: Path, overwrite: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``destination`` to write into; rename it into place only on success.

    An interrupted or failed run leaves nothing that looks like a checkpoint at ``destination``.
    An existing ``destination`` is refused unless ``overwrite``, and replaced only after success.
    Without ``overwrite``, the final rename refuses to replace anything that appeared at
    ``destination`` meanwhile (another run writing the same output): of two runs, one wins and the
    other raises ``OutputExistsError``. The temporary's name carries this host and process id
    (``.NAME.dcptool-tmp-HOST-PID-XXXXXXXX``), so that a later run removes what a killed one left.
    """
    destination = Path(destination)
    remove_stale_temporaries(destination)
    check_destination(destination, overwrite)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = _sibling(destination, "tmp")
    shown = str(destination)
    _OUTPUTS.pop(shown, None)  # the last one started comes last
    _OUTPUTS[shown] = False
    committed = False
    with showing(temporary, destination):
        try:
            if is_dir:
                _attempt("creating", temporary, temporary.mkdir)
            yield temporary
            with deferred_interrupts():  # a Ctrl-C now is raised once the output is in place, or not
                left_over = _commit(temporary, destination, overwrite)
                committed = _OUTPUTS[shown] = True
                if left_over is not None:  # the output that was replaced
                    _remove(left_over)
        except BaseException as exc:
            if not committed:
                with deferred_interrupts():
                    _remove(temporary)
            if isinstance(exc, OSError) and getattr(exc, "dcptool_operation", None) is None:
                if exc.filename is None:  # e.g. a writer's own write() on a full disk
                    annotate(exc, "writing", destination)
                else:
                    exc.filename = shown_path(exc.filename)
            raise


def output_state() -> tuple[str, bool] | None:
    """The last output this process started: ``(destination, whether it is in place)``; None before any."""
    return next(reversed(_OUTPUTS.items()), None)


_OUTPUTS: dict[str, bool] = {}  # outputs started by this process, as given -> in place yet


def _attempt(operation: str, path: Path | str, action: Callable[[], object]):
    try:
        return action()
    except OSError as exc:
        raise annotate(exc, operation, path) from None


# Temporaries: ``.NAME.dcptool-tmp-HOST-PID-XXXXXXXX`` (``-old-`` for a replaced output set aside).
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40] or "host"
_OWNER = re.compile(r"(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _stem(destination: Path) -> str:
    """The start of the temporaries' names of ``destination``: long names are shortened to fit NAME_MAX."""
    name = destination.name
    if len(os.fsencode(name)) <= 150:
        return f".{name}.dcptool-"
    import hashlib  # OpenSSL's: 3 ms of every start-up, for long names only

    return f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:24]}.dcptool-"


def _sibling(destination: Path, kind: str) -> Path:
    return destination.parent / f"{_stem(destination)}{kind}-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}"


def remove_stale_temporaries(destination: Path) -> list[Path]:
    """Remove the temporaries that writers of ``destination`` on this host left when they died (kill -9).

    Only those whose process is gone: a live writer's (another run writing the same output) stays,
    and so does one from another host (a shared filesystem: its process cannot be checked here) or
    one of an older dcptool whose name carries no process. A replaced output set aside
    (``-old-``) is removed only while ``destination`` exists: otherwise it is the only copy left.
    """
    destination = Path(destination)
    stem = _stem(destination)
    try:
        names = [name for name in os.listdir(destination.parent) if name.startswith(stem)]
    except OSError:
        return []
    removed = []
    for name in names:
        owner = _OWNER.fullmatch(name[len(stem):])
        if owner is None or (owner["kind"] == "old" and not os.path.lexists(destination)):
            continue
        if _left_by_a_dead_writer(owner):
            _remove(destination.parent / name)
            removed.append(destination.parent / name)
    return removed


def stale_temporaries(folder: Path) -> list[str]:
    """Names of the temporaries in ``folder`` that dead writers on this host left (``inspect`` lists them)."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        start = name.find(".dcptool-")
        owner = _OWNER.fullmatch(name[start + len(".dcptool-"):]) if name.startswith(".") and start > 0 else None
        if owner is not None and _left_by_a_dead_writer(owner):
            found.append(name)
    return found


def _left_by_a_dead_writer(owner: re.Match) -> bool:
    return owner["host"] == _HOST and _process_gone(int(owner["pid"]))


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (a zombie, killed but not yet reaped, counts as gone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: another user's process, alive
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as status:
            text = status.read()
        return text[text.rindex(b")") + 2:][:1] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def _commit(temporary: Path, destination: Path, overwrite: bool) -> Path | None:
    """Put ``temporary`` in place at ``destination``; returns what is left to remove (a replaced output).

    Without ``overwrite`` nothing that appeared at ``destination`` is replaced (``OutputExistsError``).
    With it, an existing output is swapped with the new one in one step where the system can
    (``renameat2(RENAME_EXCHANGE)``), else set aside, and removed by the caller.
    """
    if not overwrite:
        try:
            _attempt("renaming into place", temporary, lambda: rename_noreplace(temporary, destination))
        except FileExistsError:
            raise OutputExistsError(f"{destination}: appeared while writing; not replaced (use {option('overwrite', True)})",
                                    path=str(destination)) from None
        return None
    for _ in range(10):  # only another writer, putting its output in place at the same moment, makes it loop
        if not os.path.lexists(destination):
            try:
                _attempt("renaming into place", temporary, lambda: rename_noreplace(temporary, destination))
                return None
            except FileExistsError:
                continue
        try:
            if _attempt("renaming into place", temporary, lambda: rename2(temporary, destination, exchange=True)):
                return temporary  # now holds the replaced output
        except FileNotFoundError:  # removed meanwhile
            continue
        if temporary.is_file() and not destination.is_dir():
            _attempt("renaming into place", temporary, lambda: os.replace(temporary, destination))
            return None
        old = _sibling(destination, "old")
        try:
            os.rename(destination, old)
        except FileNotFoundError:
            continue
        try:
            _attempt("renaming into place", temporary, lambda: rename_noreplace(temporary, destination))
        except FileExistsError:  # another writer's output, put in place in between: replace it in turn
            _remove(old)
            continue
        return old
    raise UsageError(f"{destination}: other runs keep replacing it; not replaced")


def fsync_tree(path: Path) -> None:
    """Flush a finished output to disk before it is renamed into place, as DCP does."""
    fsync_paths([path] if path.is_file() else [p for p in path.rglob("*")] + [path])


def fsync_paths(paths) -> None:
    """Flush files (or folders) to disk: on a shared filesystem, each writer must flush its own files."""
    for item in paths:
        try:
            fd = os.open(item, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise annotate(exc, "flushing", item) from None


def _remove(path: Path) -> None:
    """Remove a file or a folder, whatever it holds; a folder that threads still add to is tried again."""
    for _ in range(3):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                return
        if not os.path.lexists(path):
            return
