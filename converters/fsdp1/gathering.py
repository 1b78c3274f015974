"""Every rank's file gathered into whole tensors and objects: the chunks each rank holds, placed by the
global offsets its values record; a copy a rank repeats (a replicated buffer) kept once."""

from __future__ import annotations

from dcptool.engine.chunks import Chunk
from dcptool.engine.core import ObjectInfo, join_path
from dcptool.errors import CheckpointError, printable
from dcptool.state_dicts import flatten
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive
from dcptool.converters.fsdp1.codecs import local_chunks
from dcptool.converters.fsdp1.folder import file_name


class Gathered:
    """One tensor's chunks as they come in from the ranks; a replicated copy of a chunk is kept once."""

    def __init__(self, path, dtype, shape, first_file):
        self.path, self.dtype, self.shape, self.first_file = path, dtype, shape, first_file
        self.chunks: list[Chunk] = []
        self._boxes: set = set()

    def add(self, chunks: list[Chunk]) -> None:
        """Take a rank's chunks of the tensor, but empty ones and boxes another rank brought already."""
        for chunk in chunks:
            box = (chunk.offsets, chunk.sizes)
            if chunk.numel == 0 or box in self._boxes:
                continue
            self._boxes.add(box)
            self.chunks.append(chunk)


class NotRead(Exception):
    """A part of the folder that is left out of the checkpoint, with the line that says why."""


def read_part(files: CheckpointFiles, kind: str, prefix: tuple, world_size: int, tensors: dict, objects: dict,
              kinds: dict, roots: list[dict] | None = None, same_keys: bool = True) -> list[tuple[str, str]]:
    """Gather every rank's ``{kind}_world_size_W_rank_r.pt`` into ``tensors`` and ``objects``, under ``prefix``.

    ``roots``: the ranks' state dicts to gather, when the caller loaded (and rewrote) them.
    ``same_keys``: every rank must hold the same tensors. Returns rank 0's tensor keys in file order,
    each with the kind of its value (``ShardedTensor``, ``DTensor``, ``plain tensor``).
    """
    keys_of_rank0: list[tuple[str, str]] | None = None
    for rank in range(world_size):
        relative = file_name(kind, world_size, rank)
        archive = Archive(files, relative)
        root = archive.load() if roots is None else roots[rank]
        if not isinstance(root, dict):
            raise CheckpointError(f"{archive.where}: holds a {type(root).__name__}, not a state dict")
        found = gather_rank(archive, root, prefix, tensors, objects, kinds)
        if keys_of_rank0 is None:
            keys_of_rank0 = found
        elif same_keys and sorted(key for key, _ in found) != sorted(key for key, _ in keys_of_rank0):
            differ = sorted({key for key, _ in found} ^ {key for key, _ in keys_of_rank0})
            raise CheckpointError(
                f"{archive.where}: holds different tensors than {file_name(kind, world_size, 0)} "
                f"(e.g. {printable(differ[0])})"
            )
    return keys_of_rank0 or []


def gather_rank(archive: Archive, root: dict, prefix: tuple, tensors: dict, objects: dict,
                kinds: dict) -> list[tuple[str, str]]:
    """Add one rank's entries: tensor chunks to ``tensors``; objects as the first file holding them has them.
    ``kinds`` gets the first value of each kind found (``DTensor``: its mesh is what output_forms copies)."""
    found, seen = [], set()
    for nested, value in flatten(root, where=archive.where):
        path = prefix + nested
        key = join_path(path)
        if key in seen:
            raise CheckpointError(f"{archive.where}: two entries flatten to the key {printable(key)}")
        seen.add(key)
        local = local_chunks(archive, key, value)
        if local is None:
            if key in tensors:
                raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor in other ranks' files, not here")
            objects.setdefault(key, ObjectInfo(path, value=value))
            continue
        if key in objects:
            raise CheckpointError(f"{archive.where}: {printable(key)} is a tensor here but not in other ranks' files")
        kind, dtype, shape, chunks = local
        kinds.setdefault(kind, value)
        found.append((key, kind))
        gathered = tensors.get(key)
        if gathered is None:
            gathered = tensors[key] = Gathered(path, dtype, shape, archive.where)
        elif (gathered.dtype, gathered.shape) != (dtype, shape):
            raise CheckpointError(
                f"{archive.where}: {printable(key)} is {dtype}{list(shape)}, but {gathered.first_file} says "
                f"{gathered.dtype}{list(gathered.shape)}"
            )
        gathered.add(chunks)
    return found
