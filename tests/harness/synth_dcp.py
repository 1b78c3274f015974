"""Synthetic DCP checkpoints as ``dcp.save`` writes them from N ranks of FSDP2 (+ TP), made by one process.

No process group and no model: the chunks each rank holds come from ``dcptool.mesh`` (torch's uneven
dim-0 split, ``_StridedShard`` under TP), replicated entries are deduplicated as torch's
``dedup_save_plans`` does (least-loaded rank, ties as torch breaks them), each rank's file holds its
byte entries then its chunks in state-dict order, each chunk a ``torch.save`` archive, and
``.metadata`` is a pickle of torch's own ``Metadata`` classes. A test checks the result against a
real gloo save. Every archive of one dtype and shape is the same bytes but its data and CRC-32, so
it is made once with ``torch.save`` and patched: 1,024 ranks x 80 layers (~740k chunks) take seconds.

Values are a pattern (``value_of``), so readers can be checked element by element.

    PYTHONPATH=tests python -m harness.synth_dcp /tmp/llama-1024 --ranks 1024 --layers 80 --rows 1024 --width 8
    PYTHONPATH=tests python -m harness.synth_dcp /tmp/llama-tp --ranks 8 --tp 2 --layers 2
"""

from __future__ import annotations

import argparse
import io
import pickle
import struct
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcptool.planning import plans
from dcptool.mesh import Mesh, local_chunk
from dcptool.planning.resharding import DEFAULT_RULE, tensor_spec


@dataclass
class TensorEntry:
    """A tensor of the state dict: its nested path, shape, dtype and the plan rule that places it
    (None: a plain tensor every rank holds whole, as optimizer step counters)."""

    path: tuple[str | int, ...]
    shape: tuple[int, ...]
    dtype: str
    rule: plans.Rule | None = DEFAULT_RULE
    requires_grad: bool = False

    @property
    def key(self) -> str:
        return ".".join(map(str, self.path))


@dataclass
class BytesEntry:
    """A non-tensor entry (``torch.save`` bytes) held by ``holders`` (None: every rank)."""

    path: tuple[str | int, ...]
    payload: bytes
    holders: frozenset[int] | None = None

    @property
    def key(self) -> str:
        return ".".join(map(str, self.path))


@dataclass
class _Item:
    """One write item of one rank's plan: a tensor chunk (``sizes`` set) or a bytes entry."""

    entry: TensorEntry | BytesEntry
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    # Filled when written: where its record is.
    file: str = ""
    start: int = 0
    length: int = 0
    position: int | None = field(default=None)  # its index among the tensor's chunks

    @property
    def index(self) -> tuple[str, tuple[int, ...] | None]:
        return self.entry.key, self.offsets

    @property
    def storage_size(self) -> int:
        """What dedup_save_plans charges a rank for it: ``tensor_storage_size() or 1``, the bytes of the
        whole tensor (torch counts the global size), 1 for bytes entries."""
        if self.sizes is None:
            return 1
        return int(np.prod(self.entry.shape, dtype=np.int64)) * _itemsize(self.entry.dtype) or 1


def llama_entries(layers: int, rows: int, width: int, dtype: str = "bfloat16") -> list[TensorEntry]:
    """A Llama-shaped model under HF names, every weight ``[rows, width]`` (norms ``[rows]``): narrow
    tensors with ``rows`` >= ranks give every rank a chunk of every tensor, as a large model would."""
    hf = plans.BUILTIN["hf"]
    names = ["model.embed_tokens.weight"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        names += [prefix + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                       "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                       "mlp.down_proj.weight", "input_layernorm.weight",
                                       "post_attention_layernorm.weight")]
    names += ["model.norm.weight", "lm_head.weight"]
    return [TensorEntry((name,), (rows,) if name.endswith("norm.weight") else (rows, width), dtype,
                        hf.rule_for(name) or DEFAULT_RULE) for name in names]


def value_of(entry_index: int, shape: tuple[int, ...]) -> np.ndarray:
    """The synthetic values of the ``entry_index``-th tensor: small integers, exact in every float dtype."""
    numel = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(numel, dtype=np.int64) + 7 * entry_index) % 251 - 125).astype(np.float32).reshape(shape)


def rank_plans(entries: list, mesh: Mesh) -> list[list[_Item]]:
    """Each rank's write items before dedup, in state-dict order (``create_default_local_save_plan``)."""
    coordinates = [mesh.coordinates(rank) for rank in range(mesh.world)]
    layouts: dict = {}  # (shape, spec) -> every rank's (offsets, sizes): layers repeat
    per_entry = []
    for entry in entries:
        if isinstance(entry, BytesEntry):
            per_entry.append(None)
            continue
        spec = tensor_spec(entry.key, entry.rule, entry.shape, mesh)
        found = layouts.get((entry.shape, spec))
        if found is None:
            found = layouts[(entry.shape, spec)] = [local_chunk(entry.shape, spec, c) for c in coordinates]
        per_entry.append(found)
    plans_of = []
    for rank in range(mesh.world):
        items = []
        for entry, chunks in zip(entries, per_entry):
            if chunks is None:
                if entry.holders is None or rank in entry.holders:
                    items.append(_Item(entry))
            else:
                offsets, sizes = chunks[rank]
                items.append(_Item(entry, offsets, sizes))
        plans_of.append(items)
    return plans_of


def dedup(plans_of: list[list[_Item]]) -> list[list[_Item]]:
    """torch's ``dedup_save_plans``: an item several ranks hold stays with the least-loaded one."""
    holders: dict = {}
    for rank, items in enumerate(plans_of):
        for item in items:
            holders.setdefault(item.index, (item, set()))[1].add(rank)
    size = [0] * len(plans_of)
    keep: list[set] = [set() for _ in plans_of]
    for index, (item, ranks) in holders.items():
        chosen = min(ranks, key=lambda r: size[r])  # over a set, as torch does: ties break the same way
        size[chosen] += item.storage_size
        keep[chosen].add(index)
    return [[item for item in items if item.index in kept] for items, kept in zip(plans_of, keep)]


class _ArchiveTemplate:
    """A chunk's ``torch.save`` archive for one dtype and shape, made by torch once; patched per chunk."""

    def __init__(self, dtype: str, sizes: tuple[int, ...]):
        import torch

        stream = io.BytesIO()
        torch.save(torch.zeros(sizes, dtype=getattr(torch, dtype)), stream)
        self.bytes = stream.getvalue()
        with zipfile.ZipFile(io.BytesIO(self.bytes)) as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
        header = info.header_offset
        name_length, extra_length = struct.unpack_from("<HH", self.bytes, header + 26)
        self.data_start = header + 30 + name_length + extra_length
        self.nbytes = info.file_size
        # where torch.save keeps the CRC-32: in the data descriptor after the data when the local header defers
        # to one (flag bit 3: its own CRC-32 field stays 0), else in the local header; and in the directory
        deferred = struct.unpack_from("<H", self.bytes, header + 6)[0] & 8
        descriptor = self.data_start + self.nbytes
        local = descriptor + (4 if self.bytes[descriptor:descriptor + 4] == b"PK\x07\x08" else 0) if deferred \
            else header + 14
        self.crc_places = [local, self._central_entry(info.filename) + 16]

    def _central_entry(self, name: str) -> int:
        encoded = name.encode()
        position = self.bytes.find(b"PK\x01\x02")
        while position >= 0:
            length = struct.unpack_from("<H", self.bytes, position + 28)[0]
            if self.bytes[position + 46:position + 46 + length] == encoded:
                return position
            position = self.bytes.find(b"PK\x01\x02", position + 46)
        raise ValueError(f"torch.save archive without a directory entry for {name}")

    def archive(self, data: bytes) -> bytearray:
        out = bytearray(self.bytes)
        out[self.data_start:self.data_start + self.nbytes] = data
        crc = zlib.crc32(data)
        for place in self.crc_places:
            struct.pack_into("<I", out, place, crc)
        return out


def _itemsize(dtype: str) -> int:
    from dcptool import dtypes

    return dtypes.dtype(dtype).itemsize


def _raw_values(entries: list) -> list[np.ndarray | None]:
    """Every tensor's values as raw little-endian items (uint views), from ``value_of``."""
    import torch

    raw = []
    for number, entry in enumerate(entries):
        if isinstance(entry, BytesEntry):
            raw.append(None)
            continue
        values = torch.from_numpy(value_of(number, entry.shape)).to(getattr(torch, entry.dtype))
        raw.append(values.reshape(-1).view(torch.uint8).numpy().view(f"u{_itemsize(entry.dtype)}").reshape(entry.shape))
    return raw


def write(out: Path, entries: list, mesh: Mesh) -> dict:
    """Write the checkpoint ``dcp.save`` makes of ``entries`` on ``mesh``; returns counts for a summary."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    out.mkdir(parents=True, exist_ok=True)
    plans_of = dedup(rank_plans(entries, mesh))
    raw = _raw_values(entries)
    number_of = {id(entry): n for n, entry in enumerate(entries)}
    templates: dict = {}
    chunks = 0
    for rank, items in enumerate(plans_of):
        name = f"__{rank}_0.distcp"
        position = 0
        with open(out / name, "wb") as stream:
            # dcp.save writes a file's byte entries first, then its tensors, each in plan order
            for item in [i for i in items if i.sizes is None] + [i for i in items if i.sizes is not None]:
                if item.sizes is None:
                    record = item.entry.payload
                else:
                    values = raw[number_of[id(item.entry)]]
                    box = tuple(slice(o, o + s) for o, s in zip(item.offsets, item.sizes))
                    key = (item.entry.dtype, item.sizes)
                    template = templates.get(key) or templates.setdefault(key, _ArchiveTemplate(*key))
                    record = template.archive(np.ascontiguousarray(values[box]).tobytes())
                    chunks += 1
                stream.write(record)
                item.file, item.start, item.length = name, position, len(record)
                position += len(record)

    state_dict_metadata: dict = {}
    properties: dict = {}
    for items in plans_of:  # create_default_global_save_plan: every rank's items, in rank order
        for item in items:
            entry = item.entry
            if item.sizes is None:
                state_dict_metadata[entry.key] = BytesStorageMetadata()
                continue
            props_key = (entry.dtype, entry.requires_grad)
            props = properties.get(props_key) or properties.setdefault(props_key, TensorProperties(
                dtype=getattr(torch, entry.dtype), requires_grad=entry.requires_grad))
            md = state_dict_metadata.get(entry.key)
            if md is None:
                md = state_dict_metadata[entry.key] = TensorStorageMetadata(props, torch.Size(entry.shape), [])
            item.position = len(md.chunks)
            md.chunks.append(ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes)))
    storage_data = {}
    for items in plans_of:  # FileSystemWriter.finish: each rank's write results, bytes first as written
        for item in [i for i in items if i.sizes is None] + [i for i in items if i.sizes is not None]:
            offsets = None if item.offsets is None else torch.Size(item.offsets)
            # a fresh key string per record, as the ranks' gathered results have (the pickle repeats it)
            storage_data[MetadataIndex((item.entry.key + " ")[:-1], offsets, item.position)] = _StorageInfo(
                item.file, item.start, item.length)
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    metadata = Metadata(state_dict_metadata, planner_data={e.key: e.path for e in entries},
                        storage_data=storage_data, storage_meta=StorageMeta(checkpoint_id=str(out)),
                        version=CURRENT_DCP_VERSION)
    with open(out / ".metadata", "wb") as stream:
        pickle.dump(metadata, stream)
    return {"ranks": mesh.world, "tensors": sum(isinstance(e, TensorEntry) for e in entries), "chunks": chunks,
            "metadata_bytes": (out / ".metadata").stat().st_size}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--ranks", type=int, required=True, help="world size of the saving job")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (FSDP over ranks/tp)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=None, help="dim 0 of every tensor (default: --ranks)")
    parser.add_argument("--width", type=int, default=8, help="dim 1 of the weights")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if args.ranks % args.tp:
        parser.error(f"--tp {args.tp} does not divide --ranks {args.ranks}")
    start = time.perf_counter()
    mesh = Mesh(dp=args.ranks // args.tp, tp=args.tp)
    entries = llama_entries(args.layers, args.rows or args.ranks, args.width, args.dtype)
    summary = write(args.out, entries, mesh)
    print(f"{args.out}: {summary['ranks']} ranks, {summary['tensors']} tensors, {summary['chunks']:,} chunks, "
          f".metadata {summary['metadata_bytes']:,} bytes, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
