"""PyTorch Distributed Checkpoint (DCP): a folder with ``.metadata`` and ``__{rank}_{n}.distcp`` files.

Read offline with no process group; ``.metadata`` goes through dcptool's restricted unpickler, so
inspecting a hostile checkpoint runs no code. Each tensor chunk is a ``torch.save`` archive at a
known offset of a ``.distcp`` file.
"""

from __future__ import annotations

import re
from pathlib import Path

from dcptool import safe_pickle
from dcptool.core import Checkpoint, Chunk, ObjectInfo, TensorInfo
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles

NAME = "dcp"
METADATA = ".metadata"
_DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")


def detect(path: Path) -> bool:
    return path.is_dir() and ((path / METADATA).is_file() or any(path.glob("*.distcp")))


def read(path: Path) -> Checkpoint:
    files = CheckpointFiles(path)
    if not (path / METADATA).is_file():
        raise CheckpointError(f"{path / METADATA}: missing (a DCP checkpoint folder needs its .metadata file)")
    metadata = safe_pickle.load_bytes((path / METADATA).read_bytes(), str(path / METADATA))
    if type(metadata).__name__ != "Metadata" or not hasattr(metadata, "state_dict_metadata"):
        raise CheckpointError(f"{path / METADATA}: not DCP metadata (holds {type(metadata).__name__})")
    where = str(path / METADATA)

    storage: dict[tuple[str, tuple[int, ...] | None], object] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        offset = getattr(index, "offset", None)
        storage[(index.fqn, tuple(offset) if offset is not None else None)] = info
    planner_data = getattr(metadata, "planner_data", None) or {}

    tensors: dict[str, TensorInfo] = {}
    objects: dict[str, ObjectInfo] = {}
    for key, entry in metadata.state_dict_metadata.items():
        nested = tuple(str(p) for p in planner_data.get(key, (key,)))
        kind = type(entry).__name__
        if kind == "BytesStorageMetadata":
            info = _storage_info(storage, key, None, where)
            objects[key] = ObjectInfo(nested, blob=(info.relative_path, info.offset, info.length))
        elif kind == "TensorStorageMetadata":
            chunks = []
            for chunk in entry.chunks:
                offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
                info = _storage_info(storage, key, offsets, where)
                chunks.append(Chunk(offsets, sizes, info.relative_path, info.offset, info.length, "torch-archive"))
            tensors[key] = TensorInfo(nested, _dtype_of(entry.properties, key, where), tuple(entry.size), chunks)
        else:
            raise CheckpointError(f"{where}: {key}: unknown entry type {kind}")

    ranks = {int(m.group(1)) for f in path.iterdir() if (m := _DATA_FILE.match(f.name))}
    info = {"version": getattr(metadata, "version", None), "saving_ranks": len(ranks) or None}
    checkpoint = Checkpoint(NAME, path, files, tensors, objects, info)
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
