"""PyTorch Distributed Checkpoint (DCP): a folder with ``.metadata`` and ``__{rank}_{n}.distcp`` files.

Read offline with no process group; ``.metadata`` goes through dcptool's restricted unpickler, so
inspecting a hostile checkpoint runs no code. Each tensor chunk is a ``torch.save`` archive at a
known offset of a ``.distcp`` file.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

from dcptool import dtypes, safe_pickle
from dcptool.core import Checkpoint, Chunk, ObjectInfo, Piece, TensorInfo, join_path
from dcptool.errors import (SIZE_LIMIT, CheckpointError, file_name_problem, printable, shape_problem, utf8_problem,
                            with_article)
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.torch_archive import (ArchiveLayout, Global, Reduced, StorageOut, TensorOut, archive_bytes, dumps,
                                   new_object, torch_size)

NAME = "dcp"
WRITES_FOLDER = True
METADATA = ".metadata"
COMPLETES = [METADATA]  # uploaded last to remote storage: without it the folder is no checkpoint
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
    if not _is(metadata, "Metadata") or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{where}: not DCP metadata (holds {_kind(metadata)})")
    storage = _storage_index(metadata, where)
    planner_data = getattr(metadata, "planner_data", None) or {}
    if not isinstance(planner_data, dict):
        raise CheckpointError(f"{where}: planner_data is {_kind(planner_data)}, not a dict")
    version = getattr(metadata, "version", None)
    if version is not None and not (isinstance(version, str) and version.isprintable() and len(version) <= 64):
        shown = printable(repr(version), 40) if isinstance(version, str) else _kind(version)
        raise CheckpointError(f"{where}: version {shown} is not a version string")

    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for key, entry in metadata.state_dict_metadata.items():
        problem = utf8_problem(key)
        if problem:
            raise CheckpointError(f"{where}: a key of state_dict_metadata {problem}")
        nested = _nested_path(planner_data.get(key, (key,)), key, where)
        if _is(entry, "BytesStorageMetadata"):
            file, offset, length = _storage_info(files, storage, key, None, where)
            objects[key] = ObjectInfo(nested, blob=(file, offset, length))
        elif _is(entry, "TensorStorageMetadata"):
            dtype = _dtype_of(getattr(entry, "properties", None), key, where)
            itemsize = dtypes.dtype(dtype).itemsize
            shape = _dims(getattr(entry, "size", None), f"{where}: {printable(key)}: size", itemsize)
            chunk_list = getattr(entry, "chunks", None)
            if not isinstance(chunk_list, list):
                raise CheckpointError(f"{where}: {printable(key)}: chunks is {_kind(chunk_list)}, not a list")
            chunks = []
            for chunk in chunk_list:
                if not _is(chunk, "ChunkStorageMetadata"):
                    raise CheckpointError(f"{where}: {printable(key)}: a chunk is {_kind(chunk)}, not ChunkStorageMetadata")
                at = f"{where}: {printable(key)}: chunk"
                offsets = _dims(getattr(chunk, "offsets", None), f"{at} offsets")
                sizes = _dims(getattr(chunk, "sizes", None), f"{at} sizes", itemsize)
                file, offset, length = _storage_info(files, storage, key, offsets, where)
                if length < math.prod(sizes) * itemsize:  # the record is an archive of the chunk's bytes
                    raise CheckpointError(f"{at} at {list(offsets)}: a record of {length:,} bytes cannot hold "
                                          f"{dtype}{list(sizes)}")
                chunks.append(Chunk(offsets, sizes, file, offset, length, "torch-archive", rank=saving_rank(file)))
            tensors[key] = TensorInfo(nested, dtype, shape, chunks)
        else:
            raise CheckpointError(f"{where}: {printable(key)}: unknown entry type {_kind(entry)}")

    ranks = {int(m.group(1)) for name in files.names("*.distcp") if (m := _DATA_FILE.match(name))}
    info = {"version": version, "world_size": len(ranks) or None}  # one data file per saving rank
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects, info)
    checkpoint.validate()
    return checkpoint


def _is(obj, name: str) -> bool:
    """Whether ``obj`` is the stand-in of DCP's metadata class ``name`` (``_StorageInfo`` lives in filesystem)."""
    module = "torch.distributed.checkpoint.filesystem" if name == "_StorageInfo" else _METADATA_MODULE
    return isinstance(obj, safe_pickle.Record) and type(obj).qualname == f"{module}.{name}"


def _kind(obj) -> str:
    """What a pickled ``obj`` is, with its article: "a TensorStorageMetadata", "a list", "None"."""
    if obj is None:
        return "None"
    name = type(obj).qualname.rsplit(".", 1)[-1] if isinstance(obj, safe_pickle.Record) else type(obj).__name__
    return with_article(name)


def _dims(value, what: str, itemsize: int = 1) -> tuple[int, ...]:
    """A size or offsets of the metadata (a ``torch.Size``): a tuple of integers torch can hold."""
    if not isinstance(value, (tuple, list)):
        raise CheckpointError(f"{what} is {_kind(value)}, not a list of integers")
    problem = shape_problem(value, itemsize)
    if problem:
        raise CheckpointError(f"{what} {problem}")
    return tuple(value)


def _nested_path(path, key: str, where: str) -> tuple:
    """The nested path planner_data records for ``key``: strings and list indices that join to the key."""
    if not (isinstance(path, (tuple, list)) and path and len(path) <= 256
            and all(type(p) is str or type(p) is int for p in path)):
        raise CheckpointError(f"{where}: planner_data[{printable(key)!r}] is not a path of names and indices")
    path = tuple(path)
    if join_path(path) != key:
        raise CheckpointError(f"{where}: planner_data[{printable(key)!r}] is {printable(join_path(path))!r}, "
                              "which is not the key it is stored under")
    return path


def _storage_index(metadata, where: str) -> dict:
    """storage_data as ``(fqn, offsets or None) -> _StorageInfo``, its keys checked as data."""
    records = getattr(metadata, "storage_data", None) or {}
    if not isinstance(records, dict):
        raise CheckpointError(f"{where}: storage_data is {_kind(records)}, not a dict")
    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    for index, info in records.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not _is(index, "MetadataIndex") or not isinstance(fqn, str):
            raise CheckpointError(f"{where}: a key of storage_data is {_kind(index)}, not a MetadataIndex")
        place = (fqn, None if offset is None else _dims(offset, f"{where}: {printable(fqn)}: storage record offset"))
        if place in storage:
            raise CheckpointError(f"{where}: {printable(fqn)} has two storage records for one chunk")
        storage[place] = info
    return storage


def _storage_info(files, storage, key, offsets, where) -> tuple[str, int, int]:
    """``(file, offset, length)`` of a record, checked against the folder and the file's size."""
    info = storage.get((key, offsets))
    at = f"{where}: {printable(key)}" + (f" chunk at {list(offsets)}" if offsets is not None else "")
    if info is None:
        raise CheckpointError(f"{at} has no storage record (metadata is incomplete)")
    if not _is(info, "_StorageInfo"):
        raise CheckpointError(f"{at}: storage record is {_kind(info)}, not a _StorageInfo")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        shown = ", ".join(printable(t, 40) for t in transforms[:4]) if isinstance(transforms, (list, tuple)) \
            else _kind(transforms)
        raise CheckpointError(f"{at} is stored with transforms [{shown}], not supported yet")
    file, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
    problem = file_name_problem(file)
    if problem:
        raise CheckpointError(f"{at}: relative_path {problem}")
    if not (type(offset) is int and type(length) is int and 0 <= offset < SIZE_LIMIT and 0 <= length < SIZE_LIMIT):
        raise CheckpointError(f"{at}: storage record offset and length are not byte counts")
    if not files.is_file(file):
        raise CheckpointError(f"{at}: its data file {files.path(file)} is missing")
    size = files.size(file)
    if offset + length > size:
        raise CheckpointError(f"{files.path(file)}: truncated: {printable(key)} needs bytes {offset:,}..{offset + length:,}, "
                              f"the file has {size:,}")
    return file, offset, length


def _dtype_of(properties, key: str, where: str) -> str:
    state = getattr(properties, "state", None)
    value = state[0] if isinstance(state, tuple) and state else getattr(properties, "dtype", None)
    if not _is(properties, "TensorProperties") or not isinstance(value, str):
        raise CheckpointError(f"{where}: {printable(key)}: no dtype in tensor properties")
    try:
        return dtypes.dtype(value).name
    except CheckpointError:
        raise CheckpointError(f"{where}: {printable(key)}: dtype {printable(value, 40)} is not one dcptool reads") from None


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

    NEEDS_CRC = True

    def __init__(self, folder: Path, layout=None, world_size: int = 1):
        self.folder = folder
        self.out = OutputFiles(folder)
        self.world_size = world_size
        self.layout = layout or (lambda t: [(tuple(0 for _ in t.shape), tuple(t.shape), 0)])
        self._rank_of: dict = {}
        # (key, offsets) -> (file, offset, length) of every chunk's record, fixed by the plan.
        self._records: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        self._data_start: dict[Piece, int] = {}

    def plan(self, tensors, objects):
        pieces = []
        for tensor in tensors:
            for offsets, sizes, rank in self.layout(tensor):
                piece = Piece(tensor, tuple(offsets), tuple(sizes))
                self._rank_of[piece] = rank
                pieces.append(piece)
        pieces.sort(key=lambda p: self._rank_of[p])  # one file at a time
        self._ends: dict[int, int] = {}
        for piece in pieces:
            rank = self._rank_of[piece]
            start = self._ends.get(rank, 0)
            _, data_start, length = _chunk_archive(piece)
            self._records[(piece.tensor.key, piece.offsets)] = (data_file(rank), start, length)
            self._data_start[piece] = start + data_start
            self._ends[rank] = start + length
        self.tensors, self.pieces = tensors, pieces
        return pieces

    def place(self, piece) -> tuple[str, int]:
        return data_file(self._rank_of[piece]), self._data_start[piece]

    def files(self) -> dict[str, int]:
        """Every data file with the tensor bytes planned for it."""
        sizes = {data_file(rank): 0 for rank in range(self.world_size)}
        for piece in self.pieces:
            name = data_file(self._rank_of[piece])
            sizes[name] = sizes.get(name, 0) + piece.nbytes
        return sizes

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Complete ``files`` (the objects go at the end of rank 0's); returns where each record of them is."""
        records = {}
        for piece in self.pieces:
            where = self._records[(piece.tensor.key, piece.offsets)]
            file, start, _ = where
            if file in files:
                archive, _, _ = _chunk_archive(piece)  # made again: holding every chunk's layout costs memory
                for offset, data in archive.segments({"0": crcs[piece]}):
                    self.out.write_at(file, start + offset, data)
                records[(piece.tensor.key, piece.offsets)] = where
        if data_file(0) in files:
            end = self._ends.get(0, 0)
            for obj in objects:
                blob = obj.blob()  # copied as is when the source stores it as an archive
                if blob is None:
                    blob = archive_bytes(obj.value())
                self.out.write_at(data_file(0), end, blob)
                records[(obj.key, None)] = (data_file(0), end, len(blob))
                end += len(blob)
        for name in files:
            self.out.fd(name)  # every rank's file exists, even an empty one
        return records

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


def _chunk_archive(piece: Piece) -> tuple[ArchiveLayout, int, int]:
    """The archive of one chunk record, where its bytes start in it, and its length."""
    archive = ArchiveLayout(_chunk_pickle(piece.tensor.dtype, piece.sizes))
    data_start = archive.add_storage("0", piece.nbytes)
    return archive, data_start, archive.close()


@functools.cache
def _chunk_pickle(dtype: str, sizes: tuple[int, ...]) -> bytes:
    """A chunk's ``data.pkl``, the same for every chunk of its dtype and shape (pickling is slow in Python)."""
    return dumps(TensorOut(StorageOut("0", dtype, math.prod(sizes)), sizes))
