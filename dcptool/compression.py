"""DCP records stored through torch's stream transforms (``_StorageInfo.transform_descriptors``).

torch 2.13 ships one transform, ``stream.zstd/1`` (``torch.distributed.checkpoint._extension.ZStandard``):
each record (a chunk's ``torch.save`` archive, or an object's) is one zstd stream. A compressed
record cannot be read in place, so the first read of one decompresses it, streaming in
``BLOCK``-sized reads (memory stays bounded however large it is), into a temporary local file
(under ``TMPDIR``) that is read from then on like any other; the files go when the checkpoint's
files are closed or the process exits. Writing compresses each record of a finished file the same way.

>>> files = DecompressingFiles(CheckpointFiles("step-100-zstd"))          # doctest: +SKIP
>>> files.decompressed("__0_0.distcp", 0, 3104)                           # doctest: +SKIP
('<zstd>/0', 8496)
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path

from dcptool.errors import CheckpointError, UsageError, printable
from dcptool.storage import CheckpointFiles, LocalFolder

ZSTD = "stream.zstd/1"  # ZStandard.get_descriptor() of torch 2.13
SUPPORTED = (ZSTD,)
BLOCK = 4 * 2**20
# A record decompresses to at most its elements plus this much archive (zip headers, data.pkl): more is a
# zstd bomb, refused before it fills the disk. Object records (pickled state) may hold up to OBJECT_LIMIT.
ARCHIVE_SLACK = 2**20
OBJECT_LIMIT = 2**30
_SPILL = "<zstd>/"  # names of decompressed records: no checkpoint file can be called so


def _zstandard():
    try:
        import zstandard
    except ImportError:
        raise UsageError("reading or writing zstd-compressed DCP needs the zstandard package: "
                         "pip install 'dcptool[zstd]'") from None
    return zstandard


def encoding_of(transforms, at: str) -> str:
    """The chunk encoding of a record stored with ``transforms`` (None or empty: a plain archive)."""
    if not transforms:
        return "torch-archive"
    if isinstance(transforms, (list, tuple)) and tuple(transforms) == (ZSTD,):
        return "zstd-archive"
    shown = ", ".join(printable(t, 40) if isinstance(t, str) else type(t).__name__ for t in transforms[:4]) \
        if isinstance(transforms, (list, tuple)) else type(transforms).__name__
    raise CheckpointError(f"{at} is stored with transforms [{shown}]; dcptool reads {', '.join(SUPPORTED)} only")


class DecompressingFiles(CheckpointFiles):
    """A checkpoint's files, plus its compressed records decompressed on first use under names of their own."""

    def __init__(self, files: CheckpointFiles):
        self.__dict__.update(files.__dict__)  # the same store, caches and lock: one view of the folder
        self._spill_lock = threading.Lock()
        self._spilled: dict[tuple[str, int], tuple[str, int]] = {}
        self._record_locks: dict[tuple[str, int], threading.Lock] = {}
        self._names = itertools.count()
        self._folder: Path | None = None
        self._spill: LocalFolder | None = None

    def decompressed(self, relative: str, offset: int, length: int, limit: int = OBJECT_LIMIT) -> tuple[str, int]:
        """``(name, size)`` of the record ``[offset, offset+length)`` of ``relative``, decompressed
        (refused when it would exceed ``limit`` bytes)."""
        record = (relative, offset)
        with self._spill_lock:
            done = self._spilled.get(record)
            lock = self._record_locks.setdefault(record, threading.Lock())
        if done:
            return done
        with lock:  # one thread decompresses; the others wait for it
            with self._spill_lock:
                done = self._spilled.get(record)
                if done:
                    return done
                if self._folder is None:
                    self._folder = Path(tempfile.mkdtemp(prefix="dcptool-zstd-"))
                    atexit.register(shutil.rmtree, self._folder, True)
                    self._spill = LocalFolder(self._folder)
                name = str(next(self._names))
            size = self._decompress(relative, offset, length, self._folder / name, limit)
            with self._spill_lock:
                self._spilled[record] = (_SPILL + name, size)
            return _SPILL + name, size

    def _decompress(self, relative: str, offset: int, length: int, target: Path, limit: int) -> int:
        zstandard = _zstandard()
        window = self.window(relative, offset, length)
        size = 0
        try:
            with open(target, "wb") as out, zstandard.ZstdDecompressor().stream_reader(
                    window, read_size=min(BLOCK, max(length, 1)), read_across_frames=True) as reader:
                while block := reader.read(BLOCK):
                    size += len(block)
                    if size > limit:
                        raise CheckpointError(f"{self.path(relative)}: the zstd record at byte {offset:,} "
                                              f"decompresses to more than the {limit:,} bytes it can hold")
                    out.write(block)
        except zstandard.ZstdError as exc:
            raise CheckpointError(f"{self.path(relative)}: the zstd record at byte {offset:,} is corrupt "
                                  f"({printable(str(exc), 120)})") from None
        return size

    # Names of decompressed records are read from the temporary folder; all others from the checkpoint's.

    def path(self, relative: str):
        if relative.startswith(_SPILL):
            return self._spill.path(relative[len(_SPILL):])
        return super().path(relative)

    def _size_or_none(self, relative: str) -> int | None:
        if relative.startswith(_SPILL):
            return self._spill.file_size(relative[len(_SPILL):])
        return super()._size_or_none(relative)

    def local_fd(self, relative: str) -> int | None:
        if relative.startswith(_SPILL):
            return self._spill.fd(relative[len(_SPILL):])
        return super().local_fd(relative)

    def read_into(self, relative: str, offset: int, buffer: memoryview) -> None:
        if relative.startswith(_SPILL):
            self.check_range(relative, offset, len(buffer))
            self._spill.read_into(relative[len(_SPILL):], offset, buffer)
            return
        super().read_into(relative, offset, buffer)

    def close(self) -> None:
        super().close()
        with self._spill_lock:
            if self._spill is not None:
                self._spill.close()
                shutil.rmtree(self._folder, ignore_errors=True)
                self._spill, self._folder = None, None
                self._spilled.clear()


def compress_records(folder: Path, name: str, records: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Rewrite ``folder/name`` with each record ``(offset, length)`` compressed, in order, as torch's
    ZStandard extension writes them; returns the records' new ``(offset, length)``. Streams in ``BLOCK``s."""
    zstandard = _zstandard()
    source, target = folder / name, folder / f"{name}.zstd-partial"
    placed = []
    with open(source, "rb") as raw, open(target, "wb") as out:
        for offset, length in records:
            start = out.tell()
            raw.seek(offset)
            writer = zstandard.ZstdCompressor().stream_writer(out, closefd=False, size=length)
            left = length
            while left:
                block = raw.read(min(BLOCK, left))
                writer.write(block)
                left -= len(block)
            writer.close()
            placed.append((start, out.tell() - start))
    os.replace(target, source)
    return placed
