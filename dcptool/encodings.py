"""Chunk encodings: how a record stores a chunk's elements, read by the codec module that registered it.

A ``chunks.Chunk`` names its encoding; ``core.Checkpoint`` finds it here (``get``) and calls it, never
naming one itself. Each codec module registers its encodings when it is imported (``register``):
``dcptool.torch_archive`` a ``torch.save`` archive of one tensor (DCP's chunk records),
``dcptool.engine.compression`` such an archive in a zstd record. A reader that makes chunks of an encoding
has imported its codec, so a new encoding is its codec module and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Encoding:
    """How the records of one encoding are read.

    ``locate(files, tensor, chunk)``: where the elements of ``chunk`` (a ``chunks.Chunk`` of the
    ``core.TensorInfo`` ``tensor``, in the ``storage.CheckpointFiles`` ``files``) are, a
    ``torch_archive.RawBytes``, its record opened and checked against the chunk's dtype and sizes.
    ``record(files, tensor, chunk, label)``: the storage of ``chunk``'s record whose CRC-32 is checked where its
    bytes are read (a ``torch_archive.records.StoredData``, the record's structure checked as it is
    opened; ``label`` names the chunk in messages), or None. ``uniform``: records of one dtype, shape and length hold their
    elements at the same place in them, so a checkpoint opens one record of each such shape, not each.
    ``layout(files, tensor, chunk, label)``: for a ``uniform`` encoding, the layout that the records of
    ``chunk``'s dtype, shape and length share (a ``torch_archive.layouts.RecordLayout``, learned from ``chunk``'s
    record, checked whole), which checks such records many at once; None where they cannot be.
    ``front_to_back``: a record is read from its start (a compressed stream): reads of one record go best in
    order, each resuming where the one before stopped (``dcptool.engine.transfer`` runs them on one thread).
    """

    name: str
    locate: Callable[[Any, Any, Any], Any]
    record: Callable[[Any, Any, Any, str], Any] | None = None
    uniform: bool = False
    layout: Callable[[Any, Any, Any, str], Any] | None = None
    front_to_back: bool = False


_REGISTERED: dict[str, Encoding] = {}


def register(encoding: Encoding) -> None:
    """Make records of ``encoding.name`` readable (a codec module registers its encodings once, when imported)."""
    _REGISTERED[encoding.name] = encoding


def get(name: str) -> Encoding | None:
    """The encoding registered as ``name``; None when no codec imported so far registered it."""
    return _REGISTERED.get(name)
