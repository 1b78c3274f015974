"""torch's HF-storage DCP: safetensors files whose ``__metadata__`` says where each tensor sits in the whole.

``dcp.save(..., storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))`` has every rank
write ``shard-{rank+1:05d}-model-{i:05d}-of-{n:05d}.safetensors`` holding its chunks, with
``__metadata__["DCP_SHARDING_INFO"]`` = JSON ``{key: {"saved_offsets": [...]}}``; a tensor's global
shape is the largest ``offset + size`` of its chunks, as ``HuggingFaceStorageReader`` and
``consolidate_safetensors_files`` compute it. With ``enable_consolidation`` the chunks are in
``path/sharded/`` and ``path`` gets whole tensors: that folder is plain ``hf``, and a folder holding
only ``sharded/`` (a consolidation that failed or never ran) is read from there.

>>> ckpt = dcptool.open_checkpoint("hf-save/sharded")        # doctest: +SKIP
>>> ckpt.format, ckpt.tensors["model.norm.weight"].shape     # doctest: +SKIP
('hf-dcp', (64,))
"""

from __future__ import annotations

import json
from pathlib import Path

from dcptool.engine.chunks import Chunk
from dcptool.engine.core import Checkpoint, Piece, TensorInfo
from dcptool.errors import CheckpointError, UsageError, json_kind, parse_json, printable, shape_problem, option
from dcptool.format_interface import Format, Sharding
from dcptool.storage import CheckpointFiles, OutputFiles
from dcptool.converters import hf

NAME = "hf-dcp"
SHARDED = "sharded"  # where HuggingFaceStorageWriter(enable_consolidation=True) puts the chunks
DCP_VERSION = "1.0"


def detect(files: CheckpointFiles) -> bool:
    names = _data_files(files)
    return bool(names) and hf.dcp_sharded(files, names[0])


def _data_files(files: CheckpointFiles) -> list[str]:
    """The safetensors files to read: the folder's own, else those of its ``sharded/`` folder."""
    if files.single_file:
        return [files.single_file] if files.single_file.endswith(".safetensors") else []
    if not files.is_dir():
        return []
    own = files.names("*.safetensors")
    if own:
        return own
    sharded = CheckpointFiles(files.path(SHARDED))  # one look at a folder of that name: no walk of the tree
    return [f"{SHARDED}/{name}" for name in sharded.names("*.safetensors")] if sharded.is_dir() else []


def read(files: CheckpointFiles) -> Checkpoint:
    names = _data_files(files)
    if not names:
        raise CheckpointError(f"{files.location}: no safetensors files (nor a {SHARDED}/ folder of them)")
    tensors: dict[str, TensorInfo] = {}
    for name in names:
        where = files.path(name)
        found, metadata = hf.read_header(files, name)
        offsets_of = _sharding_info(where, metadata, found)
        for key, stored in found.items():
            whole = stored.chunks[0]
            chunk = Chunk(offsets_of[key], whole.sizes, name, whole.offset, whole.length)
            tensor = tensors.get(key)
            if tensor is None:
                tensors[key] = TensorInfo((key,), stored.dtype, (), [chunk])
            elif tensor.dtype != stored.dtype:
                raise CheckpointError(f"{where}: {printable(key)} is {stored.dtype} here but {tensor.dtype} in "
                                      f"{tensor.chunks[0].file}")
            elif len(tensor.chunks[0].sizes) != len(chunk.sizes):
                raise CheckpointError(f"{where}: {printable(key)} has {len(chunk.sizes)} dims here but "
                                      f"{len(tensor.chunks[0].sizes)} in {tensor.chunks[0].file}")
            else:
                tensor.chunks.append(chunk)
    for tensor in tensors.values():  # the global shape: the furthest extent of its chunks
        tensor.shape = tuple(max(c.offsets[d] + c.sizes[d] for c in tensor.chunks)
                             for d in range(len(tensor.chunks[0].sizes)))
        problem = shape_problem(list(tensor.shape))
        if problem:
            raise CheckpointError(f"{files.location}: {printable(tensor.key)}: global shape {problem}")
    info = {"files": len(names)}
    if files.is_file("config.json"):
        info["hf_config_dir"] = files.root
    checkpoint = Checkpoint(NAME, files.location, files, tensors, {}, info)
    checkpoint.validate()
    return checkpoint


def _sharding_info(where, metadata: dict[str, str], tensors: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    """Each tensor's offsets in the whole, from ``DCP_SHARDING_INFO`` checked as data."""
    text = metadata.get(hf.DCP_SHARDING_INFO)
    if text is None:
        raise CheckpointError(f"{where}: no {hf.DCP_SHARDING_INFO} in __metadata__ (not a file of torch's "
                              f"HuggingFaceStorageWriter; read a folder of plain safetensors with {option('format', 'hf')})")
    info = parse_json(text.encode(), f"{where}: __metadata__[{hf.DCP_SHARDING_INFO}]")
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: {hf.DCP_SHARDING_INFO} is {json_kind(info)}, not an object")
    offsets_of = {}
    for key, tensor in tensors.items():
        entry = info.get(key)
        offsets = entry.get("saved_offsets") if isinstance(entry, dict) else None
        at = f"{where}: {hf.DCP_SHARDING_INFO}[{printable(key)!r}]"
        if entry is None:
            raise CheckpointError(f"{at} is missing (every tensor of the file needs its offsets)")
        if not isinstance(offsets, list):
            raise CheckpointError(f"{at}: saved_offsets is {json_kind(offsets)}, not a list of integers")
        problem = shape_problem(offsets) or (None if len(offsets) == len(tensor.shape) else
                                             f"has {len(offsets)} dims, the tensor {len(tensor.shape)}")
        if problem:
            raise CheckpointError(f"{at}: saved_offsets {problem}")
        offsets_of[key] = tuple(offsets)
    return offsets_of


def shard_file(rank: int) -> str:
    """The file ``HuggingFaceStorageWriter(save_distributed=True)`` writes on ``rank`` (one file per rank)."""
    return f"shard-{rank + 1:05d}-model-00001-of-00001.safetensors"


class Writer(hf.SafetensorsFiles):
    """Writes one safetensors file per rank, each chunk under its key with its offsets in ``__metadata__``,
    which ``dcp.load(..., storage_reader=HuggingFaceStorageReader(folder))`` reads.

    ``layout(tensor)`` gives each tensor's chunks as ``(offsets, sizes, rank)`` (default: whole, on
    rank 0); a file holds at most one chunk of a tensor, as safetensors names are unique. Non-tensor
    entries cannot be held and are reported.
    """

    def __init__(self, folder: Path, layout=None, world_size: int = 1):
        self.folder, self.world_size = folder, world_size
        self.out = OutputFiles(folder)
        self.layout = layout or (lambda t: [(tuple(0 for _ in t.shape), tuple(t.shape), 0)])

    def plan(self, tensors, objects):
        by_file: dict[str, list[Piece]] = {}
        for tensor in tensors:
            for offsets, sizes, rank in self.layout(tensor):
                pieces = by_file.setdefault(shard_file(rank), [])
                if any(p.tensor is tensor for p in pieces):
                    raise UsageError(f"{option('to', NAME)}: rank {rank} would hold two chunks of {tensor.key}, "
                                     "which one safetensors file cannot")
                pieces.append(Piece(tensor, tuple(offsets), tuple(sizes)))
        return self.lay_out(dict(sorted(by_file.items())), lambda pieces: {
            hf.DCP_SHARDING_INFO: json.dumps({p.tensor.key: {"saved_offsets": list(p.offsets)} for p in pieces}),
            "DCP_VERSION": DCP_VERSION, "format": "pt"})

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """Nothing to index; returns the non-tensor entries, which safetensors cannot hold."""
        return [o.key for o in objects]


class HuggingFaceDcp(Format):
    """Safetensors files that torch's ``HuggingFaceStorageWriter`` writes under ``dcp.save``, one per rank."""

    name = NAME
    title = "torch's HF-storage DCP"
    sharding = Sharding.MESH

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer


FORMAT = HuggingFaceDcp()
