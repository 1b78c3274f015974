"""Writing a verl folder for any world size, without importing torch.

The files load in a real ``W``-process FSDP1 job with verl's own ``load_checkpoint`` calls (each
rank's files ``torch.load``ed, then under ``SHARDED_STATE_DICT`` ``model.load_state_dict`` and
``optimizer.load_state_dict`` of them as they are): model values as the ShardedTensor of FSDP1
without a device mesh, or the DTensor of FSDP1 given verl's 1-D device mesh of the world; the
optimizer in the form that job saves (``flat`` for verl's default ``use_orig_params=False``,
``orig`` for True), or ``named`` for a job that loads through ``FSDP.optim_state_dict_to_load``.
An FSDP2 folder (``fsdp2``: DTensor values and moments on verl's mesh, also on one rank,
``FSDP_version: 2``) loads in a real ``W``-process FSDP2 job with verl's calls (``fully_shard``,
then ``model.load_state_dict`` and ``optimizer.load_state_dict`` of the files as they are).
``orig`` aligns each parameter to 16 bytes of the dtype FSDP1 computes in, which a MixedPrecision
``param_dtype`` changes: the alignment is taken from a ``use_orig_params=True`` source of 2+ ranks
(the pieces its ranks saved tell it), else assumed from the parameters' dtype, as the output line says.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from dcptool import dtypes
from dcptool.engine.core import OutTensor
from dcptool.errors import UsageError
from dcptool.state_dicts import nest
from dcptool.storage import OutputFiles
from dcptool.engine.transfer import crc32, crc32_combine
from dcptool.torch_archive import ArchiveLayout, Reduced, StorageOut, TensorOut, dumps
from dcptool.converters.fsdp1.codecs import VERL_MESH_DIM_NAMES, device_mesh, dtensor, sharded_tensor, torch_chunk
from dcptool.converters.fsdp1.folder import (CONFIG, EXTRA_STATE, OPTIMIZER, RANK_ENTRY, SOURCE_LAYOUT, RankPiece,
                                             file_name)
from dcptool.converters.fsdp1.optimizer import OPTIMIZER_FORMS, PlainOptimizer

_FILE_OF = {OPTIMIZER: "optim", EXTRA_STATE: "extra_state"}  # the per-rank file each root of entries() goes to


class Writer:
    """Writes verl's per-rank files for every rank, then ``fsdp_config.json`` (the model's config goes to
    ``huggingface/``, the format's ``config_home``, as every output's does).

    ``model_world_size_{W}_rank_{r}.pt``: every tensor split on dim 0 as FSDP1's ``SHARDED_STATE_DICT``
    splits it (``torch.chunk`` over ``world_size``) and stored as the ``ShardedTensor`` rank ``r``
    pickles, or with ``mesh_device`` the ``DTensor`` of FSDP1 given a 1-D device mesh of that device
    type named ``mesh_dim_names``; tensors of shape ``()`` and those whose key matches ``replicate``
    (a regular expression, for buffers FSDP does not shard) go into every rank's file as plain
    tensors. Objects go into every file unchanged, nested again under their paths as the reader
    flattened them. On one rank (NO_SHARD) every tensor is plain, as FSDP1 saves it there; FSDP2
    (``optim_form`` ``fsdp2``) keeps DTensors on a mesh of one rank.

    ``optim_world_size_{W}_rank_{r}.pt`` (entries under ``optimizer``), as ``optim_form`` says:
    ``named``: what ``FSDP.optim_state_dict`` gives under SHARDED_STATE_DICT, ``{"state": {param:
    {"step": t, "exp_avg": <sharded like the parameter>, ...}}, "param_groups": [...]}``, which
    ``FSDP.optim_state_dict_to_load`` takes; ``flat`` and ``orig``: the plain ``optimizer.state_dict()``
    of FSDP1 with ``use_orig_params`` False or True, ``fsdp2``: that of FSDP2 (``PlainOptimizer``), which
    verl's ``optimizer.load_state_dict`` takes as it is. ``extra_state_world_size_{W}_rank_{r}.pt``
    (entries under ``extra_state``): ``{"lr_scheduler": ...}`` in every file (``None`` where the source has
    none: verl's loader reads the key), plus what source rank ``r`` saved of its own
    (``extra_state.rank_<r>``, e.g. its RNG state) where ``entries`` kept it, and under
    ``dcptool_carried`` the source's entries verl has no place for (``planning._carried``), which verl ignores.
    ``source_layout`` (``planning.source_layout``), when
    the non-tensor entries were restructured for verl, is recorded in ``fsdp_config.json`` for the reader.

    Each file is its pickle first and its storages streamed after it; the files are independent.
    """

    NEEDS_CRC = True

    def __init__(self, folder: Path, world_size: int = 1, replicate: str | None = None,
                 optim_form: str = "named", mesh_device: str | None = None,
                 mesh_dim_names: tuple[str, ...] | None = VERL_MESH_DIM_NAMES, orig_alignment: int | None = None,
                 source_layout: dict[str, str] | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"fsdp1 world_size must be a positive integer, not {world_size!r}")
        if optim_form not in OPTIMIZER_FORMS:
            raise UsageError(f"fsdp1 optim_form {optim_form!r}: choose {', '.join(OPTIMIZER_FORMS)}")
        if optim_form == "fsdp2" and mesh_device is None:
            raise UsageError("fsdp1 optim_form 'fsdp2' needs a mesh_device: FSDP2's model values are DTensors")
        self.folder, self.world_size, self.optim_form = Path(folder), world_size, optim_form
        self.fsdp_version = 2 if optim_form == "fsdp2" else 1  # fsdp_config.json's FSDP_version, as verl writes it
        self.mesh_device, self.mesh_dim_names = mesh_device, mesh_dim_names
        self.orig_alignment = orig_alignment
        self.source_layout = source_layout
        self.out = OutputFiles(folder)
        self.replicate = re.compile(replicate) if replicate else None
        self._pieces: list[RankPiece] = []
        self._storages: dict[str, list[StorageOut]] = {}  # file -> its storages, in order
        # (file, storage key) -> its pieces at byte offsets; its bytes known when planning (a mesh's rank map)
        self._parts: dict[tuple[str, str], list[tuple[int, RankPiece]]] = {}
        self._fixed: dict[tuple[str, str], bytes] = {}
        self._at: dict[RankPiece, tuple[str, int]] = {}  # piece -> (its storage, byte offset in it)
        self._meshes: dict[str, Reduced] = {}  # file -> the one device mesh its DTensors share
        self._archives: dict[str, ArchiveLayout] = {}
        self._start_of: dict[tuple[str, str], int] = {}  # (file, storage key) -> where its bytes start

    def _replicated(self, tensor) -> bool:
        # FSDP1 on one rank runs NO_SHARD, whose SHARDED_STATE_DICT holds plain tensors; FSDP2 keeps DTensors.
        return (self.world_size == 1 and self.fsdp_version == 1) or not tensor.shape \
            or bool(self.replicate and self.replicate.search(tensor.key))

    def _part(self, entry, rank: int) -> tuple[str, tuple] | None:
        """``(file kind, path inside the file)`` of an entry in rank ``rank``'s files; None if that rank has none of it."""
        path = tuple(entry.path)
        if path[0] == OPTIMIZER:
            return _FILE_OF[OPTIMIZER], path[1:]
        if path[0] == EXTRA_STATE:
            own = RANK_ENTRY.match(str(path[1]))
            if own is None:
                return "extra_state", path[1:]
            if int(own.group(1)) >= self.world_size:
                raise UsageError(f"{entry.key}: state of source rank {own.group(1)}, which a world size of "
                                 f"{self.world_size} does not have (fsdp1.entries leaves it out)")
            return ("extra_state", path[2:]) if int(own.group(1)) == rank else None
        return "model", (entry.key,) if isinstance(entry, OutTensor) else path

    def plan(self, tensors, objects):
        """Lay out every rank's files (each pickle built, its storages placed after it) and return the pieces
        whose bytes go into them."""
        plain = None
        if self.optim_form != "named" and any(e.path[0] == OPTIMIZER for e in [*tensors, *objects]):
            parameters = [t for t in tensors if t.path[0] not in _FILE_OF and t.shape
                          and not (self.replicate and self.replicate.search(t.key))]
            plain = PlainOptimizer(self.optim_form, parameters, tensors, objects, self.world_size, self.orig_alignment)
        kinds = ["model"] + sorted({_FILE_OF[e.path[0]] for e in [*tensors, *objects] if e.path[0] in _FILE_OF})
        for rank in range(self.world_size):
            entries: dict[str, dict[tuple, Any]] = {kind: {} for kind in kinds}
            for entry in [*tensors, *objects]:
                part = self._part(entry, rank)
                if part is None or (plain and entry.path[0] == OPTIMIZER):
                    continue
                kind, inside = part
                if inside in entries[kind]:
                    raise UsageError(f"{entry.key}: two entries have this key")
                name = file_name(kind, self.world_size, rank)
                if not isinstance(entry, OutTensor):
                    entries[kind][inside] = entry.value()
                elif self._replicated(entry) or kind == "extra_state":
                    entries[kind][inside] = self.whole(entry, rank, name)
                else:
                    entries[kind][inside] = self.sharded(entry, rank, name)
            extra = entries.get("extra_state")
            if extra is not None and not any(path[0] == "lr_scheduler" for path in extra):
                extra[("lr_scheduler",)] = None  # verl's load_checkpoint reads extra_state["lr_scheduler"]
            trees = {kind: nest(nested) for kind, nested in entries.items()}
            if plain:  # keyed by numbers, which nest() would make a list
                trees["optim"] = plain.state_dict(self, rank, file_name("optim", self.world_size, rank))
            for kind, tree in trees.items():
                name = file_name(kind, self.world_size, rank)
                archive = ArchiveLayout(dumps(tree), name[: -len(".pt")])
                for storage in self._storages.get(name, []):
                    start = archive.add_storage(storage.key, storage.numel * dtypes.dtype(storage.dtype).itemsize)
                    self._start_of[(name, storage.key)] = start
                archive.close()
                self._archives[name] = archive
        return self._pieces

    def stored(self, file: str, dtype: str, shape, parts: list[tuple[RankPiece, int]]) -> TensorOut:
        """A contiguous tensor of ``file`` made of ``parts`` (a piece and the element it starts at); zeros elsewhere."""
        storage = self._storage(file, dtype, math.prod(shape))
        itemsize = dtypes.dtype(dtype).itemsize
        placed = [(at * itemsize, piece) for piece, at in parts if piece.nbytes]
        self._parts[(file, storage.key)] = placed
        for offset, piece in placed:
            self._at[piece] = (storage.key, offset)
            self._pieces.append(piece)
        return TensorOut(storage, tuple(shape))

    def whole(self, tensor: OutTensor, rank: int, file: str) -> TensorOut:
        """All of ``tensor`` as a plain tensor of ``file``."""
        piece = RankPiece(tensor, (0,) * len(tensor.shape), tuple(tensor.shape), rank, file)
        return self.stored(file, tensor.dtype, tensor.shape, [(piece, 0)])

    def sharded(self, tensor: OutTensor, rank: int, file: str) -> Reduced:
        """Rank ``rank``'s rows of ``tensor`` (``torch.chunk`` on dim 0) as the ShardedTensor or DTensor FSDP1 saves."""
        shards = torch_chunk(tensor.shape[0], self.world_size)
        start, rows = shards[rank] if rank < len(shards) else (tensor.shape[0], 0)
        sizes = (rows,) + tuple(tensor.shape[1:])
        piece = RankPiece(tensor, (start,) + (0,) * (len(tensor.shape) - 1), sizes, rank, file)
        if self.mesh_device is None:  # a rank past the last chunk holds no local shard
            local = self.stored(file, tensor.dtype, sizes, [(piece, 0)]) if rank < len(shards) else None
            return sharded_tensor(tensor.dtype, tensor.shape, rank, self.world_size, local)
        local = self.stored(file, tensor.dtype, sizes, [(piece, 0)])  # a DTensor's may hold no rows
        return dtensor(tensor.dtype, tensor.shape, self._mesh(file, rank), local)

    def _mesh(self, file: str, rank: int) -> Reduced:
        mesh = self._meshes.get(file)
        if mesh is None:
            rank_map = self._storage(file, "int32", self.world_size)
            self._fixed[(file, rank_map.key)] = struct.pack(f"<{self.world_size}i", *range(self.world_size))
            mesh = self._meshes[file] = device_mesh(self.world_size, rank, self.mesh_device, self.mesh_dim_names,
                                                    TensorOut(rank_map, (self.world_size,)))
        return mesh

    def place(self, piece: RankPiece) -> tuple[str, int]:
        """The file a piece's bytes go to, and their byte offset in it."""
        storage, offset = self._at[piece]
        return piece.file, self._start_of[(piece.file, storage)] + offset

    def files(self) -> dict[str, int]:
        """Every rank's files with the tensor bytes planned for them."""
        sizes = dict.fromkeys(self._archives, 0)
        for piece in self._pieces:
            sizes[piece.file] += piece.nbytes
        return sizes

    def _storage(self, name: str, dtype: str, numel: int) -> StorageOut:
        storages = self._storages.setdefault(name, [])
        storage = StorageOut(str(len(storages)), dtype, numel)
        storages.append(storage)
        return storage

    def finish_files(self, objects, files: set[str], crcs) -> dict:
        """Write everything but the pieces' bytes into ``files``; nothing to report."""
        for name, archive in self._archives.items():
            if name in files:
                by_storage = {storage.key: self._fill(name, storage, crcs) for storage in self._storages.get(name, [])}
                for offset, data in archive.segments(by_storage):
                    self.out.write_at(name, offset, data)
        return {}

    def _fill(self, name: str, storage: StorageOut, crcs) -> int:
        """Write the bytes of a storage that no piece brings (a rank map; the zeros that pad a flat parameter)
        and return the CRC-32 of all its bytes."""
        start = self._start_of[(name, storage.key)]
        fixed = self._fixed.get((name, storage.key))
        if fixed is not None:
            self.out.write_at(name, start, fixed)
            return crc32(fixed)
        crc, done = 0, 0
        end = storage.numel * dtypes.dtype(storage.dtype).itemsize
        for offset, piece in sorted(self._parts[(name, storage.key)], key=lambda part: part[0]) + [(end, None)]:
            if offset > done:
                zeros = bytes(offset - done)
                self.out.write_at(name, start + done, zeros)
                crc = crc32_combine(crc, crc32(zeros), len(zeros)) if done else crc32(zeros)
                done = offset
            if piece is not None:
                crc = crc32_combine(crc, crcs[piece], piece.nbytes) if offset else crcs[piece]
                done = offset + piece.nbytes
        return crc

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        """``fsdp_config.json`` with the new world size; nothing is left out here."""
        config = {"FSDP_version": self.fsdp_version, "world_size": self.world_size}
        if self.source_layout:  # verl reads neither key; dcptool's reader gives the entries back as they were
            config[SOURCE_LAYOUT] = self.source_layout
        (self.folder / CONFIG).write_text(json.dumps(config) + "\n")
        return []
