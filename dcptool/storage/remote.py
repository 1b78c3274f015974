"""Checkpoints on remote storage, read through fsspec: ``s3://`` (s3fs), ``gcs://`` (gcsfs), ``memory://``, ...

Imported only when a checkpoint is given as a URL, so local runs never import fsspec. Names a
checkpoint records are confined to its folder by their normalized form (remote stores have no
symbolic links to follow). Large reads are one ranged request each; small ones (zip headers,
pickles, safetensors headers) are served from a few cached blocks, so that opening thousands of
DCP chunk records costs one or two requests per record instead of six.

There are no storage options to pass: each filesystem finds its server and credentials where its library
looks. For ``s3://`` that is boto's environment and ``~/.aws``: ``AWS_ENDPOINT_URL`` for an S3-compatible
store (MinIO, Ceph, moto), ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (or ``AWS_PROFILE``),
``AWS_DEFAULT_REGION``; fsspec's ``FSSPEC_S3_<OPTION>`` variables (``FSSPEC_S3_ENDPOINT_URL``) set any
option of s3fs.
"""

from __future__ import annotations

import posixpath
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import fsspec.core

from dcptool.errors import CheckpointError

BLOCK = 256 * 2**10  # reads smaller than this go through the block cache
CACHED_BLOCKS = 16  # per checkpoint: 4 MiB


@contextmanager
def storage_errors(where: str) -> Iterator[None]:
    """Any failure of the storage library (missing file, credentials, network) as one line naming the URL."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing file") from None
    except Exception as exc:  # s3fs, gcsfs, ... raise their own types, not all of them OSError
        raise CheckpointError(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}") from exc


def open_filesystem(url: str):
    """fsspec's filesystem and path for ``url``; a protocol whose package is missing says which to install."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as exc:  # fsspec's message names the package: "Install s3fs to access S3"
        raise CheckpointError(f"{url}: {exc}") from None
    except ValueError as exc:  # "Protocol not known: foo"
        raise CheckpointError(f"{url}: {exc} (fsspec has no filesystem of that name; install the package that "
                              f"provides it)") from None


def exists(url: str) -> bool:
    fs, target = open_filesystem(url)
    with storage_errors(url):
        return fs.exists(target)


def remove(url: str) -> None:
    """Remove an output (a file or a folder) if it exists."""
    fs, target = open_filesystem(url)
    with storage_errors(url):
        try:
            fs.rm(target, recursive=True)
        except FileNotFoundError:
            pass


def put(local: Path, url: str) -> None:
    """Upload one local file to ``url``."""
    fs, target = open_filesystem(url)
    with storage_errors(url):
        fs.makedirs(posixpath.dirname(target), exist_ok=True)
        fs.put_file(str(local), target)


class RemoteFolder:
    """The remote files behind ``CheckpointFiles``: the same operations as ``storage.files.LocalFolder``, on fsspec."""

    def __init__(self, url: str):
        self.location = url
        self.fs, target = open_filesystem(url)
        with storage_errors(url):
            try:
                self.kind = "dir" if self.fs.info(target)["type"] == "directory" else "file"
            except FileNotFoundError:
                self.kind = None
        self.single_file = posixpath.basename(target) if self.kind == "file" else None
        # The folder's URL as the user wrote it, to which names are appended for messages.
        self.root = url[: url.rindex("/") + 1] if self.single_file else url
        self._folder = posixpath.dirname(target) if self.single_file else target
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def path(self, relative: str) -> str:
        return self._located(relative)[1]

    def _located(self, relative: str) -> tuple[str, str]:
        """The filesystem path and the URL of ``relative``; absolute names and ``..`` out of the folder are refused."""
        normal = posixpath.normpath(relative) if relative else ""
        if not normal or normal == "." or normal.startswith("/") or normal == ".." or normal.startswith("../"):
            raise CheckpointError(f"{self.root}: names a file outside the checkpoint folder: {relative!r}")
        url = self.root + normal if self.root.endswith("/") else f"{self.root}/{normal}"
        return posixpath.join(self._folder, normal), url

    def file_size(self, relative: str) -> int | None:
        target, url = self._located(relative)
        with storage_errors(url):
            try:
                info = self.fs.info(target)
            except FileNotFoundError:
                return None
        return _file_size(info)

    def list_folder(self) -> dict[str, int]:
        with storage_errors(self.root):
            entries = self.fs.ls(self._folder, detail=True)
        sizes = {posixpath.basename(entry["name"].rstrip("/")): _file_size(entry) for entry in entries}
        return {name: size for name, size in sizes.items() if size is not None}

    def walk_folder(self) -> dict[str, int]:
        with storage_errors(self.root):
            found = self.fs.find(self._folder, detail=True)
        sizes = {posixpath.relpath(name, self._folder or "."): _file_size(info) for name, info in found.items()}
        return {name: size for name, size in sizes.items() if size is not None}

    def fd(self, relative: str) -> None:
        return None

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        target, url = self._located(relative)
        length = len(buffer)
        if not length:
            return
        with storage_errors(url):
            data = self._fetch(target, offset, length) if length >= BLOCK else self._from_blocks(target, offset, length)
        if len(data) != length:
            raise CheckpointError(f"{url}: file shrank while reading at byte {offset + len(data)}")
        memoryview(buffer).cast("B")[:] = data

    def _fetch(self, target: str, start: int, length: int) -> bytes:
        # By keyword: s3fs's cat_file takes version_id second, where fsspec's base class takes start.
        return self.fs.cat_file(target, start=start, end=start + length)

    def _from_blocks(self, target: str, offset: int, length: int) -> bytes:
        first, last = offset // BLOCK, (offset + length - 1) // BLOCK
        joined = b"".join(self._block(target, index) for index in range(first, last + 1))
        start = offset - first * BLOCK
        return joined[start:start + length]

    def _block(self, target: str, index: int) -> bytes:
        key = (target, index)
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
                return block
        block = self._fetch(target, index * BLOCK, BLOCK)  # shorter at the end of the file
        with self._lock:
            self._blocks[key] = block
            while len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)
        return block

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()


def _file_size(info: dict) -> int | None:
    """The size fsspec reports for a file; None for a folder (or a file of unknown size: ranges cannot be checked)."""
    size = info.get("size")
    return None if info["type"] == "directory" or size is None else int(size)
