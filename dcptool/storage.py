"""How bytes move: reading ranges of checkpoint files safely, and writing outputs atomically.

Every path a checkpoint names (in an index json, in DCP metadata) goes through ``CheckpointFiles.path``,
which refuses anything that leaves the checkpoint folder.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dcptool.errors import CheckpointError, UsageError


class CheckpointFiles:
    """Read-only access to the files of one checkpoint folder (or of a single checkpoint file)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._real_root = os.path.realpath(self.root)
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()  # readers run in several threads (dcptool.transfer)

    def path(self, relative: str) -> Path:
        """The file ``relative`` names, refusing absolute paths and paths that escape the folder."""
        if os.path.isabs(relative) or not relative:
            raise CheckpointError(f"{self.root}: names a file outside the checkpoint folder: {relative!r}")
        full = os.path.realpath(os.path.join(self._real_root, relative))
        if os.path.commonpath([full, self._real_root]) != self._real_root:
            raise CheckpointError(f"{self.root}: names a file outside the checkpoint folder: {relative!r}")
        return self.root / relative

    def size(self, relative: str) -> int:
        if relative not in self._sizes:
            try:
                self._sizes[relative] = os.path.getsize(self.path(relative))
            except FileNotFoundError:
                raise CheckpointError(f"{self.path(relative)}: missing file") from None
        return self._sizes[relative]

    def _fd(self, relative: str) -> int:
        with self._lock:
            fd = self._fds.get(relative)
            if fd is None:
                try:
                    fd = os.open(self.path(relative), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise CheckpointError(f"{self.path(relative)}: missing file") from None
                self._fds[relative] = fd
            return fd

    def local_fd(self, relative: str) -> int | None:
        """The open descriptor of a local file (for ``os.copy_file_range``)."""
        return self._fd(relative)

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
        fd = self._fd(relative)
        done = 0
        while done < len(buffer):
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise CheckpointError(f"{self.path(relative)}: file shrank while reading at byte {offset + done}")
            done += got

    def read(self, relative: str, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self.read_into(relative, offset, memoryview(buffer))
        return bytes(buffer)

    def window(self, relative: str, offset: int, length: int) -> "FileWindow":
        """A seekable read-only file object over ``[offset, offset+length)`` of a file (for zipfile)."""
        self.check_range(relative, offset, length)
        return FileWindow(self, relative, offset, length)

    def close(self) -> None:
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
    if destination.exists() and not overwrite:
        raise UsageError(f"{destination}: already exists (pass --overwrite to replace it)")
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
