"""How bytes move: reading ranges of checkpoint files safely, and writing outputs atomically.

A checkpoint is read from a local path or from a URL that fsspec opens (``memory://ckpt``,
``s3://bucket/step-100``); every path a checkpoint names (in an index json, in DCP metadata) goes
through ``CheckpointFiles.path``, which refuses anything that leaves the checkpoint folder.
"""

from __future__ import annotations

import fnmatch
import io
import os
import re
import shutil
import stat
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dcptool.errors import CheckpointError, UsageError

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

    def read(self, relative: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(relative, offset, memoryview(buffer))
        return bytes(buffer)

    def read_all(self, relative: str) -> bytes:
        return self.read(relative, 0, self.size(relative))

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
        if os.path.commonpath([full, self._real_root]) != self._real_root:
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
                self._fds[relative] = fd
        return fd

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        fd = self.fd(relative)
        done = 0
        while done < len(buffer):
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path(relative)}: file shrank while reading at byte {offset + done}")
            done += got

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


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
        self._lock = threading.Lock()

    def fd(self, name: str) -> int:
        """The file's descriptor, creating the file on first use."""
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            return fd

    def write_at(self, name: str, offset: int, data) -> None:
        fd, view, done = self.fd(name), memoryview(data).cast("B"), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@contextmanager
def atomic_output(destination: Path, overwrite: bool, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of ``destination`` to write into; rename it into place only on success.

    An interrupted or failed run leaves nothing that looks like a checkpoint at ``destination``.
    An existing ``destination`` is refused unless ``overwrite``, and replaced only after success.
    """
    destination = Path(destination)
    check_destination(destination, overwrite)
    destination.parent.mkdir(parents=True, exist_ok=True)
    temporary = destination.parent / f".{destination.name}.dcptool-tmp-{uuid.uuid4().hex[:8]}"
    if is_dir:
        temporary.mkdir()
    try:
        yield temporary
        if destination.exists():
            old = destination.parent / f".{destination.name}.dcptool-old-{uuid.uuid4().hex[:8]}"
            destination.rename(old)
            temporary.rename(destination)
            _remove(old)
        else:
            temporary.rename(destination)
    except BaseException:
        _remove(temporary)
        raise


def fsync_tree(path: Path) -> None:
    """Flush a finished output to disk before it is renamed into place, as DCP does."""
    fsync_paths([path] if path.is_file() else [p for p in path.rglob("*")] + [path])


def fsync_paths(paths) -> None:
    """Flush files (or folders) to disk: on a shared filesystem, each writer must flush its own files."""
    for item in paths:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


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
