"""How bytes move: reading ranges of checkpoint files safely, and writing outputs atomically.

A checkpoint is read from a local path or from a URL that fsspec opens (``memory://ckpt``,
``s3://bucket/step-100``); every path a checkpoint names (in an index json, in DCP metadata) goes
through ``CheckpointFiles.path``, which refuses anything that leaves the checkpoint folder.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import hashlib
import io
import mmap
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import threading
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Callable, Iterator

from dcptool.errors import CheckpointError, UsageError, json_kind, parse_json

# ``scheme://...`` or fsspec's chained ``blockcache::s3://...``; ``file://`` URLs are read as local paths.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*(://|::)")
_FILE_URL = "file://"


def is_remote(location: str | Path) -> bool:
    """Whether ``location`` is a URL read through fsspec rather than a local path (or ``file://`` URL)."""
    text = str(location)
    return not text.startswith(_FILE_URL) and _URL.match(text) is not None


def local_path(location: str | Path) -> Path:
    """The local path of a plain path or a ``file://`` URL."""
    text = str(location)
    return Path(text[len(_FILE_URL):] if text.startswith(_FILE_URL) else text)


def check_destination(location: str | Path, overwrite: bool) -> None:
    """Refuse an existing output unless ``overwrite``; commands call it before any work is done."""
    if is_remote(location):
        from dcptool.remote import exists  # fsspec only for URLs

        found = exists(str(location))
    else:
        found = Path(location).exists()
    if found and not overwrite:
        raise UsageError(f"{location}: already exists (pass --overwrite to replace it)")


def output_path(location: str | Path) -> Path | str:
    """Where an output goes: a local path, or a URL as given (written locally first, then uploaded)."""
    return str(location) if is_remote(location) else local_path(location)


class CheckpointFiles:
    """Read-only access to the files of one checkpoint: a folder, or a single file seen from its folder.

    ``location`` is a local path or a URL that fsspec opens; fsspec is imported only for URLs, and
    local files are read with ``os.preadv`` on descriptors kept open. Files are named relative to
    the folder. Safe to share between threads: the caches are filled under a lock.
    """

    def __init__(self, location: str | Path):
        if is_remote(location):
            from dcptool.remote import RemoteFolder  # fsspec only when a URL is given: local start-up stays fast

            self._store = RemoteFolder(str(location))
        else:
            self._store = LocalFolder(local_path(location))
        self.location = self._store.location  # the checkpoint as given: a Path, or the URL
        self.single_file = self._store.single_file  # the file's name when the checkpoint is one file
        self.root = self._store.root  # the folder that names are relative to (the file's folder for one file)
        self.local_folder = self.root if isinstance(self._store, LocalFolder) else None  # None when remote
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._listing: list[str] | None = None

    def exists(self) -> bool:
        return self._store.kind is not None

    def is_dir(self) -> bool:
        return self._store.kind == "dir"

    def path(self, relative: str) -> Path | str:
        """Where the file ``relative`` is (a local path or a URL), refusing names that leave the folder."""
        return self._store.path(relative)

    def is_file(self, relative: str) -> bool:
        return self._size_or_none(relative) is not None

    def size(self, relative: str) -> int:
        size = self._size_or_none(relative)
        if size is None:
            raise CheckpointError(f"{self.path(relative)}: missing file")
        return size

    def _size_or_none(self, relative: str) -> int | None:
        with self._lock:
            size = self._sizes.get(relative)
        if size is None:
            size = self._store.file_size(relative)
            if size is not None:
                with self._lock:
                    self._sizes[relative] = size
        return size

    def names(self, pattern: str = "*") -> list[str]:
        """The files directly in the folder whose names match the glob ``pattern``, sorted."""
        with self._lock:
            listing = self._listing
        if listing is None:
            sizes = self._store.list_folder()
            listing = sorted(sizes)
            with self._lock:
                self._sizes.update(sizes)
                self._listing = listing
        return [name for name in listing if fnmatch.fnmatchcase(name, pattern)]

    def all_names(self) -> list[str]:
        """Every file under the folder, subfolders included, as sorted ``/``-separated relative names."""
        sizes = self._store.walk_folder()
        with self._lock:
            self._sizes.update(sizes)
        return sorted(sizes)

    def stored_in(self, relative: str) -> str:
        """The checkpoint file that a name's bytes come from: itself (a decompressed record names another)."""
        return relative

    def local_fd(self, relative: str) -> int | None:
        """The OS file descriptor of a local file (kept open until ``close``), or None for a remote one."""
        return self._store.fd(relative)

    def check_range(self, relative: str, offset: int, length: int) -> None:
        size = self.size(relative)
        if offset < 0 or length < 0 or offset + length > size:
            raise CheckpointError(
                f"{self.path(relative)}: truncated or corrupt: needs bytes {offset}..{offset + length}, "
                f"the file has {size}"
            )

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` with the file's bytes from ``offset`` (no allocation: the caller reuses buffers)."""
        self.check_range(relative, offset, len(buffer))
        self._store.read_into(relative, offset, buffer)

    @contextmanager
    def mapped(self, relative: str, offset: int, length: int) -> Iterator[memoryview | None]:
        """The file's bytes ``offset..offset + length`` mapped read-only in place (a gather from them copies
        once, where a read into a buffer first would copy twice, gaps included); None for a file that is
        not local, which the caller reads instead. The range is checked against the file's size first: only
        a file cut short by another process while mapped could still fault (SIGBUS)."""
        self.check_range(relative, offset, length)
        fd = self.local_fd(relative)
        if fd is None or length == 0:
            yield None
            return
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            region = mmap.mmap(fd, offset + length - base, offset=base, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise _annotate(exc, "reading", self.path(relative), f" at byte {offset:,}") from None
        with region, memoryview(region) as whole, whole[offset - base:] as view:
            yield view

    def read(self, relative: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(relative, offset, memoryview(buffer))
        return bytes(buffer)

    def read_all(self, relative: str) -> bytes:
        return self.read(relative, 0, self.size(relative))

    def read_json_object(self, relative: str, max_bytes: int, what: str) -> dict:
        """A JSON object file of the checkpoint (an index, a config), read only when at most ``max_bytes``;
        CheckpointError naming the file for anything else (``what`` says what it should be)."""
        where = self.path(relative)
        if self.size(relative) > max_bytes:
            raise CheckpointError(f"{where}: {self.size(relative):,} bytes is too large for {what}")
        value = parse_json(self.read_all(relative), where)
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: not {what} ({json_kind(value)}, not an object)")
        return value

    def window(self, relative: str, offset: int, length: int) -> "FileWindow":
        """A seekable read-only file object over ``[offset, offset+length)`` of a file (for zipfile)."""
        self.check_range(relative, offset, length)
        return FileWindow(self, relative, offset, length)

    def close(self) -> None:
        self._store.close()


class LocalFolder:
    """The local files behind ``CheckpointFiles``: paths confined by their real location, reads by ``os.preadv``."""

    def __init__(self, location: Path):
        self.location = location
        try:
            mode = os.stat(location).st_mode
            self.kind = "dir" if stat.S_ISDIR(mode) else "file"
        except FileNotFoundError:
            self.kind = None
        self.single_file = location.name if self.kind == "file" else None
        self.root = location.parent if self.single_file else location
        self._real_root = os.path.realpath(self.root)
        self._allowed = (self._real_root, *_hub_blobs(self._real_root))
        self._fds: dict[str, int] = {}
        self._checked: dict[str, Path] = {}  # names already confirmed inside the folder
        self._lock = threading.Lock()

    def path(self, relative: str) -> Path:
        checked = self._checked.get(relative)
        if checked is not None:
            return checked
        if os.path.isabs(relative) or not relative:
            raise CheckpointError(f"{self.root}: names a file outside the checkpoint folder: {relative!r}")
        full = os.path.realpath(os.path.join(self._real_root, relative))
        if not any(os.path.commonpath([full, allowed]) == allowed for allowed in self._allowed):
            raise CheckpointError(f"{self.root}: names a file outside the checkpoint folder: {relative!r}")
        # Remembered: realpath costs a few stats, and a DCP checkpoint names its files once per chunk.
        checked = self._checked[relative] = self.root / relative
        return checked

    def file_size(self, relative: str) -> int | None:
        try:
            info = os.stat(self.path(relative))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def list_folder(self) -> dict[str, int]:
        with os.scandir(self.root) as entries:
            return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}

    def walk_folder(self) -> dict[str, int]:
        sizes = {}
        for folder, _, files in os.walk(self.root):
            for name in files:
                full = os.path.join(folder, name)
                if os.path.isfile(full):
                    sizes[Path(os.path.relpath(full, self.root)).as_posix()] = os.path.getsize(full)
        return sizes

    def fd(self, relative: str) -> int:
        with self._lock:
            fd = self._fds.get(relative)
            if fd is None:
                try:
                    fd = os.open(self.path(relative), os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"{self.path(relative)}: missing file") from None
                except OSError as exc:
                    raise _annotate(exc, "opening", self.path(relative)) from None
                self._fds[relative] = fd
        return fd

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        fd = self.fd(relative)
        done = 0
        while done < len(buffer):
            try:
                got = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as exc:
                raise _annotate(exc, "reading", self.path(relative), f" at byte {offset + done:,}") from None
            if got <= 0:
                raise CheckpointError(f"{self.path(relative)}: file shrank while reading at byte {offset + done}")
            done += got

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _hub_blobs(folder: str) -> list[str]:
    """The blobs folder of a snapshot in the Hugging Face cache (``models--ORG--NAME/snapshots/<commit>``),
    whose files are links into ``models--ORG--NAME/blobs``; none for any other folder."""
    snapshots, repo = os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        return [os.path.join(repo, "blobs")]
    return []


class FileWindow(io.RawIOBase):
    """A byte range of a checkpoint file seen as a whole file."""

    def __init__(self, files: CheckpointFiles, relative: str, start: int, length: int):
        self._files, self._relative, self._start, self._length, self._pos = files, relative, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self._length - self._pos))
        if count:
            self._files.read_into(self._relative, self._start + self._pos, memoryview(buffer)[:count])
            self._pos += count
        return count


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
        view, done = memoryview(data).cast("B"), 0
        try:
            with self.writing(name) as fd:
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)
        except OSError as exc:
            raise self.failed(exc, name, offset + done) from None

    def failed(self, exc: OSError, name: str, at: int, operation: str = "writing") -> OSError:
        """``exc`` naming the file (as in the destination) and where: ``writing OUT/x.safetensors at byte 1,024``."""
        return _annotate(exc, operation, self.folder / name, f" at byte {at:,}")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


# ---------------------------------------------------------------------------------------------
# Outputs: written under a temporary sibling name, then put in place by one rename


@contextmanager
def atomic_output(destination: Path, overwrite: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``destination`` to write into; rename it into place only on success.

    An interrupted or failed run leaves nothing that looks like a checkpoint at ``destination``.
    An existing ``destination`` is refused unless ``overwrite``, and replaced only after success.
    Without ``overwrite``, the final rename refuses to replace anything that appeared at
    ``destination`` meanwhile (another run writing the same output): of two runs, one wins and the
    other raises ``UsageError``. The temporary's name carries this host and process id
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
                    _annotate(exc, "writing", destination)
                else:
                    exc.filename = shown_path(exc.filename)
            raise


def output_state() -> tuple[str, bool] | None:
    """The last output this process started: ``(destination, whether it is in place)``; None before any."""
    return next(reversed(_OUTPUTS.items()), None)


_OUTPUTS: dict[str, bool] = {}  # outputs started by this process, as given -> in place yet
_SHOWN: dict[str, str] = {}  # temporary -> destination, to name files in messages as the user knows them


@contextmanager
def showing(temporary: Path | str, destination: Path | str) -> Iterator[None]:
    """While writing: messages name ``destination/FILE`` instead of ``temporary/FILE``."""
    key = str(temporary)
    _SHOWN[key] = str(destination)
    try:
        yield
    finally:
        _SHOWN.pop(key, None)


def shown_path(path: Path | str) -> str:
    """``path`` as the user knows it: a file in a temporary output is named in its destination.

    >>> with showing("out/.step.dcptool-tmp-h-1-00000000", "out/step"):
    ...     shown_path("out/.step.dcptool-tmp-h-1-00000000/model.safetensors")
    'out/step/model.safetensors'
    """
    text = os.fspath(path)
    for temporary, destination in list(_SHOWN.items()):
        if text == temporary or text.startswith(temporary + os.sep):
            return destination + text[len(temporary):]
    return text


def _annotate(exc: OSError, operation: str, path: Path | str, where: str = "") -> OSError:
    """Name the file and the operation in an OSError, as the CLI prints it (``distributed.describe_failure``)."""
    if getattr(exc, "dcptool_operation", None) is None:  # the innermost names it
        exc.filename = shown_path(path)
        exc.dcptool_operation = operation
        exc.dcptool_where = where
    return exc


def _attempt(operation: str, path: Path | str, action: Callable[[], object]):
    try:
        return action()
    except OSError as exc:
        raise _annotate(exc, operation, path) from None


# Temporaries: ``.NAME.dcptool-tmp-HOST-PID-XXXXXXXX`` (``-old-`` for a replaced output set aside).
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:40] or "host"
_OWNER = re.compile(r"(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{8}")


def _stem(destination: Path) -> str:
    """The start of the temporaries' names of ``destination``: long names are shortened to fit NAME_MAX."""
    name = destination.name
    if len(os.fsencode(name)) <= 150:
        return f".{name}.dcptool-"
    return f".{hashlib.sha256(os.fsencode(name)).hexdigest()[:24]}.dcptool-"


def _sibling(destination: Path, kind: str) -> Path:
    return destination.parent / f"{_stem(destination)}{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}"


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

    Without ``overwrite`` nothing that appeared at ``destination`` is replaced (``UsageError``).
    With it, an existing output is swapped with the new one in one step where the system can
    (``renameat2(RENAME_EXCHANGE)``), else set aside, and removed by the caller.
    """
    if not overwrite:
        try:
            _attempt("renaming into place", temporary, lambda: _rename_noreplace(temporary, destination))
        except FileExistsError:
            raise UsageError(f"{destination}: appeared while writing; not replaced (use --overwrite)") from None
        return None
    for _ in range(10):  # only another writer, putting its output in place at the same moment, makes it loop
        if not os.path.lexists(destination):
            try:
                _attempt("renaming into place", temporary, lambda: _rename_noreplace(temporary, destination))
                return None
            except FileExistsError:
                continue
        try:
            if _attempt("renaming into place", temporary, lambda: _rename2(temporary, destination, exchange=True)):
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
            _attempt("renaming into place", temporary, lambda: _rename_noreplace(temporary, destination))
        except FileExistsError:  # another writer's output, put in place in between: replace it in turn
            _remove(old)
            continue
        return old
    raise UsageError(f"{destination}: other runs keep replacing it; not replaced")


def _rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` unless something is at ``target`` (``FileExistsError``), in one step.

    ``renameat2(RENAME_NOREPLACE)`` on Linux (``renamex_np(RENAME_EXCL)`` on macOS); where the system
    or the filesystem lacks it, a file is linked at ``target`` (which fails if anything is there) and
    unlinked at ``source``, and a folder is renamed: ``rename`` does not replace a folder that is
    not empty, nor a file, and outputs are never empty folders.
    """
    if _rename2(source, target, exchange=False):
        return
    if not source.is_dir():
        try:
            os.link(source, target, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK):
                raise
            if os.path.lexists(target):  # no hard links here: check, then rename
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
            os.rename(source, target)
            return
        os.unlink(source)
        return
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        raise


_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # <linux/fs.h>
_RENAME_SWAP, _RENAME_EXCL = 2, 4  # macOS <stdio.h>
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276, "riscv64": 276, "ppc64le": 357,
                  "s390x": 347, "i686": 353, "i386": 353}
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


@cache
def _renameat2() -> Callable[[bytes, bytes, bool], int] | None:
    """A call ``(source, target, exchange) -> 0 or -1`` (errno set) for the system's rename with flags; None without."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if sys.platform == "darwin":
        function = getattr(libc, "renamex_np", None)
        if function is None:
            return None
        function.argtypes, function.restype = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint], ctypes.c_int
        return lambda source, target, exchange: function(source, target, _RENAME_SWAP if exchange else _RENAME_EXCL)
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(libc, "renameat2", None)  # glibc 2.28 and later, musl 1.2.2
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return lambda source, target, exchange: function(
            _AT_FDCWD, source, _AT_FDCWD, target, _RENAME_EXCHANGE if exchange else _RENAME_NOREPLACE)
    number, syscall = _SYS_RENAMEAT2.get(platform.machine().lower()), getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long
    return lambda source, target, exchange: syscall(
        ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(source), ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(target), ctypes.c_uint(_RENAME_EXCHANGE if exchange else _RENAME_NOREPLACE))


def _rename2(source: Path, target: Path, exchange: bool) -> bool:
    """Rename without replacing (or, with ``exchange``, swap the two); False where unsupported.

    Raises ``FileExistsError`` when not replacing and ``target`` exists, ``FileNotFoundError``
    when exchanging and it does not, and the other OSErrors as they come.
    """
    function = _renameat2()
    if function is None:
        return False
    if function(os.fsencode(source), os.fsencode(target), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) in the command line, raised by the handler that ``handle_interrupts`` installs.

    Not a KeyboardInterrupt, which click and typer turn into an exit of their own (and an empty
    line): this one passes through them to ``cli.main``, which prints one line and exits 130.
    Like KeyboardInterrupt, ``except Exception`` does not catch it.
    """


def handle_interrupts() -> Callable | int | None:
    """Make Ctrl-C raise ``Interrupted`` (from the main thread); returns the handler it replaces.

    Python runs the handler between any two instructions, also inside code whose exceptions it
    drops (a weakref callback of the import system, a ``__del__``), printing "Exception ignored":
    there, the interrupt is delivered again, to be raised at an instruction that can raise it.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if not getattr(sys.unraisablehook, "_dcptool", False):
        sys.unraisablehook = _redeliver_interrupt(sys.unraisablehook)
    return signal.signal(signal.SIGINT, raise_interrupted)


_redelivering = 0  # > 0 while handing back an interrupt that Python dropped


def _redeliver_interrupt(hook: Callable) -> Callable:
    def unraisable(info) -> None:
        global _redelivering
        if not isinstance(info.exc_value, Interrupted):
            hook(info)
            return
        _redelivering += 1
        try:
            _interrupt_again()
        finally:
            _redelivering -= 1

    unraisable._dcptool = True
    return unraisable


def _interrupt_again() -> None:
    """SIGINT to the main thread again, from another thread, once the code that dropped it has returned.

    A signal rather than ``_thread.interrupt_main``, which would run the handler at once, still in
    the hook; a signal also ends a blocking call at once. Should it come while still in the hook,
    ``raise_interrupted`` sends another.
    """
    timer = threading.Timer(0.005, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.daemon = True
    timer.start()


def interrupts_handled() -> bool:
    return signal.getsignal(signal.SIGINT) is raise_interrupted


def raise_interrupted(signum, frame) -> None:
    if _redelivering:  # in the hook, where it would be dropped again
        _interrupt_again()
        return
    raise Interrupted()


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run a block that Ctrl-C must not cut in half: a SIGINT during it is acted on at its end.

    Also SIGTERM where Python handles it (torchrun stopping the job: ``distributed.quiet_other_ranks``).
    Only in the main thread, where Python runs signal handlers; elsewhere the block runs as it is.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        previous = {number: handler for number, handler in previous.items() if callable(handler)}
    caught: list[tuple[int, object]] = []
    try:
        for number in previous:
            signal.signal(number, lambda signum, frame: caught.append((signum, frame)))
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            number, frame = caught[0]
            previous[number](number, frame)


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
            raise _annotate(exc, "flushing", item) from None


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


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """Bytes in ``256MB``, ``5GB`` (decimal, as the hub counts), ``1GiB`` or a plain number; ValueError otherwise.

    >>> parse_size("5GB"), parse_size("1GiB"), parse_size("4096")
    (5000000000, 1073741824, 4096)
    """
    cleaned = text.strip().upper()
    number = cleaned.rstrip("KMGTIB")
    try:
        return int(float(number) * _SIZE_UNITS[cleaned[len(number):]])
    except (ValueError, KeyError):
        raise ValueError(f"{text!r} is not a size such as 256MB or 5GB") from None
