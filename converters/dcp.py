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

import numpy as np

from dcptool import compression, dtypes, safe_pickle
from dcptool.compression import DecompressingFiles
from dcptool.core import Checkpoint, Chunk, ChunkTable, ObjectInfo, Piece, TensorInfo, join_path
from dcptool.errors import (SIZE_LIMIT, CheckpointError, UsageError, file_name_problem, printable, shape_problem,
                            utf8_problem, with_article)
from dcptool.format_interface import Format, Layout
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.torch_archive import (ArchiveLayout, Global, PickleStream, Reduced, StorageOut, Streamed, TensorOut,
                                   archive_bytes, dumps, new_object, torch_size)

NAME = "dcp"
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
            file, offset, length, encoding = _storage_info(files, storage, key, None, where)
            if encoding == "zstd-archive":  # objects are small: decompressed now, then read as plain records
                files = files if isinstance(files, DecompressingFiles) else DecompressingFiles(files)
                (file, length), offset = files.decompressed(file, offset, length), 0
            objects[key] = ObjectInfo(nested, blob=(file, offset, length))
        elif _is(entry, "TensorStorageMetadata"):
            dtype = _dtype_of(getattr(entry, "properties", None), key, where)
            itemsize = dtypes.dtype(dtype).itemsize
            shape = _dims(getattr(entry, "size", None), f"{where}: {printable(key)}: size", itemsize)
            chunk_list = getattr(entry, "chunks", None)
            if not isinstance(chunk_list, list):
                raise CheckpointError(f"{where}: {printable(key)}: chunks is {_kind(chunk_list)}, not a list")
            table = _chunk_table(files, storage, key, chunk_list, dtype, where)
            if table is not None:
                tensors[key] = TensorInfo(nested, dtype, shape, table)
                continue
            chunks = []
            for chunk in safe_pickle.each_record(chunk_list):
                if not _is(chunk, "ChunkStorageMetadata"):
                    raise CheckpointError(f"{where}: {printable(key)}: a chunk is {_kind(chunk)}, not ChunkStorageMetadata")
                at = f"{where}: {printable(key)}: chunk"
                offsets = _dims(getattr(chunk, "offsets", None), f"{at} offsets")
                sizes = _dims(getattr(chunk, "sizes", None), f"{at} sizes", itemsize)
                file, offset, length, encoding = _storage_info(files, storage, key, offsets, where)
                if encoding == "zstd-archive":  # decompressed on first read (dcptool.compression)
                    files = files if isinstance(files, DecompressingFiles) else DecompressingFiles(files)
                elif length < math.prod(sizes) * itemsize:  # the record is an archive of the chunk's bytes
                    raise CheckpointError(f"{at} at {list(offsets)}: a record of {length:,} bytes cannot hold "
                                          f"{dtype}{list(sizes)}")
                chunks.append(Chunk(offsets, sizes, file, offset, length, encoding, rank=saving_rank(file)))
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


class _Storage:
    """storage_data: ``get((fqn, offsets or None))`` gives a record's ``_StorageInfo``; the records the
    unpickler kept as rows (``StorageRows``) are also columns, grouped by tensor (``rows_of``)."""

    def __init__(self, records: dict, rows: list[safe_pickle.StorageRows]):
        self.records = records
        self.record_fqns = {fqn for fqn, _ in records}
        fqn = [name for part in rows for name in part.fqn]
        codes: dict[str, int] = {}
        numbers = np.fromiter((codes.setdefault(name, len(codes)) for name in fqn), np.int64, len(fqn))
        paths: dict[str, int] = {}
        self.path = np.fromiter((paths.setdefault(p, len(paths)) for part in rows for p in part.path), np.int64, len(fqn))
        self.path_names, self._paths = list(paths), paths
        self._sizes: dict[str, int] = {}  # data files checked, with their sizes
        self.ranks = {name: saving_rank(name) for name in paths}
        join = (lambda name: np.concatenate([getattr(part, name) for part in rows])) if rows else \
            (lambda name: np.zeros((0, 3) if name == "key" else 0, np.int64))
        self.key, self.key_ndim, self.offset, self.length = join("key"), join("key_ndim"), join("offset"), join("length")
        order = np.argsort(numbers, kind="stable")
        bounds = np.searchsorted(numbers[order], np.arange(len(codes) + 1))
        self._rows = {name: order[bounds[code]:bounds[code + 1]] for name, code in codes.items()}

    def file_size(self, files, name: str, at: str) -> int:
        """The size of a data file the records name, checked once: a plain name in the folder, present."""
        size = self._sizes.get(name)
        if size is None:
            problem = file_name_problem(name)
            if problem:
                raise CheckpointError(f"{at}: relative_path {problem}")
            if not files.is_file(name):
                raise CheckpointError(f"{at}: its data file {files.path(name)} is missing")
            size = self._sizes[name] = files.size(name)
            self.ranks.setdefault(name, saving_rank(name))
        return size

    def path_code(self, name: str) -> int:
        """The number of a data file name among ``path_names`` (added when new)."""
        if name not in self._paths:
            self._paths[name] = len(self.path_names)
            self.path_names.append(name)
        return self._paths[name]

    def rows_of(self, fqn: str) -> np.ndarray:
        return self._rows.get(fqn, _NO_ROWS)

    def get(self, place):
        info = self.records.get(place)
        if info is not None or place[1] is None:
            return info
        fqn, offsets = place
        for row in self.rows_of(fqn).tolist():
            if self.key_ndim[row] == len(offsets) and tuple(self.key[row, :len(offsets)].tolist()) == offsets:
                return safe_pickle._record(safe_pickle.ALLOWED["torch.distributed.checkpoint.filesystem._StorageInfo"], {
                    "relative_path": self.path_names[self.path[row]], "offset": int(self.offset[row]),
                    "length": int(self.length[row])})
        return None


_NO_ROWS = np.zeros(0, np.int64)


def _chunk_table(files, storage: _Storage, key: str, chunk_list: list, dtype: str, where: str) -> ChunkTable | None:
    """The chunks of a tensor as columns when the unpickler kept its records as rows; None leaves the
    tensor to the record-by-record reading (records of other shapes, transforms)."""
    rows = [item for item in chunk_list if type(item) is safe_pickle.ChunkRows]
    if not rows or any(type(item) is not safe_pickle.ChunkRows and not _is(item, "ChunkStorageMetadata")
                       for item in chunk_list):
        return None
    itemsize = dtypes.dtype(dtype).itemsize
    at = f"{where}: {printable(key)}: chunk"
    parts = []
    for item in chunk_list:
        if type(item) is safe_pickle.ChunkRows:
            parts.append((item.offsets, item.sizes))
        else:
            offsets = _dims(getattr(item, "offsets", None), f"{at} offsets")
            sizes = _dims(getattr(item, "sizes", None), f"{at} sizes", itemsize)
            parts.append((np.array([offsets], np.int64).reshape(1, -1), np.array([sizes], np.int64).reshape(1, -1)))
    if len({part[0].shape[1] for part in parts}) != 1:
        return None
    offsets, sizes = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    ndim = offsets.shape[1]
    wrong = np.flatnonzero(np.any((offsets < 0) | (offsets >= SIZE_LIMIT) | (sizes < 0) | (sizes >= SIZE_LIMIT), axis=1))
    if len(wrong):
        raise CheckpointError(f"{at} at {offsets[wrong[0]].tolist()} of size {sizes[wrong[0]].tolist()}: "
                              "offsets and sizes must be integers in [0, 2**63)")
    # Each chunk's storage record: found among the rows of its tensor, matching the chunk offsets.
    candidates = storage.rows_of(key)
    candidates = candidates[storage.key_ndim[candidates] == ndim]
    if not len(candidates):
        return None
    void = np.dtype((np.void, 8 * ndim))
    keys = np.ascontiguousarray(storage.key[candidates, :ndim]).view(void).ravel()
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    if len(keys) > 1 and np.any(keys[1:] == keys[:-1]):
        raise CheckpointError(f"{where}: {printable(key)} has two storage records for one chunk")
    wanted = np.ascontiguousarray(offsets).view(void).ravel()
    found = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
    hit = keys[found] == wanted
    rows = candidates[order[found]]
    path, offset, length = storage.path[rows], storage.offset[rows], storage.length[rows]
    if key in storage.record_fqns:  # some records of this tensor were read one by one: fill those in
        for number, chunk_offsets in enumerate(offsets.tolist()):
            info = storage.records.get((key, tuple(chunk_offsets)))
            if info is None:
                continue
            if hit[number]:
                raise CheckpointError(f"{where}: {printable(key)} has two storage records for one chunk")
            if not _is(info, "_StorageInfo") or getattr(info, "transform_descriptors", None) or \
                    not isinstance(getattr(info, "relative_path", None), str):
                return None  # the record-by-record reading says what is wrong, or reads the transforms
            values = (getattr(info, n, None) for n in ("offset", "length"))
            offset[number], length[number] = (v if type(v) is int and 0 <= v < SIZE_LIMIT else -1 for v in values)
            path[number] = storage.path_code(info.relative_path)
            hit[number] = True
    if not np.all(hit):
        return None  # the record-by-record reading says which record is missing
    bad = np.flatnonzero((offset < 0) | (length < 0) | (offset >= SIZE_LIMIT) | (length >= SIZE_LIMIT))
    if len(bad):
        raise CheckpointError(f"{at} at {offsets[bad[0]].tolist()}: storage record offset and length are not byte counts")
    used = np.flatnonzero(np.bincount(path))  # the files' codes, sorted (np.unique would import numpy.ma: 12 ms)
    names = [storage.path_names[p] for p in used.tolist()]
    sizes_on_disk = [storage.file_size(files, name, at) for name in names]
    file_index = np.searchsorted(used, path)
    past = np.flatnonzero(offset + length > np.array(sizes_on_disk, np.int64)[file_index])
    if len(past):
        first = int(past[0])
        name = names[file_index[first]]
        raise CheckpointError(f"{files.path(name)}: truncated: {printable(key)} needs bytes {int(offset[first]):,}.."
                              f"{int(offset[first] + length[first]):,}, the file has {files.size(name):,}")
    small = np.flatnonzero(length < np.prod(sizes, axis=1) * itemsize)  # each record is an archive of its chunk's bytes
    if len(small):
        first = int(small[0])
        raise CheckpointError(f"{at} at {offsets[first].tolist()}: a record of {int(length[first]):,} bytes cannot hold "
                              f"{dtype}{sizes[first].tolist()}")
    return ChunkTable(offsets, sizes, names, file_index, offset, length, "torch-archive",
                      [storage.ranks[n] for n in names])


def _storage_index(metadata, where: str) -> _Storage:
    """storage_data, its keys checked as data: records one by one, rows as columns."""
    records = getattr(metadata, "storage_data", None) or {}
    if not isinstance(records, dict):
        raise CheckpointError(f"{where}: storage_data is {_kind(records)}, not a dict")
    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    rows = []
    for index, info in records.items():
        if type(index) is safe_pickle.StorageRows:
            rows.append(index)
            continue
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if not _is(index, "MetadataIndex") or not isinstance(fqn, str):
            raise CheckpointError(f"{where}: a key of storage_data is {_kind(index)}, not a MetadataIndex")
        place = (fqn, None if offset is None else _dims(offset, f"{where}: {printable(fqn)}: storage record offset"))
        if place in storage:
            raise CheckpointError(f"{where}: {printable(fqn)} has two storage records for one chunk")
        storage[place] = info
    return _Storage(storage, rows)


def _storage_info(files, storage, key, offsets, where) -> tuple[str, int, int, str]:
    """``(file, offset, length, chunk encoding)`` of a record, checked against the folder and the file's size."""
    info = storage.get((key, offsets))
    at = f"{where}: {printable(key)}" + (f" chunk at {list(offsets)}" if offsets is not None else "")
    if info is None:
        raise CheckpointError(f"{at} has no storage record (metadata is incomplete)")
    if not _is(info, "_StorageInfo"):
        raise CheckpointError(f"{at}: storage record is {_kind(info)}, not a _StorageInfo")
    encoding = compression.encoding_of(getattr(info, "transform_descriptors", None), at)
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
    return file, offset, length, encoding


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

    def __init__(self, folder: Path, layout=None, world_size: int = 1, compress: str | None = None):
        if compress not in (None, "zstd"):
            raise UsageError(f"--compress {compress}: choose zstd")
        self.folder, self.compress = folder, compress
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
        if self.compress:  # each record becomes one zstd stream, as torch's ZStandard extension writes it
            for name in files:
                mine = sorted((where[1], where[2], place) for place, where in records.items() if where[0] == name)
                placed = compression.compress_records(self.folder, name, [(start, length) for start, length, _ in mine])
                for (_, _, place), (start, length) in zip(mine, placed):
                    records[place] = (name, start, length)
        return records

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """Write ``.metadata`` from the records of every writer, streamed: a thousand ranks make a million
        chunks, too many to build as objects first."""
        merged = {where: place for part in records for where, place in part.items()}
        with open(self.folder / METADATA, "wb") as file:
            stream = PickleStream(file)
            stream.start()
            stream.save(self._metadata(objects, merged))
            stream.stop()
        return []

    def _metadata(self, objects, records) -> Reduced:
        """torch's ``Metadata``; its tensor entries and storage records are made one at a time as they are written."""
        chunks_of: dict[str, list] = {}
        for piece in self._rank_of:
            chunks_of.setdefault(piece.tensor.key, []).append(piece)
        # a chunk's place in its tensor's list (the index hint), found in O(1): a tensor may have thousands
        position_of: dict = {}
        for key, pieces in chunks_of.items():
            for i, piece in enumerate(pieces):
                position_of.setdefault((key, piece.offsets), i)
        # In the order one process writes them (file by file, then the objects), whoever wrote them.
        ordered = [(p.tensor.key, p.offsets) for p in self.pieces] + [(o.key, None) for o in objects]

        def storage():
            for key, offsets in dict.fromkeys(ordered):
                file, start, length = records[(key, offsets)]
                position = None if offsets is None else position_of[(key, offsets)]
                index = new_object(_METADATA_MODULE, "MetadataIndex", {
                    "fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": position})
                info = {"relative_path": file, "offset": start, "length": length}
                if self.compress:
                    info["transform_descriptors"] = [compression.ZSTD]
                yield index, new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo", info)

        def entries():
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
                yield tensor.key, new_object(_METADATA_MODULE, "TensorStorageMetadata",
                                             {"properties": properties, "size": torch_size(tensor.shape), "chunks": chunks})
            for obj in objects:
                yield obj.key, new_object(_METADATA_MODULE, "BytesStorageMetadata", {})

        planner_data = {t.key: t.path for t in self.tensors} | {o.key: o.path for o in objects}
        return new_object(_METADATA_MODULE, "Metadata", {
            "state_dict_metadata": Streamed(entries()), "planner_data": planner_data, "storage_data": Streamed(storage()),
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


class Dcp(Format):
    """A PyTorch Distributed Checkpoint folder (``.metadata`` and ``__R_0.distcp`` files), as ``dcp.save`` writes it."""

    name = NAME
    completes = (METADATA,)  # without it the folder is no checkpoint
    writable = True
    layout = Layout.MESH
    compressions = ("zstd",)
    dcp_loadable = True
    options = {"compress": "--compress"}

    def detect(self, files: CheckpointFiles) -> bool:
        return detect(files)

    def read(self, files: CheckpointFiles) -> Checkpoint:
        return read(files)

    def writer(self, destination: Path, **writer_options) -> Writer:
        return Writer(destination, **writer_options)


FORMAT = Dcp()
