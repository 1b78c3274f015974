"""``.metadata`` at scale: torch's chunk and storage records read as columns, not one object each.

A checkpoint saved by thousands of ranks has a million ``ChunkStorageMetadata`` records (a list per
tensor) and as many ``MetadataIndex -> _StorageInfo`` storage records (the items of
``storage_data``). ``unpickle`` declares both to the restricted unpickler as runs
(``safe_pickle.RecordRun``): a run of chunk records stands in its list as one ``ChunkRows`` and a
run of storage records in ``storage_data`` as one ``StorageRows`` key (its value None), numpy
columns of a few machine integers per record. Records of any other shape stay records; a list or a
dict may hold both. The reader takes the columns as they are (``reader``); ``each_record`` and
``each_item`` give the records one by one to code that wants objects.

>>> chunks = ChunkRows(np.array([[0, 0], [2, 0]]), np.array([[2, 4], [2, 4]]))
>>> [record.offsets for record in each_record([chunks])]
[(0, 0), (2, 0)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool import safe_pickle
from dcptool.converters.dcp.names import FILESYSTEM_MODULE, METADATA_MODULE
from dcptool.safe_pickle import DIMS, INT, TEXT, Columns, Record, RecordLayout, RecordRun

CHUNK_CLASS = f"{METADATA_MODULE}.ChunkStorageMetadata"
INDEX_CLASS = f"{METADATA_MODULE}.MetadataIndex"
INFO_CLASS = f"{FILESYSTEM_MODULE}._StorageInfo"


@dataclass(frozen=True, eq=False)
class ChunkRows:
    """ChunkStorageMetadata records of one number of dims, standing in a chunks list for all of them:
    ``offsets[i]``, ``sizes[i]``."""

    offsets: np.ndarray  # (records, dims) int64
    sizes: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def records(self) -> list[Record]:
        """The records as objects (for code that takes them one by one; large lists use the columns)."""
        return [safe_pickle.record(CHUNK_CLASS, {"offsets": tuple(offsets), "sizes": tuple(sizes)})
                for offsets, sizes in zip(self.offsets.tolist(), self.sizes.tolist())]


@dataclass(frozen=True, eq=False)
class StorageRows:
    """Storage records, a key of storage_data standing for all of them (its value is None): record ``i`` is
    ``MetadataIndex(fqn[i], key[i], index[i]) -> _StorageInfo(path[i], offset[i], length[i])``."""

    fqn: list[str]
    index: np.ndarray
    key: np.ndarray  # (records, 3): the chunk offsets of each key, ``key_ndim[i]`` of them
    key_ndim: np.ndarray
    path: list[str]
    offset: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return len(self.fqn)

    def items(self) -> list[tuple[Record, Record]]:
        """``(MetadataIndex, _StorageInfo)`` records as objects."""
        return [(safe_pickle.record(INDEX_CLASS, {"fqn": fqn, "index": index, "offset": tuple(key[:ndim])}),
                 safe_pickle.record(INFO_CLASS, {"relative_path": path, "offset": offset, "length": length}))
                for fqn, index, key, ndim, path, offset, length in zip(
                    self.fqn, self.index.tolist(), self.key.tolist(), self.key_ndim.tolist(), self.path,
                    self.offset.tolist(), self.length.tolist())]


def each_record(items: list):
    """The items of a list, with the records that rows stand for (``ChunkRows``) made into objects one by one."""
    for item in items:
        if type(item) is ChunkRows:
            yield from item.records()
        else:
            yield item


def each_item(mapping: dict):
    """The items of a dict, with the storage records that rows stand for (``StorageRows``) made into objects."""
    for key, value in mapping.items():
        if type(key) is StorageRows:
            yield from key.items()
        else:
            yield key, value


def _chunk_rows(columns: Columns) -> tuple[tuple, int]:
    """A run of chunk records as one ``ChunkRows``, up to the first of other dims than the first's (a chunks
    list is one tensor's)."""
    (offsets, ndim), (sizes, sizes_ndim) = columns.fields[0]["offsets"], columns.fields[0]["sizes"]
    count = columns.count
    wrong = np.flatnonzero((ndim[:count] != ndim[0]) | (sizes_ndim[:count] != ndim[0]))
    count = int(wrong[0]) if len(wrong) else count
    return (ChunkRows(offsets[:count, :ndim[0]], sizes[:count, :ndim[0]]),), count


def _storage_rows(columns: Columns) -> tuple[tuple, int]:
    """A run of storage records as one ``StorageRows`` key, its value None."""
    index, info = columns.fields
    count = columns.count
    rows = StorageRows(_first(index["fqn"], count), index["index"][:count], *(dims[:count] for dims in index["offset"]),
                       _first(info["relative_path"], count), info["offset"][:count], info["length"][:count])
    return (rows, None), count


def _first(texts: list[str], count: int) -> list[str]:
    """The first ``count`` texts of a column: the column itself when that is all of it (the unpickler keeps the
    columns while it runs, and a copy of a million names is 8 MB)."""
    return texts if len(texts) == count else texts[:count]


# The records as CPython's pickler writes them (their attributes in the order torch sets them).
RUNS = (
    RecordRun((RecordLayout(CHUNK_CLASS, (("offsets", DIMS), ("sizes", DIMS))),), _chunk_rows),
    RecordRun((RecordLayout(INDEX_CLASS, (("fqn", TEXT), ("index", INT), ("offset", DIMS))),
               RecordLayout(INFO_CLASS, (("relative_path", TEXT), ("offset", INT), ("length", INT)))), _storage_rows),
)


def unpickle(data: bytes, where: str):
    """The ``Metadata`` record a ``.metadata`` file holds (``where`` names it in messages), its runs of chunk and
    storage records as ``ChunkRows`` and ``StorageRows``."""
    return safe_pickle.load_bytes(data, where, RUNS)
