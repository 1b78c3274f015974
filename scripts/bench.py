#!/usr/bin/env python
"""Benchmark dcptool against the routes users take today, on synthetic LLM checkpoints.

What it does, per checkpoint size:

1. Saves a synthetic bf16 checkpoint shaped like a real LLM with a REAL multi-process
   gloo job under torchrun (default 4 processes on the mesh dp=2 x tp=2): FSDP2
   ``fully_shard`` per layer plus TP ``parallelize_module``, then ``dcp.save`` of the
   model state dict (model weights only: no optimizer state, to keep the setup quick).
   ``--model dense`` (default) uses Hugging Face Llama names (embed_tokens, q/k/v/o_proj,
   gate/up/down_proj, RMSNorm weights, lm_head); ``--model moe`` is Qwen3-MoE-like in AReaL
   Archon / torchtitan names: a dense first layer (feed_forward.w1/w2/w3), then layers with a
   router, routed experts grouped as ``[experts, out, in]`` (TP'd along their hidden dim, FSDP
   on dim 0) and the f32 ``expert_bias`` buffer; no shared expert (Qwen3-MoE has none).
   Hidden size and layer count are chosen to hit ``--size``.
   With ``--model dense`` the same job also saves a ``moe`` checkpoint of the same target size
   for the ``export-hf-moe`` row, and a small checkpoint of about ``--inspect-tensors``
   tensors for the ``inspect`` row.
2. Runs every row below as a separate process, ``--rounds`` times, the order of the rows
   reversed on every other round, and reports the median and range of the wall time and
   of the peak memory of the whole process tree (RSS of the process and all of its
   descendants summed, sampled every 20 ms from /proc, and never below the largest
   single process's max RSS from wait4).  Every input is read once right before each
   run, so all runs are warm-cache runs (dropping the page cache needs root).

Rows (id: what runs; the peer is the route users take today for the same job):

  cp                   cp -r of the checkpoint folder: the floor
  cp-sync              cp -r && sync: the floor of a copy that is on disk when it returns, as dcptool's
                       are unless --no-fsync (issue 12's target: copy commands within 1.25x of it)
  export-hf            dcptool export-hf SRC DST                 peer: peer-export-hf
  export-hf-moe        dcptool export-hf MOE_SRC DST             peer: export-hf
                       (Archon names, grouped experts -> HF names, one tensor per expert,
                       as views of the source's chunks; the dense export of the same size
                       is its yardstick; --model dense only: with --model moe every row
                       already runs on a MoE checkpoint)
  convert-torch        dcptool convert SRC DST --to torch        peer: peer-torch-save
  reshard-dp4          dcptool reshard SRC DST --dp 4 --tp 1     peer: peer-reshard-dp4
  reshard-tp4          dcptool reshard SRC DST --dp 1 --tp 4     peer: peer-reshard-tp4
  *-nofsync            export-hf, convert-torch and the reshards with --no-fsync (the cost
                       of durability)
  import-hf            dcptool import-hf HF DST --dp 2 --tp 2    peer: none (HF export -> DCP on a mesh)
  verify               dcptool verify SRC HF --prefix-a auto     peer: peer-verify
                       (the checkpoint against its own HF export, made before timing;
                       --model moe: an export that keeps the Archon names, --adapter hf)
  checksum             dcptool checksum SRC --write --manifest F peer: sha256sum
  inspect              dcptool inspect SMALL (~2,000 tensors)    peer: peer-inspect
  peer-torch-save      torch.distributed.checkpoint.format_utils.dcp_to_torch_save
  peer-export-hf       the in-memory half of dcp_to_torch_save (_load_state_dict with
                       _EmptyStateDictLoadPlanner, no_dist=True: what conversion scripts
                       write to load a DCP without a process group), then
                       safetensors.torch.save_file
  peer-reshard-dp4/tp4 a 4-process torchrun job that builds the model on the new mesh
                       (meta device, to_empty), dcp.load's the checkpoint into it and
                       dcp.save's it
  peer-verify          the same full load, safetensors.torch.load_file, torch.equal per key
  sha256sum            sha256sum of the checkpoint's files
  peer-inspect         FileSystemReader(SRC).read_metadata(), printing every key

Reader rows (issue 13; --model dense), each on its own source of about --size on disk, timed
against cp -r of that folder (cp-hf-dcp, cp-zstd, ...; ratios are plain time ratios):

  export-hf-hf-dcp     export-hf of HuggingFaceStorageWriter(save_distributed=True) shards, saved
                       by the gloo job              peer: peer-consolidate (consolidate_safetensors_files)
  convert-torch-zstd   convert --to torch of dcp.save with the ZStandard extension, saved by the
                       gloo job                     peer: peer-torch-save-zstd (dcp_to_torch_save)
  export-hf-accelerate export-hf of checkpoint-500/ (pytorch_model_fsdp_0 = dcp.save({"model": ...})
                       as accelerate's save_fsdp_model, config.json) peer: peer-accelerate-merge
                       (accelerate's merge_fsdp_weights, what `accelerate merge-weights` runs)
  reshard-verl-w4      reshard --dp 4 --to fsdp1 of verl files at W=2 with AdamW state (the gloo
                       job's model + optimizer DCP converted by dcptool --to fsdp1) peer: none
  dequantize-fp8       convert --to hf --dequantize of float8_e4m3fn projections with
                       weight_scale_inv per 128 x 128 block (written by ``_fp8``)
                                                    peer: peer-dequantize (w.float() * scale, bf16)

Output (``--out``, default bench-out/): results.json (every row at every size: times,
peak memory, ratios to cp -r and to the peer per tensor byte of the checkpoint each row reads
(plain time ratios but for export-hf-moe), machine info, targets), results.md
(the table) and bench.png (time and peak memory; peak memory against size with --sizes).
The chart needs matplotlib: ``pip install -e '.[bench]'``; without it everything else is
still written and a message says so.

Examples::

    .venv/bin/python scripts/bench.py                       # 2GB, dp=2 x tp=2, 3 rounds
    .venv/bin/python scripts/bench.py --sizes 0.5GB,1GB,2GB,4GB --only 'cp|export-hf$|convert|reshard-dp4$'
    .venv/bin/python scripts/bench.py --size 4MB --rounds 1 --out /tmp/b   # smoke test (CI)
    .venv/bin/python scripts/bench.py --ranks 256,1024,4096 --rounds 1       # scale rows (scale.md)

``--ranks N,...`` runs only the scale rows, on checkpoints written by ``scripts/synth_dcp.py`` as N
ranks of FSDP2 save them (``--scale-layers`` layers of narrow tensors, so every rank holds a chunk of
every tensor: 1,024 ranks x 80 layers is ~740k chunks, a 94 MB ``.metadata``): ``inspect``,
``reshard --dp 8``, ``export-hf`` and ``verify`` beside torch's ``read_metadata`` and
``dcp_to_torch_save`` of the same files, time and peak memory against N in scale.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
SAMPLE_S = 0.02  # RSS sampling period

# Targets of issue 5 (on a 2 GB checkpoint on the 2-core CI machine).
TARGET_RATIO_TO_CP = 2.0
TARGET_RATIO_TO_DURABLE = 1.25  # issue 12: copy commands (with fsync) against cp -r && sync
TARGET_PEAK_MB = 512
TARGET_INSPECT_S = 1.0
TARGET_MOE_RATIO = 1.10  # export-hf of an Archon MoE checkpoint against the dense one, per tensor byte
FP8_BLOCK = 128  # the block of the FP8 source's weight_scale_inv, as DeepSeek-V3 and Qwen3-FP8 ship it


def parse_size(text: str) -> int:
    """``2GB`` (10**9), ``512MB``, ``1GiB`` (2**30) or a number of bytes: dcptool's own size rule."""
    from dcptool.storage import parse_size as parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human(n: float) -> str:
    for unit, div in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n)}B"


# ---------------------------------------------------------------------------
# Model shapes
# ---------------------------------------------------------------------------

HIDDEN_LADDER = (64, 128, 256, 512, 1024, 2048, 4096)


def round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)


@dataclass
class Shape:
    """A Llama-like (dense, HF names) or Qwen3-MoE-like (moe, AReaL Archon / torchtitan names) transformer;
    every TP-split dim divisible by 4.

    moe: the first ``dense_layers`` layers have a dense FFN (``feed_forward.w1/w2/w3``); the others a
    router (``moe.router.gate``), routed experts grouped as ``[experts, out, in]`` (``moe.experts.w1/w2/w3``)
    and the load-balancing ``moe.expert_bias`` buffer (f32), and no shared expert: Qwen3-MoE has none,
    so ``dcptool export-hf`` maps every name to Hugging Face's (``expert_bias`` is left out with a note).
    """

    model: str
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 1  # moe: the first layers have a dense FFN

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(key, shape, dtype) of every state-dict entry, in the names the saving job uses."""
        H, V, I, kv = self.hidden, self.vocab, self.intermediate, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...], str]] = []
        if self.model == "dense":
            out.append(("model.embed_tokens.weight", (V, H), "bf16"))
            for i in range(self.layers):
                p = f"model.layers.{i}."
                out += [(p + "self_attn.q_proj.weight", (H, H), "bf16"),
                        (p + "self_attn.k_proj.weight", (kv, H), "bf16"),
                        (p + "self_attn.v_proj.weight", (kv, H), "bf16"),
                        (p + "self_attn.o_proj.weight", (H, H), "bf16"),
                        (p + "mlp.gate_proj.weight", (I, H), "bf16"),
                        (p + "mlp.up_proj.weight", (I, H), "bf16"),
                        (p + "mlp.down_proj.weight", (H, I), "bf16"),
                        (p + "input_layernorm.weight", (H,), "bf16"),
                        (p + "post_attention_layernorm.weight", (H,), "bf16")]
            out += [("model.norm.weight", (H,), "bf16"), ("lm_head.weight", (V, H), "bf16")]
            return out
        E, M = self.experts, self.moe_intermediate
        out.append(("tok_embeddings.weight", (V, H), "bf16"))
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "attention.wq.weight", (H, H), "bf16"),
                    (p + "attention.wk.weight", (kv, H), "bf16"),
                    (p + "attention.wv.weight", (kv, H), "bf16"),
                    (p + "attention.wo.weight", (H, H), "bf16"),
                    (p + "attention_norm.weight", (H,), "bf16"),
                    (p + "ffn_norm.weight", (H,), "bf16")]
            if i < self.dense_layers:
                out += [(p + "feed_forward.w1.weight", (I, H), "bf16"),
                        (p + "feed_forward.w2.weight", (H, I), "bf16"),
                        (p + "feed_forward.w3.weight", (I, H), "bf16")]
            else:
                out += [(p + "moe.router.gate.weight", (E, H), "bf16"),
                        (p + "moe.experts.w1", (E, M, H), "bf16"),
                        (p + "moe.experts.w2", (E, H, M), "bf16"),
                        (p + "moe.experts.w3", (E, M, H), "bf16"),
                        (p + "moe.expert_bias", (E,), "f32")]
        out += [("norm.weight", (H,), "bf16"), ("output.weight", (V, H), "bf16")]
        return out

    def nbytes(self) -> int:
        return sum(math.prod(s) * (4 if d == "f32" else 2) for _, s, d in self.tensors())

    def describe(self) -> str:
        text = (f"{self.model}: {self.layers} layers, hidden {self.hidden}, intermediate "
                f"{self.intermediate}, vocab {self.vocab}, heads {self.heads}/{self.kv_heads} kv")
        if self.model == "moe":
            text += (f", {self.experts} experts of {self.moe_intermediate} (no shared expert), "
                     f"{self.dense_layers} dense layer")
        return text + f"; {len(self.tensors())} tensors, {human(self.nbytes())} bf16"


def make_shape(model: str, hidden: int, layers: int) -> Shape:
    heads = max(4, hidden // 64)
    return Shape(model=model, hidden=hidden, layers=layers,
                 vocab=round_up(min(32000, 16 * hidden), 64),
                 intermediate=round_up(8 * hidden / 3, 64), heads=heads,
                 kv_heads=max(4, heads // 4),
                 experts=8 if model == "moe" else 0,
                 moe_intermediate=round_up(4 * hidden / 3, 64) if model == "moe" else 0)


def choose_shape(model: str, target: int, max_hidden: int = 2048) -> Shape:
    """The widest model (hidden <= max_hidden) with at least 2 layers near ``target`` bytes."""
    best = None
    for hidden in HIDDEN_LADDER:
        if hidden > max_hidden:
            break
        base = make_shape(model, hidden, 2).nbytes()
        per_layer = make_shape(model, hidden, 3).nbytes() - base
        layers = 2 + round((target - base) / per_layer)
        if layers >= 2 or best is None:
            best = make_shape(model, hidden, max(2, layers))
    return best


def inspect_shape(tensors: int) -> Shape:
    """A tiny dense model with about ``tensors`` tensors (9 per layer + 3)."""
    return make_shape("dense", 64, max(1, round((tensors - 3) / 9)))


# ---------------------------------------------------------------------------
# Worker side (torch imported only here): the saving job, the reshard peer, the peers
# ---------------------------------------------------------------------------


def _build_model(shape: Shape, dp: int, tp: int):
    """The model on the meta device, TP'd and FSDP2-sharded on (dp, tp), then materialized empty."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    def linear(i, o):
        return nn.Linear(i, o, bias=False)

    def container(**children):
        m = nn.Module()
        for k, v in children.items():
            setattr(m, k, v)
        return m

    H, V, I, kv = shape.hidden, shape.vocab, shape.intermediate, shape.kv_heads * shape.head_dim
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        if shape.model == "dense":
            layers = nn.ModuleList(container(
                self_attn=container(q_proj=linear(H, H), k_proj=linear(H, kv), v_proj=linear(H, kv),
                                    o_proj=linear(H, H)),
                mlp=container(gate_proj=linear(H, I), up_proj=linear(H, I), down_proj=linear(I, H)),
                input_layernorm=nn.RMSNorm(H), post_attention_layernorm=nn.RMSNorm(H),
            ) for _ in range(shape.layers))
            model = container(model=container(embed_tokens=nn.Embedding(V, H), layers=layers,
                                               norm=nn.RMSNorm(H)),
                              lm_head=linear(H, V))
            blocks = list(layers)
        else:
            E, M = shape.experts, shape.moe_intermediate
            blocks = []
            for i in range(shape.layers):
                block = container(attention=container(wq=linear(H, H), wk=linear(H, kv), wv=linear(H, kv),
                                                      wo=linear(H, H)),
                                  attention_norm=nn.RMSNorm(H), ffn_norm=nn.RMSNorm(H))
                if i < shape.dense_layers:
                    block.feed_forward = container(w1=linear(H, I), w2=linear(I, H), w3=linear(H, I))
                else:
                    experts = container(w1=nn.Parameter(torch.empty(E, M, H)),
                                        w2=nn.Parameter(torch.empty(E, H, M)),
                                        w3=nn.Parameter(torch.empty(E, M, H)))
                    block.moe = container(router=container(gate=linear(H, E)), experts=experts)
                    block.moe.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
                blocks.append(block)
            model = container(tok_embeddings=nn.Embedding(V, H),
                              layers=nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}),
                              norm=nn.RMSNorm(H), output=linear(H, V))
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    if tp > 1:
        tp_mesh = mesh["tp"]
        if shape.model == "dense":
            parallelize_module(model, tp_mesh, {
                "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())})
            plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel()}
            for block in blocks:
                parallelize_module(block, tp_mesh, plan)
        else:
            parallelize_module(model, tp_mesh, {
                "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "norm": SequenceParallel(), "output": ColwiseParallel()})
            for i, block in enumerate(blocks):
                plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                        "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                        "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
                if i < shape.dense_layers:  # the dense FFN; MoE layers: router replicated, experts below
                    plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                                 "feed_forward.w3": ColwiseParallel()})
                parallelize_module(block, tp_mesh, plan)
                if i >= shape.dense_layers:
                    distribute_module(block.moe.router.gate, tp_mesh)
                    experts = block.moe.experts
                    for name, dim in (("w1", 1), ("w2", 2), ("w3", 1)):
                        weight = distribute_tensor(getattr(experts, name).detach(), tp_mesh, [Shard(dim)])
                        experts.register_parameter(name, nn.Parameter(weight))
    if dp > 1:
        for block in blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    return model


def _fill(model, seed: int) -> None:
    """Random bf16 weights (uniform, cheap), norms 1, buffers 0; only the local shards are touched."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.uniform_(-0.05, 0.05, generator=gen)
        for _, b in model.named_buffers():
            b.zero_()


def _worker_init():
    import torch
    import torch.distributed as dist
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return dist


def _worker_exit(dist) -> None:
    """Leave without interpreter finalization: gloo's threads now and then abort a rank there
    ("terminate called without an active exception") after all the work is done."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_save(argv: list[str]) -> int:
    """``_save OUT SHAPE_JSON [OUT SHAPE_JSON ...] --dp N --tp N`` under torchrun. A shape's ``layout`` key
    says what is saved: ``model`` (default: dcp.save of the model), ``hf-dcp`` (HuggingFaceStorageWriter),
    ``zstd`` (FileSystemWriter with the ZStandard extension), ``accelerate`` (a Trainer's checkpoint-N
    folder) or ``optim`` (model and AdamW state)."""
    p = argparse.ArgumentParser(prog="bench.py _save")
    p.add_argument("pairs", nargs="+", help="OUT SHAPE_JSON pairs")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args(argv)
    dist = _worker_init()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for out, spec in zip(args.pairs[::2], args.pairs[1::2]):
        t0 = time.perf_counter()
        spec = json.loads(spec)
        layout = spec.pop("layout", "model")
        shape = Shape(**spec)
        model = _build_model(shape, args.dp, args.tp)
        _fill(model, seed=1000 + dist.get_rank())
        t1 = time.perf_counter()
        if layout == "model":
            dcp.save(get_model_state_dict(model), checkpoint_id=out)
        elif layout == "hf-dcp":  # torch's HF-storage DCP, unconsolidated (every rank writes its chunks)
            from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

            dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        elif layout == "zstd":  # dcp.save with torch's zstd extension on every record
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint._extension import ZStandard

            dcp.save(get_model_state_dict(model), storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]))
        elif layout == "accelerate":  # what accelerate's save_fsdp_model writes under SHARDED_STATE_DICT
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{out}/pytorch_model_fsdp_0")
            if dist.get_rank() == 0:
                (Path(out) / "config.json").write_text(json.dumps(llama_config(shape), indent=1))
                (Path(out) / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
        else:  # "optim": torchtitan's layout, model keys at the top and the AdamW state flattened under optimizer
            dcp.save(_with_adamw_state(model), checkpoint_id=out)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"saved {out}: build {t1 - t0:.1f}s, dcp.save {time.perf_counter() - t1:.1f}s", flush=True)
        del model
    _worker_exit(dist)


def llama_config(shape: Shape) -> dict:
    """The Hugging Face config.json of a dense shape (export-hf checks it against the tensors)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16"}


def _with_adamw_state(model) -> dict:
    """Model and AdamW state after one step on zero gradients (moments exist, in the parameters' bf16)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**model_sd, "optimizer": optim_sd}


def make_fp8(out: str, spec: str) -> int:
    """``_fp8 OUT SHAPE_JSON``: a dense shape as DeepSeek-V3 / Qwen3-FP8 ship it: every 2-D projection
    ``float8_e4m3fn`` with a ``weight_scale_inv`` per 128 x 128 block (f32), embeddings, norms and the
    head bf16, files of up to 1 GB, an index and a config.json with ``quantization_config``."""
    import torch
    from safetensors.torch import save_file

    shape = Shape(**json.loads(spec))
    folder = Path(out)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(7)
    files: list[dict] = [{}]
    weight_map, sizes = {}, [0]
    for name, dims, _ in shape.tensors():
        if len(dims) == 2 and "_proj." in name:  # what the FP8 releases quantize
            w = (torch.rand(dims, generator=gen) * 2 - 1).to(torch.float8_e4m3fn)
            blocks = (math.ceil(dims[0] / FP8_BLOCK), math.ceil(dims[1] / FP8_BLOCK))
            scale = torch.rand(blocks, generator=gen) * 1e-3 + 1e-4
            entries = {name: w, name + "_scale_inv": scale}
        else:
            entries = {name: torch.ones(dims, dtype=torch.bfloat16) if "norm" in name
                       else (torch.rand(dims, generator=gen) * 0.1 - 0.05).to(torch.bfloat16)}
        nbytes = sum(t.nbytes for t in entries.values())
        if sizes[-1] and sizes[-1] + nbytes > 10**9:
            files.append({})
            sizes.append(0)
        files[-1].update(entries)
        sizes[-1] += nbytes
    for i, tensors in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = llama_config(shape) | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                            "activation_scheme": "dynamic",
                                                            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return 0


def worker_reshard(argv: list[str]) -> int:
    """The peer of ``dcptool reshard``: ``_reshard SRC DST SHAPE_JSON --dp N --tp N`` under torchrun."""
    p = argparse.ArgumentParser(prog="bench.py _reshard")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("shape")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args(argv)
    dist = _worker_init()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _build_model(Shape(**json.loads(args.shape)), args.dp, args.tp)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=args.src)
    dcp.save(state, checkpoint_id=args.dst)
    _worker_exit(dist)


def _full_load(src: str) -> dict:
    """A DCP checkpoint as one in-memory state dict, without a process group (as dcp_to_torch_save does)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


def _flat_tensors(state: dict, prefix: str = "") -> dict:
    import torch

    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_tensors(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = v
    return out


def peer(argv: list[str]) -> int:
    """``_peer {torch-save,export-hf,verify,consolidate,accelerate-merge,dequantize,inspect} SRC [DST]``: the
    routes users take today."""
    kind, src, *rest = argv
    if kind == "torch-save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, rest[0])
    elif kind == "export-hf":
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in _flat_tensors(_full_load(src)).items()}
        Path(rest[0]).mkdir(parents=True)
        save_file(tensors, str(Path(rest[0]) / "model.safetensors"), metadata={"format": "pt"})
    elif kind == "verify":
        import torch
        from safetensors.torch import load_file

        a = _flat_tensors(_full_load(src))
        b = {}
        for f in sorted(Path(rest[0]).glob("*.safetensors")):
            b.update(load_file(str(f)))
        bad = sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
        print(f"{len(a)} tensors compared, {len(bad)} differ")
        return 1 if bad else 0
    elif kind == "consolidate":  # torch's own consolidation of HuggingFaceStorageWriter's sharded files
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        keys = set()
        for f in Path(src).glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                keys.update(fh.keys())
        Path(rest[0]).mkdir(parents=True)  # it writes into an existing folder
        consolidate_safetensors_files(src, rest[0], dict.fromkeys(sorted(keys), 1))
    elif kind == "accelerate-merge":  # what `accelerate merge-weights` runs
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(Path(src) / "pytorch_model_fsdp_0"), rest[0], safe_serialization=True)
    elif kind == "dequantize":  # the loop users write: w.float() * scale per block, to bf16, file by file
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file

        Path(rest[0]).mkdir(parents=True)
        block = json.loads((Path(src) / "config.json").read_text())["quantization_config"]["weight_block_size"]
        for f in sorted(Path(src).glob("*.safetensors")):
            out = {}
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    if key.endswith("_scale_inv"):
                        continue
                    w = fh.get_tensor(key)
                    if w.dtype == torch.float8_e4m3fn:
                        scale = fh.get_tensor(key + "_scale_inv")
                        scale = scale.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)
                        w = w.float() * scale[:, :w.shape[1]]
                    out[key] = w.to(torch.bfloat16)
            save_file(out, str(Path(rest[0]) / f.name), metadata={"format": "pt"})
    elif kind == "inspect":
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(src).read_metadata()
        for key, md in meta.state_dict_metadata.items():
            props = getattr(md, "properties", None)
            print(key, getattr(props, "dtype", ""), list(getattr(md, "size", [])), len(getattr(md, "chunks", [])))
    else:
        raise SystemExit(f"unknown peer {kind}")
    return 0


# ---------------------------------------------------------------------------
# Measuring a process tree
# ---------------------------------------------------------------------------

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return 0


def tree_rss(root: int) -> int:
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _rss(pid)
        todo += _children(pid)
    return total


class Sampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self.done.wait(SAMPLE_S)


def measure(argv: list[str], log: Path, timeout: float) -> tuple[float, float, int, int]:
    """Run argv; return (wall seconds, CPU seconds of the tree, peak tree RSS bytes, exit code)."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, 9))
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        killer.cancel()
        sampler.done.set()
        sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime  # the child and every descendant it waited for
    return wall, cpu, max(sampler.peak, usage.ru_maxrss * 1024), proc.returncode


def warm(paths: list[Path]) -> None:
    """Read every file once so that the timed run finds it in the page cache."""
    buf = bytearray(8 << 20)
    for path in paths:
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------


@dataclass
class Row:
    id: str
    name: str
    kind: str           # floor | dcptool | peer
    peer: str           # id of the peer row (itself for peers and the floor)
    argv: list[str]
    output: Path | None
    inputs: list[Path]
    times: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    failures: int = 0
    peaks: list[int] = field(default_factory=list)
    source: dict | None = None  # the checkpoint it reads when not the size's main one (export-hf-moe, readers)
    floor: str = "cp"  # id of the cp -r row of the folder it reads


def make_rows(src: Path, hf: Path, small: Path | None, shape: Shape, outdir: Path, small_tensors: int = 0,
              moe: tuple[Path, dict] | None = None) -> list[Row]:
    """Every row; ``moe``: (folder, size info) of the MoE checkpoint saved beside a dense one, for export-hf-moe."""
    py = sys.executable
    dcptool = [py, "-m", "dcptool"]
    shape_json = json.dumps(asdict(shape))
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT)]
    rows = [Row("cp", "cp -r", "floor", "cp", ["cp", "-r", str(src), str(outdir / "cp")], outdir / "cp", [src]),
            # What dcptool's commands promise by default: the copy is on disk when the command returns.
            Row("cp-sync", "cp -r && sync", "floor", "cp-sync",
                ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(outdir / "cp-sync")], outdir / "cp-sync", [src]),
            Row("import-hf", "dcptool import-hf --dp 2 --tp 2 (HF -> DCP)", "dcptool", "",
                dcptool + ["import-hf", str(hf), str(outdir / "imported"), "--dp", "2", "--tp", "2"],
                outdir / "imported", [hf])]
    for fsync in ("", "-nofsync"):
        extra = ["--no-fsync"] if fsync else []
        label = " --no-fsync" if fsync else ""
        rows += [
            Row(f"export-hf{fsync}", f"dcptool export-hf{label}", "dcptool", "peer-export-hf",
                dcptool + ["export-hf", str(src), str(outdir / f"hf{fsync}")] + extra, outdir / f"hf{fsync}", [src]),
            Row(f"convert-torch{fsync}", f"dcptool convert --to torch{label}", "dcptool", "peer-torch-save",
                dcptool + ["convert", str(src), str(outdir / f"model{fsync}.pt"), "--to", "torch"] + extra,
                outdir / f"model{fsync}.pt", [src]),
            Row(f"reshard-dp4{fsync}", f"dcptool reshard --dp 4 --tp 1{label}", "dcptool", "peer-reshard-dp4",
                dcptool + ["reshard", str(src), str(outdir / f"dp4{fsync}"), "--dp", "4", "--tp", "1"] + extra,
                outdir / f"dp4{fsync}", [src]),
            Row(f"reshard-tp4{fsync}", f"dcptool reshard --dp 1 --tp 4{label}", "dcptool", "peer-reshard-tp4",
                dcptool + ["reshard", str(src), str(outdir / f"tp4{fsync}"), "--dp", "1", "--tp", "4"] + extra,
                outdir / f"tp4{fsync}", [src]),
        ]
    if moe is not None:
        moe_src, moe_info = moe
        rows.append(Row("export-hf-moe", "dcptool export-hf (Archon MoE -> HF per-expert)", "dcptool", "export-hf",
                        dcptool + ["export-hf", str(moe_src), str(outdir / "hf-moe")], outdir / "hf-moe", [moe_src],
                        source=moe_info))
    manifest = outdir / "manifest.json"
    rows += [
        Row("verify", "dcptool verify (DCP vs its HF export)", "dcptool", "peer-verify",
            dcptool + ["verify", str(src), str(hf), "--prefix-a", "auto"], None, [src, hf]),
        Row("checksum", "dcptool checksum --write", "dcptool", "sha256sum",
            dcptool + ["checksum", str(src), "--write", "--manifest", str(manifest)], manifest, [src]),
        Row("peer-torch-save", "torch format_utils.dcp_to_torch_save", "peer", "peer-torch-save",
            [py, str(SCRIPT), "_peer", "torch-save", str(src), str(outdir / "peer.pt")], outdir / "peer.pt", [src]),
        Row("peer-export-hf", "torch DCP full load + safetensors save_file", "peer", "peer-export-hf",
            [py, str(SCRIPT), "_peer", "export-hf", str(src), str(outdir / "peer-hf")], outdir / "peer-hf", [src]),
        Row("peer-reshard-dp4", "torchrun x4 dcp.load + dcp.save (dp=4)", "peer", "peer-reshard-dp4",
            torchrun + ["_reshard", str(src), str(outdir / "peer-dp4"), shape_json, "--dp", "4", "--tp", "1"],
            outdir / "peer-dp4", [src]),
        Row("peer-reshard-tp4", "torchrun x4 dcp.load + dcp.save (tp=4)", "peer", "peer-reshard-tp4",
            torchrun + ["_reshard", str(src), str(outdir / "peer-tp4"), shape_json, "--dp", "1", "--tp", "4"],
            outdir / "peer-tp4", [src]),
        Row("peer-verify", "torch full load + safetensors load_file + torch.equal", "peer", "peer-verify",
            [py, str(SCRIPT), "_peer", "verify", str(src), str(hf)], None, [src, hf]),
        Row("sha256sum", "sha256sum of the files", "peer", "sha256sum",
            ["sha256sum"] + [str(f) for f in sorted(src.iterdir()) if f.is_file()], None, [src]),
    ]
    if small is not None:
        rows += [
            Row("inspect", f"dcptool inspect ({small_tensors:,} tensors)", "dcptool", "peer-inspect",
                dcptool + ["inspect", str(small)], None, [small]),
            Row("peer-inspect", f"torch FileSystemReader.read_metadata ({small_tensors:,} tensors)", "peer",
                "peer-inspect",
                [py, str(SCRIPT), "_peer", "inspect", str(small)], None, [small]),
        ]
    # Each dcptool row next to its peer (in the table, the chart and the order of a round).
    order = ["cp", "cp-sync", "export-hf", "export-hf-moe", "export-hf-nofsync", "peer-export-hf", "convert-torch",
             "convert-torch-nofsync", "peer-torch-save", "reshard-dp4", "reshard-dp4-nofsync", "peer-reshard-dp4",
             "reshard-tp4", "reshard-tp4-nofsync", "peer-reshard-tp4", "import-hf", "verify", "peer-verify", "checksum",
             "sha256sum", "inspect", "peer-inspect"]
    return sorted(rows, key=lambda r: order.index(r.id))


# The readers of issue 13, each on its own source folder (made by reader_sources) beside the cp -r of that
# folder: (reader, floor id, dcptool row id, name, dcptool arguments, peer id, peer name, peer argv after
# ``bench.py _peer``). {src} is the source folder, {out} the output; an empty peer id: no peer exists.
READER_ROWS = [
    ("hf-dcp", "cp-hf-dcp", "export-hf-hf-dcp", "dcptool export-hf (torch HF-storage DCP)",
     ["export-hf", "{src}", "{out}"], "peer-consolidate", "torch consolidate_safetensors_files",
     ["consolidate", "{src}", "{out}"]),
    ("zstd", "cp-zstd", "convert-torch-zstd", "dcptool convert --to torch (zstd DCP)",
     ["convert", "{src}", "{out}.pt", "--to", "torch"], "peer-torch-save-zstd",
     "torch format_utils.dcp_to_torch_save (zstd DCP)", ["torch-save", "{src}", "{out}.pt"]),
    ("accelerate", "cp-accelerate", "export-hf-accelerate", "dcptool export-hf (accelerate checkpoint-N)",
     ["export-hf", "{src}", "{out}"], "peer-accelerate-merge", "accelerate merge_fsdp_weights (merge-weights)",
     ["accelerate-merge", "{src}", "{out}"]),
    ("verl", "cp-verl", "reshard-verl-w4", "dcptool reshard --to fsdp1 (verl + optimizer, W=2 -> 4)",
     ["reshard", "{src}", "{out}", "--dp", "4", "--to", "fsdp1"], "", "", []),
    ("fp8", "cp-fp8", "dequantize-fp8", "dcptool convert --dequantize (FP8 blocks -> bf16)",
     ["convert", "{src}", "{out}", "--to", "hf", "--dequantize"], "peer-dequantize",
     "torch loop: w.float() * scale per block -> bf16", ["dequantize", "{src}", "{out}"]),
]


def reader_rows(sources: dict[str, tuple[Path, dict]], outdir: Path) -> list[Row]:
    """Rows of READER_ROWS whose source was made: cp -r of the folder, the dcptool command and its peer."""
    py = sys.executable
    rows = []
    for reader, floor, rid, name, argv, peer_id, peer_name, peer_argv in READER_ROWS:
        if reader not in sources:
            continue
        src, info = sources[reader]

        def fill(args: list[str], out: str) -> list[str]:
            return [a.format(src=src, out=outdir / out) for a in args]

        def output(args: list[str], out: str) -> Path:
            return outdir / (f"{out}.pt" if "{out}.pt" in args else out)

        rows.append(Row(floor, f"cp -r ({reader} source)", "floor", floor,
                        ["cp", "-r", str(src), str(outdir / floor)], outdir / floor, [src], source=info, floor=floor))
        rows.append(Row(rid, name, "dcptool", peer_id, [py, "-m", "dcptool"] + fill(argv, rid),
                        output(argv, rid), [src], source=info, floor=floor))
        if peer_id:
            rows.append(Row(peer_id, peer_name, "peer", peer_id, [py, str(SCRIPT), "_peer"] + fill(peer_argv, peer_id),
                            output(peer_argv, peer_id), [src], source=info, floor=floor))
    return rows


GLOO_LAYOUTS = ("hf-dcp", "zstd", "accelerate")  # reader sources that the saving job writes (worker_save)


def reader_folder(reader: str, tag: str, work: Path) -> Path:
    """Where the source of a reader row lives (accelerate's: a Trainer's ``checkpoint-N`` folder)."""
    return work / (f"accelerate-{tag}/checkpoint-500" if reader == "accelerate" else f"{reader}-{tag}")


def reader_shapes(shape: Shape, target: int, max_hidden: int, only: re.Pattern | None) -> dict[str, Shape]:
    """The shape of each reader source that a wanted row reads, sized like the main checkpoint on disk:
    verl's holds AdamW's two moments beside the weights (a third of the size in weights), FP8's
    projections take 1 byte an element (twice the elements)."""
    shapes = {"hf-dcp": shape, "zstd": shape, "accelerate": shape,
              "verl": choose_shape("dense", target // 3, max_hidden),
              "fp8": choose_shape("dense", 2 * target, max_hidden)}
    return {reader: shapes[reader] for reader, _, rid, *_, peer_id, _, _ in READER_ROWS
            if only is None or only.search(rid) or (peer_id and only.search(peer_id))}


def reader_sources(shapes: dict[str, Shape], tag: str, work: Path, logs: Path) -> dict:
    """The sources of the reader rows (``shapes``: reader_shapes), made once, untimed: ``{reader: (folder, info)}``.

    The gloo job (``save_checkpoints``) saved the hf-dcp, zstd and accelerate ones with torch's own writers
    (GLOO_LAYOUTS); verl's is the job's optimizer checkpoint (layout ``optim``) converted by dcptool
    ``--to fsdp1 --world-size 2`` (the files verl's FSDP1 save writes, less the small extra_state); fp8's
    is written directly (``_fp8``)."""
    made = {}
    for reader, shape in shapes.items():
        folder, spec = reader_folder(reader, tag, work), json.dumps(asdict(shape))
        done = Path(f"{folder}.done")  # holds the shape it was made for
        if reader not in GLOO_LAYOUTS and not (done.is_file() and done.read_text() == spec):
            remove(folder)
            if reader == "verl":
                argv = [sys.executable, "-m", "dcptool", "convert", str(work / f"ckpt-optim-{tag}"), str(folder),
                        "--to", "fsdp1", "--world-size", "2", "--no-fsync"]
            else:
                argv = [sys.executable, str(SCRIPT), "_fp8", str(folder), spec]
            t0 = time.perf_counter()
            log = logs / f"make-{reader}.log"
            with open(log, "wb") as out:
                if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode != 0:
                    sys.exit(f"making the {reader} source failed; see {log}:\n" + tail(log))
            done.write_text(spec)
            print(f"  made the {reader} source {folder.name} in {time.perf_counter() - t0:.1f}s", flush=True)
        size = dir_bytes(folder)
        # Ratios of rows on one source are plain time ratios: its bytes on disk stand for its tensor bytes.
        made[reader] = (folder, {"size_bytes": size, "tensor_bytes": size, "files": len(list(folder.rglob("*"))),
                                 "tensors": len(shape.tensors()), "model": f"{reader}: {shape.describe()}"})
    return made


# ---------------------------------------------------------------------------
# Setup: checkpoints
# ---------------------------------------------------------------------------


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_info(path: Path, shape: Shape) -> dict:
    """Size and shape of a saved checkpoint, as results.json records them."""
    return {"size_bytes": dir_bytes(path), "tensor_bytes": shape.nbytes(), "tensors": len(shape.tensors()),
            "files": len(list(path.iterdir())), "model": shape.describe()}


def save_checkpoints(jobs: list[tuple[Path, Shape]], dp: int, tp: int, logdir: Path,
                     layouts: dict[Path, str] | None = None) -> None:
    """One torchrun job saves every (folder, shape) that is not there yet (a .done marker beside it), as
    ``layouts[folder]`` says (``model`` by default; ``accelerate``, ``optim``: see worker_save)."""
    def spec(path: Path, shape: Shape) -> str:
        layout = (layouts or {}).get(path, "model")
        return json.dumps(asdict(shape) | ({"layout": layout} if layout != "model" else {}))

    todo = [(p, s) for p, s in jobs if not Path(f"{p}.done").is_file()
            or Path(f"{p}.done").read_text() != spec(p, s) + f" dp={dp} tp={tp}"]
    if not todo:
        return
    for path, _ in todo:
        remove(path)
        remove(Path(f"{path}.done"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp),
            str(SCRIPT), "_save"]
    for path, shape in todo:
        argv += [str(path), spec(path, shape)]
    argv += ["--dp", str(dp), "--tp", str(tp)]
    log = logdir / f"save-{todo[0][0].name}.log"
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    if rc != 0:
        sys.exit(f"saving the checkpoints failed (exit {rc}); see {log}:\n" + tail(log))
    for path, shape in todo:
        Path(f"{path}.done").write_text(spec(path, shape) + f" dp={dp} tp={tp}")
    print(f"  saved {', '.join(p.name for p, _ in todo)} with a {dp * tp}-process gloo job "
          f"(dp={dp}, tp={tp}) in {time.perf_counter() - t0:.1f}s", flush=True)


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------


def machine_info() -> dict:
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": list(os.getloadavg())}
    try:
        import importlib.metadata as md
        info["torch"] = md.version("torch")
        info["dcptool"] = md.version("dcptool")
    except Exception:  # noqa: BLE001
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        info["git_commit"] = commit
    except OSError:
        pass
    return info


def summarize(rows: list[Row], size: dict) -> list[dict]:
    """One result per row. The ratios to cp -r and to the peer are of time per tensor byte of the checkpoint
    each row reads: plain time ratios but for export-hf-moe, whose MoE checkpoint is near, not at, the
    dense checkpoint's size."""
    by_id = {r.id: r for r in rows}
    med = {r.id: statistics.median(r.times) for r in rows}
    nbytes = {r.id: (r.source or size)["tensor_bytes"] for r in rows}
    per_byte = {rid: med[rid] / nbytes[rid] for rid in med}
    out = []
    for r in rows:
        peaks_mb = [p / 1e6 for p in r.peaks]
        peer = r.peer if r.peer in med else None  # not run (--only)
        out.append({
            "id": r.id, "name": r.name, "kind": r.kind, "peer": peer, "has_peer": bool(r.peer), "peer_name": by_id[peer].name if peer else None,
            "command": " ".join(r.argv if len(r.argv) < 12 else r.argv[:11] + ["..."]),
            "median_s": med[r.id], "min_s": min(r.times), "max_s": max(r.times), "times_s": r.times,
            "cpu_s": statistics.median(r.cpus), "cpus_s": r.cpus, "failed_runs": r.failures,
            "peak_mb": statistics.median(peaks_mb), "peak_mb_median": statistics.median(peaks_mb),
            "peak_mb_min": min(peaks_mb), "peak_mb_max": max(peaks_mb), "peaks_mb": peaks_mb,
            "floor": r.floor,
            "ratio_to_cp": per_byte[r.id] / per_byte[r.floor] if r.floor in med else float("nan"),
            "ratio_to_durable_cp": per_byte[r.id] / per_byte["cp-sync"] if "cp-sync" in med else None,
            "ratio_to_peer": per_byte[r.id] / per_byte[peer] if peer else None,
            "input_tensor_bytes": nbytes[r.id], "source": r.source,
            **size,
        })
    return out


def table(results: list[dict]) -> str:
    lines = ["| row | time s, median (min-max) | x cp -r | x cp -r && sync | x peer | peak MB, median (min-max) | CPU s "
             "| peer |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | "
            f"{r['ratio_to_cp']:.2f} | "
            f"{'-' if r['ratio_to_durable_cp'] is None or r['floor'] != 'cp' else format(r['ratio_to_durable_cp'], '.2f')} | "
            f"{'-' if r['peer'] is None else format(r['ratio_to_peer'], '.2f')} | "
            f"{r['peak_mb_median']:.0f} ({r['peak_mb_min']:.0f}-{r['peak_mb_max']:.0f}) | {r['cpu_s']:.2f} | "
            f"{'(itself)' if r['peer'] == r['id'] else r['peer_name'] or ('(not run)' if r['has_peer'] else '(none)')} |")
    return "\n".join(lines)


def targets(results: list[dict], main_size: str) -> list[dict]:
    """The targets of issue 5, evaluated on the rows of the main size (and memory over all sizes)."""
    rows = {r["id"]: r for r in results if r["size"] == main_size}
    out = []
    for rid in ("export-hf", "convert-torch", "reshard-dp4", "reshard-tp4"):
        if rid in rows:
            v = rows[rid]["ratio_to_cp"]
            out.append({"target": f"{rid}: wall time <= {TARGET_RATIO_TO_CP}x cp -r", "value": round(v, 2),
                        "met": v <= TARGET_RATIO_TO_CP})
    for rid in ("export-hf", "convert-torch", "reshard-dp4", "reshard-tp4", "import-hf"):
        if rid in rows and rows[rid]["ratio_to_durable_cp"] is not None:
            v = rows[rid]["ratio_to_durable_cp"]
            out.append({"target": f"{rid}: wall time <= {TARGET_RATIO_TO_DURABLE}x cp -r && sync (issue 12)",
                        "value": round(v, 2), "met": v <= TARGET_RATIO_TO_DURABLE})
    if "export-hf-moe" in rows and "export-hf" in rows:
        moe, dense = rows["export-hf-moe"], rows["export-hf"]
        v = (moe["median_s"] / moe["input_tensor_bytes"]) / (dense["median_s"] / dense["input_tensor_bytes"])
        out.append({"target": f"export-hf-moe: time per tensor byte <= {TARGET_MOE_RATIO}x export-hf's "
                              "(Archon grouped experts -> HF per-expert vs dense HF names)",
                    "value": round(v, 3), "met": v <= TARGET_MOE_RATIO})
    for rid, r in rows.items():
        if r["kind"] == "dcptool" and rid != "inspect":
            out.append({"target": f"{rid}: peak memory <= {TARGET_PEAK_MB} MB", "value": round(r["peak_mb"]),
                        "met": r["peak_mb"] <= TARGET_PEAK_MB})
    sizes = sorted({r["size_bytes"] for r in results})
    if len(sizes) > 1:
        for rid in rows:
            series = {r["size_bytes"]: r["peak_mb"] for r in results if r["id"] == rid}
            if rows[rid]["kind"] == "dcptool" and len(series) > 1:
                growth = series[max(series)] / series[min(series)]
                out.append({"target": f"{rid}: peak memory flat ({human(min(series))} -> {human(max(series))})",
                            "value": round(growth, 2), "met": growth <= 1.25})
    if "inspect" in rows:
        v = rows["inspect"]["median_s"]
        out.append({"target": f"inspect of {rows['inspect'].get('inspect_tensors')} tensors < {TARGET_INSPECT_S}s",
                    "value": round(v, 2), "met": v < TARGET_INSPECT_S})
    if "checksum" in rows and "sha256sum" in rows:
        v = rows["checksum"]["median_s"] / rows["sha256sum"]["median_s"]
        out.append({"target": "checksum --write at least as fast as sha256sum (ratio <= 1)", "value": round(v, 2),
                    "met": v <= 1.0})
    return out


COLORS = {"floor": "#888888", "dcptool": "#1f77b4", "peer": "#ff7f0e"}


def chart(results: list[dict], main_size: str, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (install it with: pip install -e '.[bench]')")
        return False
    rows = [r for r in results if r["size"] == main_size]
    sizes = sorted({r["size_bytes"] for r in results})
    panels = 3 if len(sizes) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 0.38 * len(rows) + 2.2))
    names = [r["name"] for r in rows]
    y = list(range(len(rows)))[::-1]
    colors = [COLORS[r["kind"]] for r in rows]
    for ax, key, unit, label in ((axes[0], "s", "s", "wall time"), (axes[1], "mb", "MB", "peak memory (process tree RSS)")):
        if key == "s":
            med = [r["median_s"] for r in rows]
            lo = [r["median_s"] - r["min_s"] for r in rows]
            hi = [r["max_s"] - r["median_s"] for r in rows]
        else:
            med = [r["peak_mb_median"] for r in rows]
            lo = [r["peak_mb_median"] - r["peak_mb_min"] for r in rows]
            hi = [r["peak_mb_max"] - r["peak_mb_median"] for r in rows]
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=2)
        ax.set_yticks(y)
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.set_xlabel(f"{label}, {unit} (median, bars: min-max)")
        for yy, v, h in zip(y, med, hi):  # the median, right of the range bar
            ax.text(v + h, yy, f" {v:.1f}" if key == "s" else f" {v:.0f}", va="center", fontsize=7)
        if key == "s":
            from matplotlib.patches import Patch

            handles = [Patch(color=c, label=k if k != "peer" else "peer (users' route today)")
                       for k, c in COLORS.items()]
            cp = next((r["median_s"] for r in rows if r["id"] == "cp"), None)
            if cp:
                handles.append(ax.axvline(TARGET_RATIO_TO_CP * cp, color="green", ls="--", lw=1,
                                          label=f"target: {TARGET_RATIO_TO_CP}x cp -r"))
            ax.legend(handles=handles, fontsize=7, loc="lower right")
        else:
            ax.axvline(TARGET_PEAK_MB, color="green", ls="--", lw=1, label=f"target: {TARGET_PEAK_MB} MB")
            ax.legend(fontsize=7, loc="lower right")
    if panels == 3:
        ax = axes[2]
        for rid in dict.fromkeys(r["id"] for r in results):
            series = sorted((r["size_bytes"], r["peak_mb_median"], r["kind"], r["name"])
                            for r in results if r["id"] == rid)
            if "nofsync" in rid or rid in ("inspect", "peer-inspect"):
                continue
            kind = series[0][2]
            ax.plot([s[0] / 1e9 for s in series], [s[1] for s in series], marker="o" if kind == "dcptool" else "s",
                    ls="-" if kind == "dcptool" else ":", label=series[0][3], lw=1.2)
        ax.axhline(TARGET_PEAK_MB, color="green", ls="--", lw=1, label=f"target: {TARGET_PEAK_MB} MB")
        ax.set_yscale("log")
        ax.set_xlabel("checkpoint size, GB")
        ax.set_ylabel("peak memory, MB (log scale)")
        ax.set_title("peak memory vs checkpoint size (solid: dcptool, dotted: peers)", fontsize=9)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def chart_title(settings: dict, machine: dict) -> str:
    mesh = settings["mesh"]
    return (f"dcptool bench: {settings['main_size']} {settings['model']} bf16 checkpoint (dp={mesh['dp']}, "
            f"tp={mesh['tp']}), {machine['cpu_count']} CPUs, {machine.get('memory_gb', '?')} GB; warm cache, "
            f"{settings['rounds']} round(s)")


def run_row(row: Row, rnd: int, args, logs: Path, size: str) -> None:
    """One timed run of a row, warm cache; its output is removed before and after."""
    log = logs / f"{row.id}-{size}-r{rnd}.log"
    for attempt in (0, 1):
        if row.output is not None:
            remove(row.output)
        warm(row.inputs)
        if args.jobs == 1:
            os.sync()  # no writeback of the previous row's output during this one
        secs, cpu, peak, rc = measure(row.argv, log, args.timeout)
        if rc == 0 or row.kind == "dcptool" or attempt == 1:
            break
        row.failures += 1  # the users' routes get one more try (counted in the JSON)
        failed = log.with_name(log.stem + "-failed.log")
        log.rename(failed)
        print(f"  {row.name} failed (exit {rc}, see {failed}); running it once more", flush=True)
    if rc != 0:
        print(f"{row.name} failed (exit {rc}): {' '.join(row.argv)}\n{tail(log)}", file=sys.stderr, flush=True)
        os._exit(1)  # also from a --jobs worker thread
    row.times.append(secs)
    row.cpus.append(cpu)
    row.peaks.append(peak)
    print(f"  round {rnd + 1}/{args.rounds}  {row.name:58s} {secs:7.2f}s  (CPU {cpu:6.2f}s)  {peak / 1e6:7.0f} MB",
          flush=True)
    if row.output is not None:
        remove(row.output)


# ---------------------------------------------------------------------------
# Scale: checkpoints of many ranks (--ranks)
# ---------------------------------------------------------------------------

# id: (what runs, kind); SRC is the synthetic checkpoint of N ranks, OUT a fresh output folder.
SCALE_ROWS = {
    "inspect": (["-m", "dcptool", "inspect", "{src}"], "dcptool"),
    "reshard-dp8": (["-m", "dcptool", "reshard", "{src}", "{out}", "--dp", "8", "--no-fsync"], "dcptool"),
    "export-hf": (["-m", "dcptool", "export-hf", "{src}", "{out}", "--no-fsync"], "dcptool"),
    "verify": (["-m", "dcptool", "verify", "{src}", "{hf}"], "dcptool"),  # against its HF export
    "peer-read-metadata": (["-c", "from torch.distributed.checkpoint import FileSystemReader as R; "
                            "R('{src}').read_metadata()"], "peer"),
    "peer-torch-save": (["-c", "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                         "f('{src}', '{out}')"], "peer"),
}


def scale_bench(args) -> int:
    """Rows of ``SCALE_ROWS`` on checkpoints that ``scripts/synth_dcp.py`` writes as N ranks of FSDP2 save
    them (Llama names, ``--scale-layers`` layers, narrow tensors of N rows: every rank holds a chunk of
    every tensor); results in OUT/scale.json, scale.md and scale.png (time and peak memory against N)."""
    out = args.out.resolve()
    work = (args.work or out / "work").resolve()
    logs = out / "logs"
    for folder in (out, work, logs):
        folder.mkdir(parents=True, exist_ok=True)
    results = []
    for ranks in args.ranks:
        src, target = work / f"synth-{ranks}r-{args.scale_layers}l", work / "scale-out"
        if not Path(f"{src}.done").is_file():
            remove(src)
            subprocess.run([sys.executable, str(REPO / "scripts" / "synth_dcp.py"), str(src), "--ranks", str(ranks),
                            "--layers", str(args.scale_layers)], check=True)
            Path(f"{src}.done").write_text("")
        hf = work / f"{src.name}-hf"  # what verify compares the checkpoint with: made once, not timed
        if not Path(f"{hf}.done").is_file():
            remove(hf)
            subprocess.run([sys.executable, "-m", "dcptool", "export-hf", str(src), str(hf), "--no-fsync"], check=True,
                           capture_output=True)
            Path(f"{hf}.done").write_text("")
        metadata_mb = (src / ".metadata").stat().st_size / 2**20
        for rid, (argv, kind) in SCALE_ROWS.items():
            if args.only and not re.search(args.only, rid):
                continue
            times, cpus, peaks = [], [], []
            for rnd in range(args.rounds):
                remove(target)
                warm([src])
                command = [sys.executable] + [a.format(src=src, out=target, hf=hf) for a in argv]
                wall, cpu, peak, code = measure(command, logs / f"scale-{rid}-{ranks}-{rnd}.log", args.timeout)
                if code != 0:
                    print(f"  {rid} at {ranks} ranks exited {code}:\n{tail(logs / f'scale-{rid}-{ranks}-{rnd}.log')}")
                times.append(wall)
                cpus.append(cpu)
                peaks.append(peak / 2**20)
            row = {"id": rid, "kind": kind, "ranks": ranks, "metadata_mb": round(metadata_mb, 1),
                   "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                   "cpu_s": statistics.median(cpus), "peak_mb": statistics.median(peaks)}
            print(f"  {ranks:>5} ranks  {rid:<20} {row['median_s']:8.1f} s  (CPU {row['cpu_s']:.1f} s)  "
                  f"{row['peak_mb']:8.0f} MB", flush=True)
            results.append(row)
        remove(target)
        if not args.keep:
            for path in (src, hf):
                remove(path)
                Path(f"{path}.done").unlink(missing_ok=True)
    (out / "scale.json").write_text(json.dumps({"machine": machine_info(), "layers": args.scale_layers,
                                                "rounds": args.rounds, "rows": results}, indent=1) + "\n")
    lines = ["| ranks | .metadata MB | row | time s (median) | CPU s | peak MB |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['metadata_mb']} | {r['id']} | {r['median_s']:.1f} | {r['cpu_s']:.1f} | "
              f"{r['peak_mb']:.0f} |" for r in results]
    (out / "scale.md").write_text("\n".join(lines) + "\n")
    scale_chart(results, out / "scale.png", f"{args.scale_layers} layers, narrow tensors; "
                                             f"{machine_info().get('cpu_count')} CPUs")
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}")
    return 0


def scale_chart(results: list[dict], path: Path, title: str) -> bool:
    """Time and peak memory of every scale row against the rank count (solid: dcptool, dotted: torch)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (install it with: pip install -e '.[bench]')")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in ((axes[0], "median_s", "wall time, s"), (axes[1], "peak_mb", "peak memory, MB")):
        for rid in dict.fromkeys(r["id"] for r in results):
            series = sorted((r["ranks"], r[key], r["kind"]) for r in results if r["id"] == rid)
            dcp = series[0][2] == "dcptool"
            ax.plot([s[0] for s in series], [s[1] for s in series], marker="o" if dcp else "s",
                    ls="-" if dcp else ":", color=None, label=rid, lw=1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks that saved the checkpoint")
        ax.set_ylabel(label + " (log scale)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("2GB"),
                   help="checkpoint size (bf16 weights), e.g. 2GB (10**9 bytes) or 512MB; default 2GB")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes, e.g. 0.5GB,1GB,2GB,4GB: run every row at each size "
                        "(peak memory against size in the chart); the largest is the main size")
    p.add_argument("--model", choices=("dense", "moe"), default="dense",
                   help="dense: HF Llama names; moe: torchtitan names with grouped experts (default dense)")
    p.add_argument("--dp", type=int, default=2, help="FSDP2 degree of the saving job (default 2)")
    p.add_argument("--tp", type=int, default=2, help="TP degree of the saving job (default 2)")
    p.add_argument("--max-hidden", type=int, default=2048, help="widest hidden size to use (default 2048)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every row; the order is reversed "
                                                          "every other round (default 3)")
    p.add_argument("--only", default=None, help="run only the rows whose id matches this regular expression "
                                                "(cp always runs); ids are listed above")
    p.add_argument("--inspect-tensors", type=int, default=2000,
                   help="tensors of the small checkpoint for the inspect rows (0: no inspect rows)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out", help="results folder (default bench-out/)")
    p.add_argument("--work", type=Path, default=None,
                   help="where checkpoints and outputs go (default OUT/work); checkpoints already there "
                        "with the same shape and mesh are reused")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in the work folder afterwards")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (default 1800)")
    p.add_argument("--jobs", type=int, default=1,
                   help="rows run at the same time (default 1). Above 1 the timings and peaks disturb each "
                        "other: only for smoke tests")
    p.add_argument("--ranks", default=None,
                   help="comma-separated rank counts, e.g. 256,1024,4096: run only the scale rows on synthetic "
                        "checkpoints of that many ranks (scripts/synth_dcp.py), beside torch's read_metadata and "
                        "dcp_to_torch_save; writes OUT/scale.json, scale.md, scale.png")
    p.add_argument("--scale-layers", type=int, default=80, help="layers of the --ranks checkpoints (default 80)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: redraw OUT/bench.png from OUT/results.json")
    args = p.parse_args(argv)
    if args.dp * args.tp != 4:
        p.error("the reshard peers run 4 processes: use a 4-rank source mesh (dp*tp == 4)")
    args.size_list = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes else [args.size])
    args.ranks = [int(n) for n in args.ranks.split(",")] if args.ranks else None
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    if args.ranks:
        return scale_bench(args)
    if args.replot:
        report = json.loads((out / "results.json").read_text())
        settings, machine = report["settings"], report["machine"]
        drew = chart(report["rows"], settings["main_size"], out / "bench.png", chart_title(settings, machine))
        return 0 if drew else 1
    work: Path = (args.work or out / "work").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    machine = machine_info()
    notes = [
        "model weights only (bf16), no optimizer state (but in the verl reader row's source)",
        "warm page cache: every input is read once right before each run (dropping the cache needs root)",
        f"peak memory: RSS of the process tree summed, sampled every {int(SAMPLE_S * 1000)} ms "
        "(shared libraries count once per process: torchrun rows count torch 5 times)",
        f"order of rows reversed every other round; {args.rounds} round(s)",
    ]
    if args.jobs > 1:
        notes.append(f"--jobs {args.jobs}: rows ran {args.jobs} at a time, so times and peaks disturb each other "
                     "(a smoke test, not a measurement)")
    print(f"machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs, "
          f"{machine.get('memory_gb', '?')} GB, Python {machine['python']}, torch {machine.get('torch', '?')}, "
          f"load average {machine['load_average_at_start'][0]:.1f}")
    for note in notes:
        print(f"note: {note}")
    # Installed packages carry their bytecode; a checkout run with PYTHONDONTWRITEBYTECODE may not, and
    # compiling dcptool's modules on every start would be timed as start-up.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "dcptool"), str(REPO / "converters")],
                   capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    sizes = sorted(args.size_list)
    main_size = human(sizes[-1])
    small_shape = inspect_shape(args.inspect_tensors) if args.inspect_tensors > 0 else None
    want = re.compile(args.only) if args.only else None
    # export-hf-moe: beside a dense checkpoint, a MoE one of the same size in Archon names (--model moe
    # already benchmarks every row on a MoE checkpoint: no second one).
    with_moe = args.model == "dense" and (want is None or bool(want.search("export-hf-moe")))
    results: list[dict] = []
    shapes, moe_shapes = {}, {}
    for target in sizes:
        shape = choose_shape(args.model, target, args.max_hidden)
        shapes[human(target)] = shape
        tag = f"{args.model}-{human(target)}-dp{args.dp}tp{args.tp}"
        src = work / f"ckpt-{tag}"
        small = work / f"ckpt-inspect-{small_shape.layers}l-dp{args.dp}tp{args.tp}" if small_shape else None
        print(f"\n== {human(target)}: {shape.describe()}", flush=True)
        jobs = [(src, shape)]
        moe_src = None
        if with_moe:
            moe_shapes[human(target)] = moe_shape = choose_shape("moe", target, args.max_hidden)
            moe_src = work / f"ckpt-moe-{human(target)}-dp{args.dp}tp{args.tp}"
            jobs.append((moe_src, moe_shape))
            print(f"   and {moe_shape.describe()}", flush=True)
        jobs += [(small, small_shape)] if small_shape else []
        # The readers of issue 13: accelerate's folder and verl's optimizer checkpoint come from the same job.
        readers = reader_shapes(shape, target, args.max_hidden, want) if args.model == "dense" else {}
        layouts = {reader_folder(reader, tag, work): reader for reader in GLOO_LAYOUTS if reader in readers}
        if "verl" in readers:
            layouts[work / f"ckpt-optim-{tag}"] = "optim"
        jobs += [(path, readers["verl" if layout == "optim" else layout]) for path, layout in layouts.items()]
        save_checkpoints(jobs, args.dp, args.tp, logs, layouts)
        # The HF export that verify compares the checkpoint with (made once, not timed). A MoE checkpoint's
        # keeps its Archon names (--adapter hf: no renaming, expert_bias kept), so that verify and its peer
        # compare the same names on both sides, as with the dense model's HF names.
        keep_names = ["--adapter", "hf"] if shape.model == "moe" else []
        hf = work / (f"hf-{tag}" + ("-archon-names" if keep_names else ""))
        if not Path(f"{hf}.done").is_file():
            remove(hf)
            subprocess.run([sys.executable, "-m", "dcptool", "export-hf", str(src), str(hf), "--no-fsync",
                            *keep_names], check=True, capture_output=True)
            Path(f"{hf}.done").write_text("")
        outdir = work / "out"
        remove(outdir)
        outdir.mkdir()
        moe_info = checkpoint_info(moe_src, moe_shapes[human(target)]) if moe_src else None
        rows = [r for r in make_rows(src, hf, small, shape, outdir, len(small_shape.tensors()) if small_shape else 0,
                                     (moe_src, moe_info) if moe_src else None)
                if r.id in ("cp", "cp-sync") or want is None or want.search(r.id)]
        sources = reader_sources(readers, tag, work, logs)
        rows += [r for r in reader_rows(sources, outdir) if r.kind == "floor" or want is None or want.search(r.id)]
        size_info = {"size": human(target), "target_bytes": target, **checkpoint_info(src, shape),
                     "inspect_tensors": len(small_shape.tensors()) if small_shape else None,
                     "moe_checkpoint": moe_info}
        print(f"  checkpoint {src}: {human(size_info['size_bytes'])} in {size_info['files']} files", flush=True)
        if moe_info:
            print(f"  checkpoint {moe_src}: {human(moe_info['size_bytes'])} in {moe_info['files']} files", flush=True)
        for rnd in range(args.rounds):
            order = rows if rnd % 2 == 0 else rows[::-1]
            if args.jobs > 1:
                with ThreadPoolExecutor(args.jobs) as pool:
                    list(pool.map(lambda row: run_row(row, rnd, args, logs, human(target)), order))
            else:
                for row in order:
                    run_row(row, rnd, args, logs, human(target))
        results += summarize(rows, size_info)
        if not args.keep:
            for path in (src, Path(f"{src}.done"), hf, Path(f"{hf}.done")) + ((moe_src, Path(f"{moe_src}.done"))
                                                                           if moe_src else ()):
                remove(path)
            for reader in readers:  # the reader sources, and the gloo job's folders they were made from
                folder = reader_folder(reader, tag, work)
                for path in (folder, Path(f"{folder}.done"), work / f"ckpt-optim-{tag}",
                             work / f"ckpt-optim-{tag}.done", work / f"accelerate-{tag}"):
                    remove(path)
        remove(outdir)
    if small_shape and not args.keep:
        for path in work.glob("ckpt-inspect-*"):
            remove(path)
    main_rows = [r for r in results if r["size"] == main_size]
    report = {
        "machine": machine, "notes": notes,
        "settings": {"model": args.model, "mesh": {"dp": args.dp, "tp": args.tp}, "rounds": args.rounds,
                     "sizes": [human(s) for s in sizes], "main_size": main_size,
                     "shapes": {k: asdict(v) for k, v in shapes.items()},
                     "moe_shapes": {k: asdict(v) for k, v in moe_shapes.items()},
                     "inspect_shape": asdict(small_shape) if small_shape else None,
                     "command": " ".join([Path(sys.executable).name, "scripts/bench.py", *(argv or sys.argv[1:])])},
        "rows": results,
    }
    report["targets"] = targets(results, main_size)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    md = [f"{main_size} {shapes[main_size].describe()}, saved by a {args.dp * args.tp}-process gloo job "
          f"(dp={args.dp}, tp={args.tp}); {args.rounds} round(s)."]
    reader_info = {r["id"]: r["source"] for r in main_rows if r["kind"] == "floor" and r["source"]}
    if reader_info:
        md += ["", "Readers of issue 13, each against cp -r of its own source (docs/benchmarks.md says how each "
                   "source is made): " + "; ".join(f"{rid[3:]} {human(info['size_bytes'])} ({info['model']})"
                                                  for rid, info in reader_info.items()) + "."]
    if main_size in moe_shapes:
        md += ["", f"export-hf-moe: {moe_shapes[main_size].describe()} (Archon names), saved by the same job; "
                   "its ratios are per tensor byte."]
    md += ["", table(main_rows)]
    for other in sizes[:-1]:
        md += ["", f"{human(other)}:", "", table([r for r in results if r["size"] == human(other)])]
    md += ["", "| target (issue 5) | value | met |", "|---|---|---|"]
    md += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"\n{main_size}:\n" + table(main_rows))
    print("\ntargets of issue 5:")
    for t in report["targets"]:
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['value']}")
    drew = chart(results, main_size, out / "bench.png", chart_title(report["settings"], machine))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}" + (f", {out / 'bench.png'}" if drew else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_save":
        sys.exit(worker_save(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_reshard":
        sys.exit(worker_reshard(sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_fp8":
        sys.exit(make_fp8(*sys.argv[2:]))
    if len(sys.argv) > 1 and sys.argv[1] == "_peer":
        sys.exit(peer(sys.argv[2:]))
    sys.exit(main())
