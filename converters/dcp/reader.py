"""Reading a DCP folder offline: ``.metadata`` checked as data, each tensor's chunks as a table where it can be.

``.metadata`` goes through dcptool's restricted unpickler (``metadata.unpickle``), so inspecting a
hostile checkpoint runs no code. Each tensor chunk is a ``torch.save`` archive at a known offset of a
``.distcp`` file (zstd-compressed when its storage record says so). A tensor whose chunk records the
unpickler kept as columns becomes a ``chunks.ChunkTable``, checked in numpy against the storage records
and the files' sizes; any other is read record by record into a list of ``chunks.Chunk``.
"""

from __future__ import annotations

import math

import numpy as np

from dcptool import dtypes, safe_pickle
from dcptool.engine import compression
from dcptool.engine.compression import ZSTD_ARCHIVE, DecompressingFiles
from dcptool.converters.dcp.metadata import INFO_CLASS, ChunkRows, StorageRows, each_record, unpickle
from dcptool.converters.dcp.names import DATA_FILE, FILESYSTEM_MODULE, METADATA, METADATA_MODULE, NAME, saving_rank
from dcptool.engine.chunks import Chunk, ChunkTable
from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo, entry_problem, join_path
from dcptool.errors import (SIZE_LIMIT, CheckpointError, file_name_problem, printable, shape_problem, utf8_problem,
                            with_article)
from dcptool.safe_pickle import Record
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import TORCH_ARCHIVE


def detect(files: CheckpointFiles) -> bool:
    """Whether ``files`` is a folder with a ``.metadata`` file or ``.distcp`` data files."""
    return files.is_dir() and (files.is_file(METADATA) or bool(files.names("*.distcp")))


def read(files: CheckpointFiles) -> Checkpoint:
    """The checkpoint a DCP folder holds; metadata that contradicts itself or the files raises ``CheckpointError``."""
    if not files.is_dir():
        raise CheckpointError(f"{files.location}: not a folder (a DCP checkpoint is a folder with a .metadata file)")
    where = str(files.path(METADATA))
    if not files.is_file(METADATA):
        raise CheckpointError(f"{where}: missing (a DCP checkpoint folder needs its .metadata file)")
    metadata = unpickle(files.read_all(METADATA), where)
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
        try:
            problem = utf8_problem(key)
            if problem:
                raise CheckpointError(f"{where}: a key of state_dict_metadata {problem}")
            nested = _nested_path(planner_data.get(key, (key,)), key, where)
            if _is(entry, "BytesStorageMetadata"):
                file, offset, length, encoding = _storage_info(files, storage, key, None, where)
                if encoding == ZSTD_ARCHIVE:  # objects are small: decompressed now, then read as plain records
                    files = files if isinstance(files, DecompressingFiles) else DecompressingFiles(files)
                    (file, length), offset = files.decompressed(file, offset, length, label=key), 0
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
                for chunk in each_record(chunk_list):
                    if not _is(chunk, "ChunkStorageMetadata"):
                        raise CheckpointError(f"{where}: {printable(key)}: a chunk is {_kind(chunk)}, not ChunkStorageMetadata")
                    at = f"{where}: {printable(key)}: chunk"
                    offsets = _dims(getattr(chunk, "offsets", None), f"{at} offsets")
                    sizes = _dims(getattr(chunk, "sizes", None), f"{at} sizes", itemsize)
                    file, offset, length, encoding = _storage_info(files, storage, key, offsets, where)
                    if encoding == ZSTD_ARCHIVE:  # decompressed on first read (dcptool.engine.compression)
                        files = files if isinstance(files, DecompressingFiles) else DecompressingFiles(files)
                    elif length < math.prod(sizes) * itemsize:  # the record is an archive of the chunk's bytes
                        raise CheckpointError(f"{at} at {list(offsets)}: a record of {length:,} bytes cannot hold "
                                              f"{dtype}{list(sizes)}")
                    chunks.append(Chunk(offsets, sizes, file, offset, length, encoding, rank=saving_rank(file)))
                tensors[key] = TensorInfo(nested, dtype, shape, chunks)
            else:
                raise CheckpointError(f"{where}: {printable(key)}: unknown entry type {_kind(entry)}")
        except CheckpointError as exc:  # this entry's alone: check goes on to name the others
            entry_problem("metadata", key, exc)

    ranks = {int(m.group(1)) for name in files.names("*.distcp") if (m := DATA_FILE.match(name))}
    info = {"version": version, "world_size": len(ranks) or None}  # one data file per saving rank
    checkpoint = Checkpoint(NAME, files.location, files, tensors, objects, info)
    checkpoint.validate()
    return checkpoint


def _is(obj, name: str) -> bool:
    """Whether ``obj`` is the stand-in of DCP's metadata class ``name`` (``_StorageInfo`` lives in filesystem)."""
    module = FILESYSTEM_MODULE if name == "_StorageInfo" else METADATA_MODULE
    return isinstance(obj, Record) and type(obj).qualname == f"{module}.{name}"


def _kind(obj) -> str:
    """What a pickled ``obj`` is, with its article: "a TensorStorageMetadata", "a list", "None"."""
    if obj is None:
        return "None"
    name = type(obj).qualname.rsplit(".", 1)[-1] if isinstance(obj, Record) else type(obj).__name__
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

    def __init__(self, records: dict, rows: list[StorageRows]):
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
                return safe_pickle.record(INFO_CLASS, {
                    "relative_path": self.path_names[self.path[row]], "offset": int(self.offset[row]),
                    "length": int(self.length[row])})
        return None


_NO_ROWS = np.zeros(0, np.int64)


def _chunk_table(files, storage: _Storage, key: str, chunk_list: list, dtype: str, where: str) -> ChunkTable | None:
    """The chunks of a tensor as columns when the unpickler kept its records as rows; None leaves the
    tensor to the record-by-record reading (records of other shapes, transforms)."""
    rows = [item for item in chunk_list if type(item) is ChunkRows]
    if not rows or any(type(item) is not ChunkRows and not _is(item, "ChunkStorageMetadata")
                       for item in chunk_list):
        return None
    itemsize = dtypes.dtype(dtype).itemsize
    at = f"{where}: {printable(key)}: chunk"
    parts = []
    for item in chunk_list:
        if type(item) is ChunkRows:
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
    return ChunkTable(offsets, sizes, names, file_index, offset, length, TORCH_ARCHIVE,
                      [storage.ranks[n] for n in names])


def _storage_index(metadata, where: str) -> _Storage:
    """storage_data, its keys checked as data: records one by one, rows as columns."""
    records = getattr(metadata, "storage_data", None) or {}
    if not isinstance(records, dict):
        raise CheckpointError(f"{where}: storage_data is {_kind(records)}, not a dict")
    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    rows = []
    for index, info in records.items():
        if type(index) is StorageRows:
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
