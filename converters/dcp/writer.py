"""Writing a DCP folder that torch's ``dcp.load`` reads: a data file per rank, then ``.metadata``, streamed."""

from __future__ import annotations

import functools
import math
from pathlib import Path

from dcptool.engine import compression
from dcptool.converters.dcp.names import FILESYSTEM_MODULE, METADATA, METADATA_MODULE, data_file
from dcptool.engine.core import Piece
from dcptool.errors import UsageError, option
from dcptool.storage import OutputFiles
from dcptool.torch_archive import (ArchiveLayout, Global, PickleStream, Reduced, StorageOut, Streamed, TensorOut,
                                   archive_bytes, dumps, new_object, torch_size)


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
            raise UsageError(f"{option('compress', compress)}: choose zstd")
        self.folder, self.compress = folder, compress
        self.out = OutputFiles(folder)
        self.world_size = world_size
        self.layout = layout or (lambda t: [(tuple(0 for _ in t.shape), tuple(t.shape), 0)])
        self._rank_of: dict = {}
        # (key, offsets) -> (file, offset, length) of every chunk's record, fixed by the plan.
        self._records: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
        self._data_start: dict[Piece, int] = {}

    def plan(self, tensors, objects):
        """Each tensor's chunks as ``layout`` places them, their records laid out rank file by rank file."""
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
        """The data file of a chunk and where its elements start in it (inside its record's archive)."""
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
                index = new_object(METADATA_MODULE, "MetadataIndex", {
                    "fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": position})
                info = {"relative_path": file, "offset": start, "length": length}
                if self.compress:
                    info["transform_descriptors"] = [compression.ZSTD]
                yield index, new_object(FILESYSTEM_MODULE, "_StorageInfo", info)

        def entries():
            for tensor in self.tensors:
                properties = new_object(METADATA_MODULE, "TensorProperties", (
                    Global("torch", tensor.dtype),
                    Reduced(Global("torch.serialization", "_get_layout"), ("torch.strided",)),
                    False,
                    Reduced(Global(METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,)),
                    False,
                ))
                chunks = [new_object(METADATA_MODULE, "ChunkStorageMetadata",
                                     {"offsets": torch_size(p.offsets), "sizes": torch_size(p.sizes)})
                          for p in chunks_of[tensor.key]]
                yield tensor.key, new_object(METADATA_MODULE, "TensorStorageMetadata",
                                             {"properties": properties, "size": torch_size(tensor.shape), "chunks": chunks})
            for obj in objects:
                yield obj.key, new_object(METADATA_MODULE, "BytesStorageMetadata", {})

        planner_data = {t.key: t.path for t in self.tensors} | {o.key: o.path for o in objects}
        return new_object(METADATA_MODULE, "Metadata", {
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
