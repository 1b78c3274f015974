"""A full state dict in one ``torch.save`` file (nested dicts allowed), e.g. ``model.pt`` or ``pytorch_model.bin``.

Read without torch through dcptool's restricted unpickler (the same allowlist as ``weights_only=True``);
tensor bytes are read in place from the archive. The writer produces a file that
``torch.load(path, weights_only=True, mmap=True)`` reads; tensors inside non-tensor entries (torch's
RNG state in a Trainer's ``rng_state_<r>.pth``) are stored in it as real storages too.
"""

from __future__ import annotations

import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from dcptool.core import Checkpoint, Chunk, ObjectInfo, OutTensor, Piece, TensorInfo, join_path
from dcptool.errors import CheckpointError, UsageError, printable, utf8_problem
from dcptool.safe_pickle import TensorRef
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.torch_archive import Archive, ArchiveLayout, StorageOut, TensorOut, Unpicklable, dumps

NAME = "torch"
WRITES_FOLDER = False


def detect(files: CheckpointFiles) -> bool:
    name = files.single_file
    if not name or name.endswith(".safetensors"):
        return False
    try:
        return zipfile.is_zipfile(files.window(name, 0, files.size(name)))
    except (zipfile.BadZipFile, ValueError, struct.error):  # a zip directory that says nonsense: read() says what
        return True


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
                                      "per-rank files are read with --from fsdp1")
            tensors[key] = _tensor_info(archive, value, nested)
        else:
            objects[key] = ObjectInfo(nested, value=value)
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects)
    checkpoint.validate()
    return checkpoint


def _tensor_info(archive: Archive, tensor: TensorRef, path: tuple) -> TensorInfo:
    """A plain tensor of ``archive`` as one chunk: its elements where they lie in the file."""
    raw = archive.raw_bytes(tensor)
    chunk = Chunk(tuple(0 for _ in raw.shape), raw.shape, raw.file, raw.offset, raw.span, "raw", raw.strides)
    return TensorInfo(path, tensor.dtype.name, raw.shape, [chunk])


def split_object(checkpoint: Checkpoint, obj: ObjectInfo, path: tuple) -> tuple[dict[tuple, Any], list[TensorInfo]]:
    """An object as entries of ``nest`` under ``path``, and the tensors inside it as tensors of their own.

    A tensor inside an object (torch's CPU RNG state in a Trainer's ``rng_state_<r>.pth``) is split
    out as ``read`` splits a file's tensors (``flatten``), its elements read in place from the
    object's archive: a writer stores it like any tensor, as a storage of its own archive, and
    ``nest`` puts it back in its place. Raises ``Unpicklable`` for a tensor that cannot be split out.
    """
    value = checkpoint.object_value(obj)
    if not _holds_tensor(value, {}):
        return {path: value}, []
    if obj.blob is None:  # readers split out the tensors of what they unpickle whole: none are left
        raise Unpicklable(f"{printable(join_path(path))}: holds tensors outside a torch.save archive")
    archive = Archive(checkpoint.files, *obj.blob)
    entries, tensors = {}, []
    for nested, leaf in flatten(value, path, archive.where):
        if not isinstance(leaf, TensorRef):
            entries[nested] = leaf
        elif leaf.subclass:
            raise Unpicklable(f"{archive.where}: {printable(join_path(nested))} is a {printable(leaf.subclass)}, "
                              "not a plain tensor")
        else:
            tensors.append(_tensor_info(archive, leaf, nested))
    return entries, tensors


def flatten(obj, prefix: tuple[str, ...] = (), where: object = "state dict"):
    """Yield ``(path, leaf)`` as DCP flattens a state dict: into dicts, and into lists that hold tensors.

    Keys become their ``str``, as in DCP; one that is not UTF-8 text is refused, naming ``where``.
    ``obj`` comes from ``safe_pickle.load_bytes``, which bounds its nesting and size.
    """
    yield from _flatten(obj, prefix, where, {})


def _flatten(obj, prefix: tuple, where, holds: dict):
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            name = key if type(key) is str else str(key)
            problem = utf8_problem(name)
            if problem:
                raise CheckpointError(f"{where}: the key under {printable(join_path(prefix)) or 'the top level'} {problem}")
            yield from _flatten(value, prefix + (name,), where, holds)
    elif isinstance(obj, (list, tuple)) and prefix and _holds_tensor(obj, holds):
        for index, value in enumerate(obj):
            yield from _flatten(value, prefix + (index,), where, holds)
    else:
        yield prefix, obj


def _holds_tensor(obj, seen: dict[int, bool]) -> bool:
    """Whether a tensor is nested in ``obj``'s dicts, lists and tuples (each shared container looked at once)."""
    found = seen.get(id(obj))
    if found is None:
        if isinstance(obj, TensorRef):
            found = True
        elif isinstance(obj, dict):
            found = any(_holds_tensor(value, seen) for value in obj.values())
        elif isinstance(obj, (list, tuple)):
            found = any(_holds_tensor(value, seen) for value in obj)
        else:
            found = False
        seen[id(obj)] = found  # obj lives as long as the state dict it is in: its id stays its own
    return found


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
