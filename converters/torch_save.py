"""A full state dict in one ``torch.save`` file (nested dicts allowed), e.g. ``model.pt`` or ``pytorch_model.bin``.

Read without torch through dcptool's restricted unpickler (the same allowlist as ``weights_only=True``);
tensor bytes are read in place from the archive. The writer produces a file that
``torch.load(path, weights_only=True, mmap=True)`` reads.
"""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

from dcptool.core import Checkpoint, Chunk, ObjectInfo, Piece, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError
from dcptool.safe_pickle import TensorRef, walk
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive, ArchiveWriter, StorageOut, TensorOut

NAME = "torch"
WRITES_FOLDER = False


def detect(files: CheckpointFiles) -> bool:
    name = files.single_file
    if not name or name.endswith(".safetensors"):
        return False
    return zipfile.is_zipfile(files.window(name, 0, files.size(name)))


def read(files: CheckpointFiles) -> Checkpoint:
    if not files.single_file:
        raise CheckpointError(f"{files.location}: not a file (a torch.save checkpoint is one file)")
    path = files.path(files.single_file)
    archive = Archive(files, files.single_file)
    root = archive.load()
    if not isinstance(root, dict):
        raise CheckpointError(f"{path}: holds a {type(root).__name__}, not a state dict")
    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for nested, value in flatten(root):
        key = join_path(nested)
        if isinstance(value, TensorRef):
            if value.subclass:
                raise CheckpointError(f"{path}: {key} is a {value.subclass}; per-rank files are read with --from fsdp1")
            raw = archive.raw_bytes(value)
            chunk = Chunk(tuple(0 for _ in raw.shape), raw.shape, raw.file, raw.offset, raw.span, "raw", raw.strides)
            tensors[key] = TensorInfo(nested, value.dtype.name, raw.shape, [chunk])
        else:
            objects[key] = ObjectInfo(nested, value=value)
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects)
    checkpoint.validate()
    return checkpoint


def flatten(obj, prefix: tuple[str, ...] = ()):
    """Yield ``(path, leaf)`` as DCP flattens a state dict: into dicts, and into lists that hold tensors."""
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            yield from flatten(value, prefix + (str(key),))
    elif isinstance(obj, (list, tuple)) and prefix and _holds_tensor(obj):
        for index, value in enumerate(obj):
            yield from flatten(value, prefix + (index,))
    else:
        yield prefix, obj


def _holds_tensor(obj) -> bool:
    found = []
    walk(obj, lambda item: found.append(True) if isinstance(item, TensorRef) else None)
    return bool(found)


def nest(entries: dict[tuple, object]) -> dict:
    """Rebuild the nesting from paths, as DCP does: ``{("model", "w"): t, ("groups", 0, "lr"): 1}`` ->
    ``{"model": {"w": t}, "groups": [{"lr": 1}]}`` (int parts index lists)."""
    root: dict = {}
    for path, value in entries.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"{join_path(path)}: a parent of this entry is itself an entry")
        if path[-1] in node:
            raise UsageError(f"{join_path(path)}: two entries have this path")
        node[path[-1]] = value
    return _lists(root)


def _lists(node):
    if not isinstance(node, dict):
        return node
    node = {key: _lists(value) for key, value in node.items()}
    if node and all(isinstance(k, int) for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node


class Writer:
    """Writes one ``torch.save`` file: the pickled nested dict first, then each tensor's bytes streamed in.

    One file cannot be split between writers: under torchrun rank 0 writes it all.
    """

    def __init__(self, file: Path):
        self.file = file
        self.stream = self.archive = None

    def plan(self, tensors, objects):
        storages = {t.key: StorageOut(str(i), t.dtype, math.prod(t.shape)) for i, t in enumerate(tensors)}
        entries = {t.path: TensorOut(storages[t.key], t.shape) for t in tensors}
        entries |= {o.path: o.value() for o in objects}
        self.state_dict = nest(entries)
        self.storages = storages
        self.total = sum(t.nbytes for t in tensors)
        return [Piece(t, tuple(0 for _ in t.shape), tuple(t.shape)) for t in tensors]

    def file_of(self, piece) -> str:
        return self.file.name

    def files(self) -> dict[str, int]:
        return {self.file.name: self.total}

    def _open_archive(self) -> ArchiveWriter:
        """The archive, opened on first use (only by the process that writes the file)."""
        if self.archive is None:
            self.stream = open(self.file, "wb")
            self.archive = ArchiveWriter(self.stream)
            self.archive.add_pickle(self.state_dict)
        return self.archive

    def write_piece(self, piece, slabs) -> None:
        self._open_archive().add_storage(self.storages[piece.tensor.key], slabs)

    def finish_files(self, objects, files: set[str]) -> dict:
        if files:
            self._open_archive().close()
            self.stream.close()
        return {}

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        return []
