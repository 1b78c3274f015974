"""A full state dict in one ``torch.save`` file (nested dicts allowed), e.g. ``model.pt`` or ``pytorch_model.bin``.

Read without torch through dcptool's restricted unpickler (the same allowlist as ``weights_only=True``);
tensor bytes are read in place from the archive. The writer produces a file that
``torch.load(path, weights_only=True, mmap=True)`` reads; tensors inside non-tensor entries (torch's
RNG state in a Trainer's ``rng_state_<r>.pth``) are stored in it as real storages too.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dcptool.engine.core import Checkpoint, ObjectInfo, OutTensor, Piece, TensorInfo, join_path
from dcptool.errors import CheckpointError, printable, option
from dcptool.safe_pickle import TensorRef
from dcptool.format_interface import Format
from dcptool.state_dicts import archive_tensor, flatten, nest, split_object
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.torch_archive import Archive, ArchiveLayout, StorageOut, TensorOut, Unpicklable, dumps

NAME = "torch"


# What a torch.save file is known by even when damaged (cut short, its zip directory lost), so that
# ``read`` says what is wrong with it rather than the file going unrecognized.
SUFFIXES = (".pt", ".pth", ".bin")
ZIP_LOCAL_HEADER = b"PK\x03\x04"  # torch.save's archive starts with its first record's header


def detect(files: CheckpointFiles) -> bool:
    name = files.single_file
    if not name or name.endswith(".safetensors"):
        return False
    return name.endswith(SUFFIXES) or files.read(name, 0, min(files.size(name), len(ZIP_LOCAL_HEADER))) == ZIP_LOCAL_HEADER


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
    for nested, value in flatten(root, where=path):
        key = join_path(nested)
        if key in tensors or key in objects:
            raise CheckpointError(f"{path}: two entries flatten to the key {printable(key)}")
        if isinstance(value, TensorRef):
            if value.subclass:
                raise CheckpointError(f"{path}: {printable(key)} is a {printable(value.subclass)}; "
                                      f"per-rank files are read with {option('format', 'fsdp1')}")
            tensors[key] = archive_tensor(archive, value, nested)
        else:
            objects[key] = ObjectInfo(nested, value=value)
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects)
    checkpoint.validate()
    return checkpoint


class Writer:
    """Writes one ``torch.save`` file: the pickled nested dict first, then each tensor's storage.

    Tensors inside objects get storages like the others (``split_object``). An object the pickle
    cannot hold (one with a stand-in of the restricted unpickler inside, such as a ``Record``) is
    left out, and ``finish_index`` names it. One file cannot be split between writers: under
    torchrun rank 0 writes it all.
    """

    NEEDS_CRC = True

    def __init__(self, file: Path):
        self.name = file.name
        self.out = OutputFiles(file.parent)
        self.left_out: list[str] = []

    def plan(self, tensors, objects):
        split = {}
        for obj in objects:
            try:
                entries, inside = split_object(obj.checkpoint, obj.source, tuple(obj.path))
            except Unpicklable:
                self.left_out.append(obj.key)
                continue
            split[obj.key] = entries, [OutTensor(t.key, t.path, t.dtype, t.shape, t) for t in inside]
        try:
            return self._plan(tensors, split)
        except Unpicklable:  # rare: pickle the objects one by one to find those that cannot be, and plan without them
            unpicklable = [key for key, (entries, _) in split.items() if not _picklable(entries)]
            self.left_out += unpicklable
            return self._plan(tensors, {key: found for key, found in split.items() if key not in unpicklable})

    def _plan(self, tensors, split: dict[str, tuple[dict, list[OutTensor]]]):
        tensors = [*tensors, *(tensor for _, inside in split.values() for tensor in inside)]
        storages = {t.key: StorageOut(str(i), t.dtype, math.prod(t.shape)) for i, t in enumerate(tensors)}
        entries = {t.path: TensorOut(storages[t.key], t.shape) for t in tensors}
        for found, _ in split.values():
            entries |= found
        self.layout = ArchiveLayout(dumps(nest(entries)))
        self._start = {t.key: self.layout.add_storage(storages[t.key].key, t.nbytes) for t in tensors}
        self.layout.close()
        self.storages = storages
        self.total = sum(t.nbytes for t in tensors)
        return [Piece(t, tuple(0 for _ in t.shape), tuple(t.shape)) for t in tensors]

    def place(self, piece) -> tuple[str, int]:
        return self.name, self._start[piece.tensor.key]

    def files(self) -> dict[str, int]:
        return {self.name: self.total}

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        if files:
            by_storage = {self.storages[piece.tensor.key].key: crc for piece, crc in crcs.items()}
            for offset, data in self.layout.segments(by_storage):
                self.out.write_at(self.name, offset, data)
        return {}

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """Nothing to index; returns the objects the pickle cannot hold."""
        return self.left_out


def _picklable(entries: dict[tuple, Any]) -> bool:
    try:
        dumps(nest(entries))
    except Unpicklable:
        return False
    return True


class TorchSave(Format):
    """A single ``torch.save`` file of a state dict (``.pt``, ``.pth``, ``.bin``)."""

    name = NAME
    title = "torch.save"
    writes_folder = False
    config_home = None  # one file: the config cannot travel inside it

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer


FORMAT = TorchSave()
