"""Reading a checkpoint's files: a local folder (or one file seen from its folder), or a URL that fsspec opens.

Every path a checkpoint names (in an index json, in DCP metadata) goes through ``CheckpointFiles.path``,
which refuses anything that leaves the checkpoint folder (or, for a snapshot in the Hugging Face
cache, its blobs folder).
"""

from __future__ import annotations

import fnmatch
import io
import mmap
import os
import re
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dcptool.errors import CheckpointError, json_kind, parse_json
from dcptool.storage.naming import annotate

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


class CheckpointFiles:
    """Read-only access to the files of one checkpoint: a folder, or a single file seen from its folder.

    ``location`` is a local path or a URL that fsspec opens; fsspec is imported only for URLs, and
    local files are read with ``os.preadv`` on descriptors kept open. Files are named relative to
    the folder. Safe to share between threads: the caches are filled under a lock.
    """

    def __init__(self, location: str | Path):
        if is_remote(location):
            from dcptool.storage.remote import RemoteFolder  # fsspec only when a URL is given: local start-up stays fast

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
        # Whether records (torch.save archives) are checked as they are read (``--no-verify-records``: not),
        # and the checks so far (``dcptool.torch_archive.records``, made on first use).
        self.verify_records = True
        self.record_checks = None

    def exists(self) -> bool:
        """Whether the checkpoint is there at all (a folder or a file)."""
        return self._store.kind is not None

    def is_dir(self) -> bool:
        """Whether the checkpoint is a folder (not a single file)."""
        return self._store.kind == "dir"

    def path(self, relative: str) -> Path | str:
        """Where the file ``relative`` is (a local path or a URL), refusing names that leave the folder."""
        return self._store.path(relative)

    def is_file(self, relative: str) -> bool:
        """Whether ``relative`` is a regular file of the checkpoint."""
        return self._size_or_none(relative) is not None

    def size(self, relative: str) -> int:
        """The size in bytes of the file ``relative``; CheckpointError when it is missing."""
        size = self._size_or_none(relative)
        if size is None:
            raise CheckpointError(f"{self.path(relative)}: missing file")
        return size

    def _size_or_none(self, relative: str) -> int | None:
        size = self._sizes.get(relative)  # filled under the lock; a lookup needs none (a million chunks ask)
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
        """Refuse a range that runs past the end of the file (a truncated or corrupt checkpoint)."""
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

    def read_parts(self, relative: str, offset: int, buffers: list[memoryview]) -> None:
        """Fill ``buffers`` one after another with the file's bytes from ``offset``: one system call for a local
        file (a record's frame and its storage, read into different places at once)."""
        self.check_range(relative, offset, sum(map(len, buffers)))
        fd = self.local_fd(relative)
        done = 0 if fd is None else self._store.read_parts(fd, relative, offset, buffers)
        for buffer in buffers:  # what one call did not read (a remote file, a short read)
            if done < len(buffer):
                self.read_into(relative, offset, buffer[done:])
            offset += len(buffer)
            done = max(0, done - len(buffer))

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
            raise annotate(exc, "reading", self.path(relative), f" at byte {offset:,}") from None
        with region, memoryview(region) as whole, whole[offset - base:] as view:
            yield view

    def read(self, relative: str, offset: int, length: int) -> bytes:
        """The file's bytes ``offset..offset + length``."""
        buffer = bytearray(length)
        self.read_into(relative, offset, memoryview(buffer))
        return bytes(buffer)

    def read_all(self, relative: str) -> bytes:
        """The whole file's bytes (for small files: indexes, configs, metadata)."""
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
        """Close the files kept open for reading."""
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
        """The local path of ``relative``, refusing names whose real location leaves the folder."""
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
        """The size of a regular file, or None when there is none by that name."""
        try:
            info = os.stat(self.path(relative))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def list_folder(self) -> dict[str, int]:
        """The files directly in the folder, with their sizes."""
        with os.scandir(self.root) as entries:
            return {entry.name: entry.stat().st_size for entry in entries if entry.is_file()}

    def walk_folder(self) -> dict[str, int]:
        """Every file under the folder, as ``/``-separated relative names, with their sizes."""
        sizes = {}
        for folder, _, files in os.walk(self.root):
            for name in files:
                full = os.path.join(folder, name)
                if os.path.isfile(full):
                    sizes[Path(os.path.relpath(full, self.root)).as_posix()] = os.path.getsize(full)
        return sizes

    def fd(self, relative: str) -> int:
        """The file's descriptor, opened on first use and kept open until ``close``."""
        fd = self._fds.get(relative)  # opened under the lock; a lookup needs none (a read of every chunk asks)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(relative)
            if fd is None:
                try:
                    fd = os.open(self.path(relative), os.O_RDONLY)
                except FileNotFoundError:
                    raise CheckpointError(f"{self.path(relative)}: missing file") from None
                except OSError as exc:
                    raise annotate(exc, "opening", self.path(relative)) from None
                self._fds[relative] = fd
        return fd

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``, however many reads it takes."""
        fd = self.fd(relative)
        done = 0
        while done < len(buffer):
            try:
                got = os.preadv(fd, [buffer[done:]], offset + done)
            except OSError as exc:
                raise annotate(exc, "reading", self.path(relative), f" at byte {offset + done:,}") from None
            if got <= 0:
                raise CheckpointError(f"{self.path(relative)}: file shrank while reading at byte {offset + done}")
            done += got

    def read_parts(self, fd: int, relative: str, offset: int, buffers: list[memoryview]) -> int:
        """One ``preadv`` into ``buffers`` from ``offset``; how many bytes it read."""
        try:
            return os.preadv(fd, buffers, offset)
        except OSError as exc:
            raise annotate(exc, "reading", self.path(relative), f" at byte {offset:,}") from None

    def close(self) -> None:
        """Close the descriptors kept open."""
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
