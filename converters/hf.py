"""Hugging Face safetensors: one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {dtype, shape, data_offsets}, "__metadata__": {...}}``) and the raw tensor bytes.
Reading parses only the header; the writer writes each header first and then streams the data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import split_state_dict_into_shards_factory

from dcptool import dtypes
from dcptool.engine.chunks import Chunk
from dcptool.engine.core import Checkpoint, Piece, TensorInfo
from dcptool.errors import (SIZE_LIMIT, CheckpointError, UsageError, file_name_problem, json_kind, parse_json, printable,
                            shape_problem, utf8_problem)
from dcptool.format_interface import Format, FormatOptions
from dcptool.sizes import parse_size
from dcptool.storage import CheckpointFiles, OutputFiles

NAME = "hf"
INDEX = "model.safetensors.index.json"
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # a PEFT adapter folder
MAX_HEADER = 100 * 2**20  # safetensors itself refuses larger headers
MAX_SHARD_SIZE = "5GB"  # the largest safetensors file by default: the hub's
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"  # the __metadata__ entry of torch's HF-storage DCP files


def detect(files: CheckpointFiles) -> bool:
    if files.single_file:
        return files.single_file.endswith(".safetensors") and not dcp_sharded(files, files.single_file)
    if not files.is_dir():
        return False
    shards = files.names("*.safetensors")
    # Files of torch's HuggingFaceStorageWriter carry DCP sharding info: they are format hf-dcp.
    return (files.is_file(INDEX) or bool(shards)) and not (shards and dcp_sharded(files, shards[0]))


def dcp_sharded(files: CheckpointFiles, name: str) -> bool:
    """Whether a safetensors file's ``__metadata__`` holds DCP sharding info (a save by torch's
    ``HuggingFaceStorageWriter``); False for anything unreadable, which ``read`` then reports."""
    try:
        _, metadata = read_header(files, name)
    except CheckpointError:
        return False
    return DCP_SHARDING_INFO in metadata


def read(files: CheckpointFiles) -> Checkpoint:
    names = [files.single_file] if files.single_file else _listed_files(files)
    tensors: dict[str, TensorInfo] = {}
    for name in names:
        found, metadata = read_header(files, name)
        for key, tensor in found.items():
            if key in tensors:
                chunks = (" (chunks of torch's HuggingFaceStorageWriter: format hf-dcp, which reshard and convert read)"
                          if DCP_SHARDING_INFO in metadata else "")
                raise CheckpointError(f"{files.path(name)}: tensor {printable(key)} is also in "
                                      f"{tensors[key].chunks[0].file}{chunks}")
            tensors[key] = tensor
    checkpoint = Checkpoint(NAME, files.location, files, tensors, {}, {"files": len(names)})
    checkpoint.validate()
    return checkpoint


def _listed_files(files: CheckpointFiles) -> list[str]:
    """The shard files the index names (checked as data: an object whose weight_map maps names to file names)."""
    where = files.path(INDEX)
    if not files.is_file(INDEX):
        return files.names("*.safetensors")
    index = files.read_json_object(INDEX, MAX_HEADER, "a safetensors index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where}: weight_map is {'missing' if weight_map is None else json_kind(weight_map)}, "
                              "not an object of tensor names to file names")
    for key, name in weight_map.items():
        problem = utf8_problem(key) or file_name_problem(name)
        if problem:
            raise CheckpointError(f"{where}: weight_map[{printable(key)!r}] {problem}")
    names = sorted(set(weight_map.values()))
    for name in names:
        if not files.is_file(name):
            raise CheckpointError(f"{where}: names {printable(name)!r}, which does not exist")
    return names


def read_header(files: CheckpointFiles, name: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one safetensors file and its ``__metadata__``, from its header checked as data
    against the file's size."""
    where = files.path(name)
    size = files.size(name)
    if size < 8:
        raise CheckpointError(f"{where}: truncated: {size} bytes, too short for a safetensors header")
    (length,) = struct.unpack("<Q", files.read(name, 0, 8))
    if length > MAX_HEADER:
        raise CheckpointError(f"{where}: header of {length:,} bytes is not a safetensors header")
    if 8 + length > size:
        raise CheckpointError(f"{where}: truncated: a header of {length:,} bytes, "
                              f"the file has {size - 8:,} after its length")
    text = files.read(name, 8, length)
    header = parse_json(text, f"{where}: safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: safetensors header is {json_kind(header)}, not an object")
    if not text.startswith(b"{"):  # safetensors' loader refuses anything before the object
        raise CheckpointError(f"{where}: the safetensors header does not start with '{{'")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{where}: __metadata__ is not an object of strings")
    start = 8 + length
    tensors, spans = {}, []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        problem = utf8_problem(key)
        if problem:
            raise CheckpointError(f"{where}: tensor name {problem}")
        dtype, shape, (begin, end) = _entry(where, key, entry)
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"{where}: {printable(key)}: {end - begin} bytes cannot hold {dtype.name}{list(shape)}")
        if start + end > size:
            raise CheckpointError(f"{where}: truncated: {printable(key)} needs bytes up to {start + end}, "
                                  f"the file has {size}")
        if end > begin:
            spans.append((begin, end, key))
        chunk = Chunk(tuple(0 for _ in shape), shape, name, start + begin, end - begin)
        tensors[key] = TensorInfo((key,), dtype.name, shape, [chunk])
    spans.sort()
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise CheckpointError(f"{where}: the data of {printable(a)} and {printable(b)} overlap (data_offsets)")
    # safetensors' own loader takes only data laid end to end from the header on, nothing after it
    position = 0
    for begin, end, key in spans:
        if begin != position:
            raise CheckpointError(f"{where}: {printable(key)}: data_offsets start at {begin:,} where the data before "
                                  f"it ends at {position:,} (safetensors refuses a gap)")
        position = end
    if start + position != size:
        raise CheckpointError(f"{where}: {size - start - position:,} bytes after the last tensor's data "
                              "(safetensors refuses the file: its header does not account for them)")
    return tensors, metadata or {}


def _entry(where, key: str, entry) -> tuple[dtypes.DType, tuple[int, ...], tuple[int, int]]:
    """One header entry checked as data: ``{"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}``."""
    at = f"{where}: {printable(key)}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{at}: header entry is {json_kind(entry)}, not an object")
    name = entry.get("dtype")
    dtype = dtypes.BY_SAFETENSORS.get(name) if isinstance(name, str) else None
    if dtype is None:
        shown = printable(json.dumps(name), 40) if name is None or isinstance(name, (str, int, float)) else json_kind(name)
        said = "is missing" if "dtype" not in entry else f"{shown} is not a safetensors dtype"
        raise CheckpointError(f"{at}: dtype {said}")
    shape = entry.get("shape")
    problem = shape_problem(shape, dtype.itemsize) if isinstance(shape, list) else f"is {json_kind(shape)}, not an array"
    if problem:
        raise CheckpointError(f"{at}: shape {problem}")
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1] < SIZE_LIMIT):
        raise CheckpointError(f"{at}: data_offsets is not two integers [begin, end] with 0 <= begin <= end")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def header_bytes(entries, metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors header for ``(name, dtype, shape)`` entries whose bytes follow it in that order."""
    header, offset = {"__metadata__": metadata or {"format": "pt"}}, 0
    for key, dtype, shape in entries:
        nbytes = math.prod(shape) * dtypes.dtype(dtype).itemsize
        header[key] = {"dtype": dtypes.dtype(dtype).safetensors, "shape": list(shape),
                       "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(encoded)) + encoded


class SafetensorsFiles:
    """What both safetensors writers share: files of pieces, each file its header then its pieces' bytes
    in header order (no CRC needed). ``lay_out`` fixes headers and places; a subclass names the files."""

    NEEDS_CRC = False

    def lay_out(self, pieces_by_file: dict[str, list[Piece]], metadata=None) -> list[Piece]:
        """Headers and byte places of every file's pieces, stored under their tensors' keys; ``metadata(pieces)``
        gives a file's ``__metadata__`` (default: ``{"format": "pt"}``). Returns every piece."""
        self._pieces, self._headers, self._place = pieces_by_file, {}, {}
        for name, pieces in pieces_by_file.items():
            header = header_bytes([(p.tensor.key, p.tensor.dtype, p.sizes) for p in pieces],
                                  metadata(pieces) if metadata else None)
            self._headers[name], offset = header, len(header)
            for piece in pieces:
                self._place[piece] = (name, offset)
                offset += piece.nbytes
        return [piece for pieces in pieces_by_file.values() for piece in pieces]

    def place(self, piece) -> tuple[str, int]:
        return self._place[piece]

    def files(self) -> dict[str, int]:
        """Every file with the tensor bytes planned for it."""
        return {name: sum(p.nbytes for p in pieces) for name, pieces in self._pieces.items()}

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Write the headers of ``files``; the plan alone says which tensors went where, so there is nothing to report."""
        for name in files:
            self.out.write_at(name, 0, self._headers[name])
        return {}


class Writer(SafetensorsFiles):
    """Writes safetensors shards of at most ``max_shard_size`` (the hub's split: greedy, in key order)."""

    def __init__(self, folder: Path, max_shard_size: int | str = MAX_SHARD_SIZE, adapter_config: dict | None = None):
        self.folder = folder
        self.max_shard_size = parse_size(max_shard_size, "max_shard_size")  # the hub's split gets bytes
        # A PEFT adapter folder instead (export-hf --lora adapter): one adapter_model.safetensors, and this as
        # adapter_config.json (peft loads no shards).
        self.adapter_config = adapter_config
        self.out = OutputFiles(folder)

    def plan(self, tensors, objects):
        by_key = {t.key: t for t in tensors}
        if len(by_key) != len(tensors):
            raise UsageError("two tensors would get the same name in the safetensors output")
        if self.adapter_config is not None:
            return self.lay_out({ADAPTER_FILE: [_whole(by_key[k]) for k in sorted(by_key)]})
        split = split_state_dict_into_shards_factory(
            by_key, get_storage_size=lambda t: t.nbytes, filename_pattern="model{suffix}.safetensors",
            max_shard_size=self.max_shard_size,
        )
        return self.lay_out({name: [_whole(by_key[k]) for k in keys] for name, keys in split.filename_to_tensors.items()})

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """Write the index (when sharded); returns the objects safetensors cannot hold. (The model's config is
        written beside the weights as every output keeps it: ``Format.config_home``.)"""
        if self.adapter_config is not None:
            (self.folder / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config, indent=2) + "\n")
            return [o.key for o in objects]
        if len(self._pieces) > 1:  # sharded, as the hub's split says when it makes more than one file
            weight_map = dict(sorted((piece.tensor.key, name) for piece, (name, _) in self._place.items()))
            index = {"metadata": {"total_size": sum(self.files().values())}, "weight_map": weight_map}
            (self.folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return [o.key for o in objects]


def _whole(tensor):
    return Piece(tensor, tuple(0 for _ in tensor.shape), tuple(tensor.shape))


@dataclass(frozen=True, kw_only=True)
class HfOptions(FormatOptions):
    """The hf output's own options: ``--max-shard-size``.

    Args:
        max_shard_size: the largest safetensors file (bytes, or text such as ``"5GB"``; by default the hub's).

    Example:
        >>> HfOptions().writer_options(), HfOptions(max_shard_size="2GB").writer_options()
        ({}, {'max_shard_size': '2GB'})
    """

    max_shard_size: int | str = MAX_SHARD_SIZE

    def check(self) -> None:
        parse_size(self.max_shard_size, "max_shard_size")


class HuggingFace(Format):
    """A Hugging Face model folder: safetensors files, their index, and the config and tokenizer files."""

    name = NAME
    title = "HF safetensors"
    completes = (INDEX,)  # without the index a sharded folder is incomplete
    options = HfOptions

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer

    def problems(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        return index_problems(checkpoint)


def index_problems(checkpoint: Checkpoint) -> list[tuple[str, str]]:
    """``(tensor, what is wrong)`` where the index does not say where a tensor is, as transformers would find it:
    a tensor in another shard than its entry names, one no entry names, an entry for a tensor no shard holds."""
    files = checkpoint.files
    if files.single_file or not files.is_file(INDEX):
        return []
    where = files.path(INDEX)
    weight_map = files.read_json_object(INDEX, MAX_HEADER, "a safetensors index")["weight_map"]
    found = []
    for key, tensor in checkpoint.tensors.items():
        held = tensor.chunks[0].file
        listed = weight_map.get(key)
        if listed is None:
            found.append((key, f"{where}: {printable(key)} is in {held}, but the index does not list it "
                               "(transformers does not load it)"))
        elif listed != held:
            found.append((key, f"{where}: lists {printable(key)} in {printable(listed)}, but it is in {held}"))
    for key, listed in weight_map.items():
        if key not in checkpoint.tensors:
            found.append((key, f"{where}: lists {printable(key)} in {printable(listed)}, which does not hold it"))
    return found


FORMAT = HuggingFace()
