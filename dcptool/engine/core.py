"""The format-neutral description of a checkpoint that every reader produces and every writer consumes.

A checkpoint is a set of tensors and opaque objects, each under its nested path (``("model",
"layers", "0", "weight")``, flattened with ``.`` into its key, as DCP does). A tensor has a dtype, a
global shape and chunks: rectangular pieces with global offsets and sizes and the place of their
bytes. Any rectangular region of a tensor is assembled from the chunks that overlap it.

>>> ckpt = dcptool.open_checkpoint("step-100")          # doctest: +SKIP
>>> t = ckpt.tensors["model.embed_tokens.weight"]       # doctest: +SKIP
>>> t.dtype, t.shape, len(t.chunks)                     # doctest: +SKIP
('bfloat16', (32000, 4096), 8)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dcptool import dtypes
from dcptool.engine.chunks import Chunk, ChunkTable, check_cover
from dcptool.engine.reading import StoredBytes, workspace
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive, RawBytes
from dcptool.torch_archive.layouts import RecordLayout

# The problems of single entries found while a checkpoint is opened under ``entry_problems``.
_entry_problems: ContextVar[list[tuple[str, str, CheckpointError]] | None] = ContextVar("entry_problems", default=None)


@contextlib.contextmanager
def entry_problems() -> Iterator[list[tuple[str, str, CheckpointError]]]:
    """While a checkpoint is opened in this context, a problem of one entry (what its metadata says of it, its
    chunks' cover) is collected as ``(kind, key, error)`` and the entry left out, where it would stop the
    opening: ``check`` names every problem, not the first."""
    found: list[tuple[str, str, CheckpointError]] = []
    token = _entry_problems.set(found)
    try:
        yield found
    finally:
        _entry_problems.reset(token)


def entry_problem(kind: str, key: str, error: CheckpointError) -> None:
    """Raise ``error``, a problem of the entry ``key`` (``metadata``, ``cover``), unless ``entry_problems`` collects
    them; the caller then leaves the entry out."""
    found = _entry_problems.get()
    if found is None:
        raise error
    found.append((kind, key, error))


@dataclass
class TensorInfo:
    path: tuple[str | int, ...]  # nested path as saved; ints index into lists
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] | ChunkTable
    # Computes the values from source regions instead of reading the chunks' bytes (a ``Computed``:
    # dequantized weights, averages, merged adapters); the chunks give the layout.
    transform: Computed | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        return join_path(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


class Computed:
    """How the regions of a computed tensor are made from regions of source tensors (``TensorInfo.transform``).

    ``read(checkpoint, offsets, sizes, out, scratch)`` fills ``out`` (an unsigned view of the tensor's item
    size, shape ``sizes``) with the region at ``offsets``; ``checkpoint`` is the one the tensor belongs to,
    ``scratch`` a read buffer it may use (``Checkpoint.read_region``'s). Copies plan such tensors as any
    other: in slabs of the pieces a writer asks for, split over threads and torchrun ranks
    (``dcptool.engine.transfer``), each slab's temporaries bounded by ``work_bytes`` per element. Sources read with
    ``passing=True`` hand in their records' CRC-32s as they pass; the copy finishes the checks of
    ``checkpoint`` and of the ``others`` a computation reads.
    """

    work_bytes: int = 16  # bytes of temporaries per output element of a read (transfer sizes slabs by them)
    # Rows of its matrices (the last two dims) whose values are computed together: a region of whole such blocks
    # of rows reads nothing it does not write (block-scaled quantization's scales need every row of their block).
    # Transfer plans slabs of whole blocks of rows where a task holds one.
    rows_together: int = 1

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        raise NotImplementedError

    def others(self) -> tuple[Checkpoint, ...]:
        """Checkpoints other than the tensor's own that ``read`` reads."""
        return ()


def float32_region(checkpoint: Checkpoint, tensor: TensorInfo, offsets, sizes, scratch: memoryview,
                   out: np.ndarray) -> np.ndarray:
    """Fill ``out`` (float32, shape ``sizes``) with a region of a floating-point tensor (float64 rounded to
    nearest, float8 decoded exactly), read for a computation: its records' CRC-32s handed in as they pass
    (``Computed``). Returns ``out``."""
    if tensor.dtype == "float32":
        checkpoint.read_region(tensor, offsets, sizes, out.view(np.uint32), scratch, passing=True)
        return out
    bits = workspace("float32_region", sizes, dtypes.raw_view_type(dtypes.dtype(tensor.dtype).itemsize))
    checkpoint.read_region(tensor, offsets, sizes, bits, scratch, passing=True)
    if tensor.dtype == "bfloat16":  # its bits are the top half of the float32's
        np.left_shift(bits, 16, out=out.view(np.uint32), dtype=np.uint32)
    elif tensor.dtype in dtypes.FLOAT8:
        np.take(dtypes.float8_to_float32(np.arange(256, dtype=np.uint8), tensor.dtype), bits, out=out)
    else:  # float16, float64
        out[...] = bits.view(dtypes.dtype(tensor.dtype).numpy)
    return out


def join_path(path) -> str:
    """The flat key of a nested path, as DCP writes it: ``("optim", "param_groups", 0, "lr")`` -> ``optim.param_groups.0.lr``."""
    return ".".join(str(part) for part in path)


_UNSET: Any = object()


@dataclass
class ObjectInfo:
    """A non-tensor entry (step counter, scheduler or dataloader state), carried through unopened.

    ``blob`` locates a ``torch.save`` archive of the value (DCP's bytes entries); ``value`` holds it
    when the reader had to parse it anyway (entries of a ``torch.save`` state dict).
    """

    path: tuple[str | int, ...]
    blob: tuple[str, int, int] | None = None  # (file, offset, length)
    value: Any = field(default=_UNSET, repr=False)

    @property
    def key(self) -> str:
        return join_path(self.path)


@dataclass
class Checkpoint(StoredBytes):
    """What a reader found: the format, the tensors and objects, and the files they live in."""

    format: str
    root: Path | str  # a local path, or the URL it was read from
    files: CheckpointFiles
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    info: dict[str, Any] = field(default_factory=dict)  # format facts worth showing (world size, ...)
    # Filled from several threads (dcptool.engine.transfer): a race resolves a chunk twice, to the same value.
    _resolved: dict[Chunk, RawBytes] = field(default_factory=dict, repr=False)
    # (encoding, dtype, sizes, record length) -> where the elements start in records of a uniform encoding
    _layouts: dict[tuple, int] = field(default_factory=dict, repr=False)
    # the same -> the layout such records share, which checks them a batch at a time (None: they are checked alone)
    _record_layouts: dict[tuple, RecordLayout | None] = field(default_factory=dict, repr=False)

    def with_entries(self, tensors: dict[str, TensorInfo], objects: dict[str, ObjectInfo]) -> Checkpoint:
        """The same checkpoint holding these entries (renamed or added views of its own), sharing what it has
        learned of where its chunks' bytes are."""
        return Checkpoint(self.format, self.root, self.files, tensors, objects, dict(self.info), self._resolved,
                          self._layouts, self._record_layouts)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def data_files(self) -> list[str]:
        """The files the entries' bytes live in, relative to ``root``."""
        used = {f for t in self.tensors.values() for f in
                (t.chunks.files if isinstance(t.chunks, ChunkTable) else [c.file for c in t.chunks])}
        used |= {self.files.stored_in(o.blob[0]) for o in self.objects.values() if o.blob}
        return sorted(used)

    def validate(self) -> None:
        """Check that every tensor's chunks lie inside it and cover it exactly once (``entry_problem``)."""
        for key, tensor in list(self.tensors.items()):
            try:
                check_cover(tensor, where=str(self.root))
            except CheckpointError as exc:
                entry_problem("cover", key, exc)
                del self.tensors[key]

    def object_value(self, obj: ObjectInfo) -> Any:
        """The object's value, unpickled with the allowlist (tensors inside come back as references)."""
        if obj.value is _UNSET:
            obj.value = self.object_archive(obj).load()
        return obj.value

    def object_blob(self, obj: ObjectInfo) -> bytes | None:
        """The object's ``torch.save`` bytes when the checkpoint stores them as such, else None."""
        if obj.blob is None:
            return None
        self.object_archive(obj)
        file, offset, length = obj.blob
        return self.files.read(file, offset, length)

    def object_archive(self, obj: ObjectInfo) -> Archive:
        """The ``torch.save`` archive of an object stored as one, checked whole (it is small) unless records
        are not checked."""
        archive = Archive(self.files, *obj.blob, label=obj.key)
        archive.check_storages()
        return archive


# What writers consume: output tensors and objects, and the pieces a writer stores them as.


@dataclass(eq=False)  # compared and hashed by identity: pieces of one tensor share it
class OutTensor:
    """A tensor as it will be written: output key and nested path, dtype, shape, and its source."""

    key: str
    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    source: TensorInfo

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.dtype(self.dtype).itemsize


@dataclass
class OutObject:
    """A non-tensor entry as it will be written; ``value()`` and ``blob()`` fetch it from the source."""

    key: str
    path: tuple[str, ...]
    source: ObjectInfo
    checkpoint: Checkpoint = field(repr=False)
    merged: list[ObjectInfo] = field(default_factory=list)  # other source entries it is made of (all carried)

    def value(self) -> Any:
        return self.checkpoint.object_value(self.source)

    def blob(self) -> bytes | None:
        return self.checkpoint.object_blob(self.source)


@dataclass(frozen=True)
class Piece:
    """A rectangular region of an output tensor that a writer stores as one unit (a chunk, a shard)."""

    tensor: OutTensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * dtypes.dtype(self.tensor.dtype).itemsize
