"""Megatron-LM's legacy per-rank checkpoint (``--ckpt-format torch``, what Megatron's conversion tools still
write): ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, each a ``torch.save`` of ``{"model": that rank's
state dict, "args": Namespace, "iteration": N, "checkpoint_version": 3.0, ...}``.

Read as the tensors a ``torch_dist`` save of the same model holds, so both read alike: per-layer local names
``decoder.layers.{local}.X`` renumbered by the stage's layer offset and stacked into ``decoder.layers.X``
``[L, ...]``; SequentialMLP's ``local_experts.{j}`` placed by the expert rank into ``mlp.experts.experts.X``
``[L, E, ...]`` (Transformer Engine's GroupedMLP keeps them as ``linear_fc1.weight{j}``: the same);
tensor-parallel pieces joined along each parameter's parallel dim (column-parallel: dim 0,
SwiGLU's ``linear_fc1`` as ``[gate; up]`` of every rank's halves; row-parallel: dim 1; the rest replicated);
the local spec's ``input_layernorm`` / ``pre_mlp_layernorm`` under the fused names torch_dist saves. Every
piece is a chunk of elements in place in its rank's file: nothing is copied to read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from dcptool.converters.megatron.common import run_info
from dcptool.converters.megatron.names import (
    LAYERS,
    LEGACY_FILE,
    LEGACY_RANK,
    LOCAL_SPEC_NAMES,
    NAME,
)
from dcptool.engine.chunks import Chunk
from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo
from dcptool.errors import CheckpointError, printable
from dcptool.safe_pickle import Record, TensorRef
from dcptool.storage import CheckpointFiles
from dcptool.torch_archive import Archive
from dcptool.torch_archive.reading import RawBytes

# Parameters split over tensor-parallel ranks, by the end of their name (Megatron's ColumnParallelLinear /
# RowParallelLinear / VocabParallelEmbedding); every other parameter is the same on every rank.
COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "linear_fc1.weight",
                   "linear_fc1.bias", "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight",
                   "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
GATED = ("linear_fc1.weight", "linear_fc1.bias")  # SwiGLU: each rank holds [gate_r; up_r]
LOCAL_EXPERTS = "mlp.experts.local_experts."
# Transformer Engine's GroupedMLP (--moe-grouped-gemm): local expert j's linear_fc1.weight is linear_fc1.weight{j}.
GROUPED_EXPERTS = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Transformer Engine keeps its FP8 scaling state as a byte tensor per module: no weight, rebuilt by its load.
EXTRA_STATE = "._extra_state"
STACKED_EXPERTS = "mlp.experts.experts."


def detect(files: CheckpointFiles) -> bool:
    return any(files.is_file(f"mp_rank_00{suffix}/{LEGACY_FILE}") for suffix in ("", "_000", "_000_000"))


@dataclass(frozen=True)
class Rank:
    tp: int
    pp: int
    ep: int
    file: str


@dataclass
class Run:
    """What the args say of the layout: sizes, layers, experts, whether linear_fc1 is gated."""

    tp: int
    pp: int
    ep: int
    etp: int
    vpp: int
    layers: int
    experts: int
    gated: bool
    tied: bool
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def layer_offset(self, pp_rank: int, chunk: int) -> int:
        """The global number of the first layer of pipeline rank ``pp_rank``'s model chunk ``chunk``
        (``get_transformer_layer_offset``: even stages, or the first / last stage's own counts)."""
        if self.vpp > 1:
            per_chunk = self.layers // (self.pp * self.vpp)
            return (chunk * self.pp + pp_rank) * per_chunk
        first, last = self.first_stage_layers, self.last_stage_layers
        if first is None and last is None:
            return pp_rank * (self.layers // self.pp)
        middle_stages = self.pp - (first is not None) - (last is not None)
        middle = (self.layers - (first or 0) - (last or 0)) // max(middle_stages, 1)
        if pp_rank == 0:
            return 0
        return (first if first is not None else middle) + (pp_rank - 1) * middle


def read(files: CheckpointFiles) -> Checkpoint:
    names = [name for name in files.all_names() if LEGACY_RANK.fullmatch(name)]
    archives = {name: Archive(files, name) for name in names}
    first = min(names)
    root = _state(archives[first])
    where = str(files.path(first))
    args = run_info(root, where)["args"] or {}
    run = _run(args, where)
    ranks = [_rank(name, run) for name in names]
    expected = {(tp, pp, ep) for tp in range(run.tp) for pp in range(run.pp) for ep in range(run.ep)}
    missing = sorted(expected - {(r.tp, r.pp, r.ep) for r in ranks})
    if missing:
        tp, pp, ep = missing[0]
        raise CheckpointError(f"{files.location}: the rank file of tensor rank {tp}, pipeline rank {pp}, expert rank "
                              f"{ep} is missing ({len(missing)} of {len(expected)} missing; args say TP {run.tp}, "
                              f"PP {run.pp}, EP {run.ep})")
    pieces: dict[str, list[tuple[tuple, Chunk, str]]] = {}
    dtypes: dict[str, str] = {}
    extra_states = 0
    for rank in ranks:
        archive = archives[rank.file]
        state = root if rank.file == first else _state(archive)
        for chunk_number, model in _models(state, run, str(files.path(rank.file))):
            for local, value in model.items():
                if not isinstance(value, TensorRef):
                    continue  # _extra_state: None with the local spec
                if local.endswith(EXTRA_STATE):
                    extra_states += 1
                    continue
                if value.subclass:
                    raise CheckpointError(f"{files.path(rank.file)}: {printable(local)} is a "
                                          f"{printable(value.subclass)}, not a plain tensor")
                placed = _place(local, rank, chunk_number, run)
                if placed is None:
                    continue
                key, prefix = placed
                if dtypes.setdefault(key, value.dtype.name) != value.dtype.name:
                    raise CheckpointError(f"{files.path(rank.file)}: {printable(local)} is {value.dtype.name}, "
                                          f"other ranks hold {dtypes[key]}")
                for offsets, chunk in _chunks(key, archive.raw_bytes(value), rank, run):
                    pieces.setdefault(key, []).append((prefix + offsets, chunk, rank.file))
    tensors = {key: _tensor(key, dtypes[key], found) for key, found in pieces.items()}
    objects = {key: ObjectInfo((key,), value=value) for key, value in root.items()
               if not key.startswith("model") and not _holds_tensor(value)}
    unread = [key for key, value in root.items() if not key.startswith("model") and _holds_tensor(value)]
    left_out = [f"{', '.join(unread)}: per-rank state (RNG, optimizer) of the legacy files"] if unread else []
    if extra_states:
        left_out.append(f"{extra_states} _extra_state tensors: Transformer Engine's FP8 scaling state, no weights")
    info = {"saved_as": "legacy per-rank files (--ckpt-format torch)", "world_size": len(ranks),
            **run_info(root, where), "left_out": "; ".join(left_out) or None}
    checkpoint = Checkpoint(NAME, files.location, files, dict(sorted(tensors.items())), objects, info)
    checkpoint.validate()
    return checkpoint


def _state(archive: Archive) -> dict:
    state = archive.load()
    if not isinstance(state, dict) or not any(key.startswith("model") for key in state if isinstance(key, str)):
        raise CheckpointError(f"{archive.where}: not a Megatron-LM checkpoint (no model state dict)")
    return state


def _int(args: dict, name: str, default: int | None = 1) -> int | None:
    value = args.get(name)
    return value if type(value) is int and value > 0 else default


def _run(args: dict, where: str) -> Run:
    if not args:
        raise CheckpointError(f"{where}: no args Namespace: the tensor and pipeline sizes of the run are unknown")
    tp, layers = _int(args, "tensor_model_parallel_size"), _int(args, "num_layers", None)
    if layers is None:
        raise CheckpointError(f"{where}: args has no num_layers")
    run = Run(tp=tp, pp=_int(args, "pipeline_model_parallel_size"), ep=_int(args, "expert_model_parallel_size"),
              etp=_int(args, "expert_tensor_parallel_size", tp), vpp=_int(args, "virtual_pipeline_model_parallel_size"),
              layers=layers, experts=_int(args, "num_experts", 0),
              gated=bool(args.get("swiglu") or args.get("gated_linear_unit")),
              tied=args.get("untie_embeddings_and_output_weights") is False,
              first_stage_layers=_int(args, "decoder_first_pipeline_num_layers", None),
              last_stage_layers=_int(args, "decoder_last_pipeline_num_layers", None))
    if layers % (run.pp * run.vpp) and run.first_stage_layers is None and run.last_stage_layers is None:
        raise CheckpointError(f"{where}: {layers} layers do not split evenly over {run.pp * run.vpp} pipeline stages")
    if run.experts and run.experts % run.ep:
        raise CheckpointError(f"{where}: {run.experts} experts do not split over expert parallel size {run.ep}")
    return run


def _rank(name: str, run: Run) -> Rank:
    """The ranks a file's folder names: ``mp_rank_TT[_PPP][_EEE]`` (PPP when PP > 1, EEE when EP > 1)."""
    tp, second, third = LEGACY_RANK.fullmatch(name).groups()
    if third is not None:
        pp, ep = int(second), int(third)
    elif second is None:
        pp = ep = 0
    elif run.pp > 1:
        pp, ep = int(second), 0
    else:
        pp, ep = 0, int(second)
    if int(tp) >= run.tp or pp >= run.pp or ep >= run.ep:
        raise CheckpointError(f"{name}: a rank outside the run's TP {run.tp}, PP {run.pp}, EP {run.ep}")
    return Rank(int(tp), pp, ep, name)


def _models(state: dict, run: Run, where: str):
    """``(model chunk number, state dict)`` of a rank: ``model`` or, with virtual pipeline stages, ``model0``..."""
    names = ["model"] if run.vpp == 1 else [f"model{i}" for i in range(run.vpp)]
    for number, name in enumerate(names):
        model = state.get(name)
        if not isinstance(model, dict):
            raise CheckpointError(f"{where}: no {name} state dict")
        yield number, model


def _place(local: str, rank: Rank, chunk_number: int, run: Run) -> tuple[str, tuple[int, ...]] | None:
    """A rank's parameter as torch_dist names it and the offsets of its prepended dims (layer, expert), or None
    for a copy another rank's file gives (replicas over EP ranks; the tied output layer of the last stage)."""
    if not local.startswith(LAYERS):
        if rank.ep or (run.tied and local.startswith("output_layer.")):
            return None
        return local, ()
    number, _, rest = local[len(LAYERS):].partition(".")
    if not number.isdigit():
        raise CheckpointError(f"{printable(local)}: not a per-layer name (decoder.layers.N....)")
    layer = run.layer_offset(rank.pp, chunk_number) + int(number)
    for saved, fused in LOCAL_SPEC_NAMES.items():
        if rest.startswith(saved):
            rest = fused + rest[len(saved):]
    grouped = GROUPED_EXPERTS.match(rest)
    if grouped:
        rest = f"{LOCAL_EXPERTS}{grouped[3]}.{grouped[1]}.{grouped[2]}"
    elif rest.startswith("mlp.experts.") and not rest.startswith(LOCAL_EXPERTS):
        raise CheckpointError(f"{printable(local)}: experts of legacy files kept neither as SequentialMLP's "
                              "local_experts.{j} nor as Transformer Engine's GroupedMLP linear_fc1.weight{j}; "
                              "save the run as torch_dist (--ckpt-format torch_dist)")
    if rest.startswith(LOCAL_EXPERTS):
        expert, _, name = rest[len(LOCAL_EXPERTS):].partition(".")
        per_rank = run.experts // run.ep
        return LAYERS + STACKED_EXPERTS + name, (layer, rank.ep * per_rank + int(expert))
    if rank.ep:
        return None
    return LAYERS + rest, (layer,)


def _chunks(key: str, raw: RawBytes, rank: Rank, run: Run):
    """The chunks of one rank's piece, with their offsets in the joined tensor (less the prepended dims)."""
    shape, strides = raw.shape, raw.strides
    tp_size = run.etp if STACKED_EXPERTS in key else run.tp
    tp = rank.tp
    if tp_size == 1 or not key.endswith(COLUMN_PARALLEL + ROW_PARALLEL):
        if tp == 0:  # replicated over the tensor-parallel ranks: rank 0's copy
            yield tuple(0 for _ in shape), _chunk(raw, 0, shape)
        return
    if key.endswith(ROW_PARALLEL):
        yield (0, tp * shape[1], *([0] * (len(shape) - 2))), _chunk(raw, 0, shape)
    elif key.endswith(GATED) and run.gated:
        half = shape[0] // 2
        for part in range(2):  # [gate_r; up_r] -> rows r of gate_full and of up_full
            start = part * tp_size * half + tp * half
            yield (start, *([0] * (len(shape) - 1))), _chunk(raw, part * half * strides[0], (half, *shape[1:]))
    else:
        yield (tp * shape[0], *([0] * (len(shape) - 1))), _chunk(raw, 0, shape)


def _chunk(raw: RawBytes, skip: int, sizes: tuple[int, ...]) -> Chunk:
    part = RawBytes(raw.file, raw.offset + skip * raw.itemsize, tuple(sizes), raw.strides, raw.itemsize)
    return Chunk((), tuple(sizes), raw.file, part.offset, part.span, "raw", raw.strides)


def _tensor(key: str, dtype: str, found: list[tuple[tuple, Chunk, str]]) -> TensorInfo:
    """The joined tensor: its chunks with the prepended dims (size 1 each) in front of their own."""
    chunks = []
    for offsets, chunk, _ in found:
        extra = len(offsets) - len(chunk.sizes)
        strides = (math.prod(chunk.sizes) or 1,) * extra + tuple(chunk.strides)
        chunks.append(Chunk(tuple(offsets), (1,) * extra + chunk.sizes, chunk.file, chunk.offset, chunk.length,
                            "raw", strides))
    ndim = len(chunks[0].offsets)
    if any(len(c.offsets) != ndim for c in chunks):
        raise CheckpointError(f"{printable(key)}: ranks hold it with different numbers of dims")
    shape = tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(ndim))
    return TensorInfo((key,), dtype, shape, chunks)


def _holds_tensor(value, depth: int = 0) -> bool:
    if isinstance(value, TensorRef):
        return True
    if depth > 6:
        return False
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, Record):
        return any(_holds_tensor(v, depth + 1) for v in vars(value).values())
    return False
