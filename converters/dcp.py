"""PyTorch Distributed Checkpoint (DCP): a folder with ``.metadata`` and ``__{rank}_{n}.distcp`` files.

Read offline with no process group; ``.metadata`` goes through dcptool's restricted unpickler, so
inspecting a hostile checkpoint runs no code. Each tensor chunk is a ``torch.save`` archive at a
known offset of a ``.distcp`` file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dcptool import safe_pickle
from dcptool.core import Checkpoint, Chunk, ObjectInfo, Piece, TensorInfo
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import ArchiveWriter, Global, Reduced, StorageOut, TensorOut, dumps, new_object, torch_size

NAME = "dcp"
WRITES_FOLDER = True
METADATA = ".metadata"
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")


def saving_rank(file: str) -> int | None:
    """The rank whose ``dcp.save`` wrote a data file (``__3_0.distcp`` -> 3)."""
    match = _DATA_FILE.match(file)
    return int(match.group(1)) if match else None


def detect(files: CheckpointFiles) -> bool:
    return files.is_dir() and (files.is_file(METADATA) or bool(files.names("*.distcp")))


def read(files: CheckpointFiles) -> Checkpoint:
    if not files.is_dir():
        raise CheckpointError(f"{files.location}: not a folder (a DCP checkpoint is a folder with a .metadata file)")
    where = str(files.path(METADATA))
    if not files.is_file(METADATA):
        raise CheckpointError(f"{where}: missing (a DCP checkpoint folder needs its .metadata file)")
    metadata = safe_pickle.load_bytes(files.read_all(METADATA), where)
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{where}: not DCP metadata (holds {type(metadata).__name__})")

    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        offset = getattr(index, "offset", None)
        storage[(index.fqn, tuple(offset) if offset is not None else None)] = info
    planner_data = getattr(metadata, "planner_data", None) or {}

    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for key, entry in metadata.state_dict_metadata.items():
        nested = tuple(planner_data.get(key, (key,)))
        kind = type(entry).__name__
        if kind == "BytesStorageMetadata":
            info = _storage_info(storage, key, None, where)
            objects[key] = ObjectInfo(nested, blob=(info.relative_path, info.offset, info.length))
        elif kind == "TensorStorageMetadata":
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                info = _storage_info(storage, key, offsets, where)
                chunks.append(Chunk(offsets, sizes, info.relative_path, info.offset, info.length, "torch-archive",
                                    rank=saving_rank(info.relative_path)))
            tensors[key] = TensorInfo(nested, _dtype_of(entry.properties, key, where), tuple(entry.size), chunks)
        else:
            raise CheckpointError(f"{where}: {key}: unknown entry type {kind}")

    ranks = {int(m.group(1)) for name in files.names("*.distcp") if (m := _DATA_FILE.match(name))}
    info = {"version": getattr(metadata, "version", None), "world_size": len(ranks) or None}  # one data file per saving rank
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects, info)
    checkpoint.validate()
    return checkpoint


def _storage_info(storage, key, offsets, where):
    info = storage.get((key, offsets))
    if info is None:
        at = f" chunk at {list(offsets)}" if offsets is not None else ""
        raise CheckpointError(f"{where}: {key}{at} has no storage record (metadata is incomplete)")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise CheckpointError(f"{where}: {key} is stored with transforms {list(transforms)}, not supported yet")
    if not isinstance(info.relative_path, str) or not isinstance(info.offset, int) or not isinstance(info.length, int):
        raise CheckpointError(f"{where}: {key}: malformed storage record")
    return info


def _dtype_of(properties, key: str, where: str) -> str:
    value = properties.state[0] if hasattr(properties, "state") else getattr(properties, "dtype", None)
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: {key}: no dtype in tensor properties")
    return str(value)


_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


def data_file(rank: int) -> str:
    """The data file ``dcp.save`` writes on ``rank``: ``__3_0.distcp``."""
    return f"__{rank}_0.distcp"


class Writer:
    """Writes a DCP folder that torch's ``dcp.load`` reads: one ``__{rank}_0.distcp`` per rank, then ``.metadata``.

    ``layout(tensor)`` gives each tensor's chunks as ``(offsets, sizes, rank)``; by default a tensor
    is one chunk in rank 0's file, as a single process saves it. Every one of ``world_size`` ranks
    gets a file, even an empty one, as with ``dcp.save``, so the world size can be read back.
    Non-tensor entries go at the end of rank 0's file. ``finish_files`` returns where each chunk
    went, ``(key, offsets) -> (file, offset, length)``, which ``finish_index`` turns into ``.metadata``.
    """

    def __init__(self, folder: Path, layout=None, world_size: int = 1):
        self.folder = folder
        self.world_size = world_size
        self.layout = layout or (lambda t: [(tuple(0 for _ in t.shape), tuple(t.shape), 0)])
        self._rank_of: dict = {}
        self._records: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        self._streams: dict[int, object] = {}

    def plan(self, tensors, objects):
        pieces = []
        for tensor in tensors:
            for offsets, sizes, rank in self.layout(tensor):
                piece = Piece(tensor, tuple(offsets), tuple(sizes))
                self._rank_of[piece] = rank
                pieces.append(piece)
        pieces.sort(key=lambda p: self._rank_of[p])  # one file at a time
        self.tensors, self.pieces = tensors, pieces
        return pieces

    def file_of(self, piece) -> str:
        return data_file(self._rank_of[piece])

    def files(self) -> dict[str, int]:
        """Every data file with the tensor bytes planned for it."""
        sizes = {data_file(rank): 0 for rank in range(self.world_size)}
        for piece in self.pieces:
            name = self.file_of(piece)
            sizes[name] = sizes.get(name, 0) + piece.nbytes
        return sizes

    def _stream(self, rank: int):
        if rank not in self._streams:
            self._streams[rank] = open(self.folder / data_file(rank), "wb")
        return self._streams[rank]

    def _append(self, rank: int, key: str, offsets, write) -> None:
        """Append one record to rank's file with ``write(stream)`` and remember where it went."""
        stream = self._stream(rank)
        start = stream.tell()
        write(stream)
        self._records[(key, offsets)] = (data_file(rank), start, stream.tell() - start)

    def write_piece(self, piece, slabs) -> None:
        storage = StorageOut("0", piece.tensor.dtype, math.prod(piece.sizes))

        def write(stream):
            archive = ArchiveWriter(stream)
            archive.add_pickle(TensorOut(storage, piece.sizes))
            archive.add_storage(storage, slabs)
            archive.close()

        self._append(self._rank_of[piece], piece.tensor.key, piece.offsets, write)

    def finish_files(self, objects, files: set[str]) -> dict:
        """Complete ``files`` (the objects go into rank 0's); returns where this writer put each record."""
        if data_file(0) in files:
            for obj in objects:
                self._append(0, obj.key, None, lambda stream, obj=obj: _write_object(stream, obj))
        for name in files:
            self._stream(saving_rank(name))
        for stream in self._streams.values():
            stream.close()
        return self._records

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """Write ``.metadata`` from the records of every writer."""
        merged = {where: place for part in records for where, place in part.items()}
        (self.folder / METADATA).write_bytes(dumps(self._metadata(objects, merged), protocol=4))
        return []

    def _metadata(self, objects, records):
        entries, storage = {}, {}
        chunks_of: dict[str, list] = {}
        for piece in self._rank_of:
            chunks_of.setdefault(piece.tensor.key, []).append(piece)
        # In the order one process writes them (file by file, then the objects), whoever wrote them.
        ordered = [(p.tensor.key, p.offsets) for p in self.pieces] + [(o.key, None) for o in objects]
        for key, offsets in dict.fromkeys(ordered):
            file, start, length = records[(key, offsets)]
            position = None if offsets is None else [p.offsets for p in chunks_of[key]].index(offsets)
            index = new_object(_METADATA_MODULE, "MetadataIndex", {
                "fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": position})
            storage[index] = new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo",
                                        {"relative_path": file, "offset": start, "length": length})
        for tensor in self.tensors:
            properties = new_object(_METADATA_MODULE, "TensorProperties", (
                Global("torch", tensor.dtype),
                Reduced(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
                False,
                Reduced(Global(_METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,)),
                False,
            ))
            chunks = [new_object(_METADATA_MODULE, "ChunkStorageMetadata",
                                 {"offsets": torch_size(p.offsets), "sizes": torch_size(p.sizes)})
                      for p in chunks_of[tensor.key]]
            entries[tensor.key] = new_object(_METADATA_MODULE, "TensorStorageMetadata",
                                             {"properties": properties, "size": torch_size(tensor.shape), "chunks": chunks})
        for obj in objects:
            entries[obj.key] = new_object(_METADATA_MODULE, "BytesStorageMetadata", {})
        planner_data = {t.key: t.path for t in self.tensors} | {o.key: o.path for o in objects}
        return new_object(_METADATA_MODULE, "Metadata", {
            "state_dict_metadata": entries, "planner_data": planner_data, "storage_data": storage,
            "storage_meta": None, "version": "1.0.0"})


def _write_object(stream, obj) -> None:
    """A non-tensor entry is a torch.save archive of its value: copied as is when the source has one."""
    blob = obj.blob()
    if blob is not None:
        stream.write(blob)
        return
    archive = ArchiveWriter(stream)
    archive.add_pickle(obj.value())
    archive.close()
