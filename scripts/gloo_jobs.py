#!/usr/bin/env python
"""Real distributed-checkpoint jobs on CPU (gloo) for testing dcptool.

Run under torchrun, for example::

    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        scripts/gloo_jobs.py save-dcp /tmp/ckpt --dp 2 --tp 2
    python -m torch.distributed.run --standalone --nproc-per-node 4 \
        scripts/gloo_jobs.py save-dcp /tmp/moe --model moe --dp 2 --tp 2 --ep 2

Subcommands (see ``--help`` of each):

* ``save-dcp OUT``    FSDP2 / HSDP (optionally + TP, + EP for the MoE) training
                      step on a tiny HF Llama or a tiny torchtitan-style MoE,
                      then ``torch.distributed.checkpoint.save`` in a torchtitan
                      or AReaL layout.  Rank 0 also writes ``OUT.reference/``
                      with the full (gathered) state, flattened to the DCP keys.
* ``save-fsdp1 OUT``  FSDP1 SHARDED_STATE_DICT per-rank ``torch.save`` files,
                      named the way verl names them.
* ``load-dcp CKPT``   Load a DCP checkpoint into a (possibly different) mesh and
                      compare every local shard bitwise with a full reference;
                      ``--save-layout DIR`` first saves that mesh's own checkpoint.
* ``load-fsdp1 DIR``  Load verl-style FSDP1 shards into a real FSDP1 job and
                      compare the gathered full state dict with a reference.

Several command lines joined by ``--then`` run one after the other in one job, so
that torch starts once for all of them (each checks on its own: it builds its own
model and mesh); each is told apart in the output by ``== step N ...`` lines::

    ... gloo_jobs.py load-dcp A --dp 4 --expect A.reference/full.pt --then load-dcp B --dp 4 ...

Nothing here is mocked: real process groups, real FSDP2 / FSDP1 / TP / EP.  Every
rank builds the identical model on CPU from a fixed seed before sharding.
Exit status 0 means success; 1 means a comparison failed (in any step).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

# ---------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------

# The "tiny" Llama.  vocab_size=250 is deliberately not divisible by 4, so
# FSDP shards of embed_tokens / lm_head are uneven (torch.chunk: dp=4 gives
# 63, 63, 63, 61 rows; dp=2 over tp=2 gives 63 + 62 of each 125-row TP shard).
TINY_LLAMA = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "vocab_size": 250,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
PRESETS = {"tiny": TINY_LLAMA}

# The tiny torchtitan-style MoE transformer (``--model moe``): layers below
# n_dense_layers have a dense FFN, the others an MoE with grouped experts and
# a shared expert.  Every TP-sharded dim (vocab, dim, heads, ffn and expert
# hidden dims) is divisible by 4, so tp=4 works; ep can be 2 or 4.
TINY_MOE = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_dense_layers": 1,
    "n_heads": 4,
    "n_kv_heads": 4,
    "ffn_hidden_dim": 96,
    "moe_hidden_dim": 32,
    "num_experts": 4,
}
MODELS = ("llama", "moe")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Seeds.  The saver builds the model from MODEL_SEED.  Loaders build it from a
# different seed, so a load that silently does nothing cannot pass the check.
MODEL_SEED = 0
LOADER_SEED = 1234
DATA_SEED = 1000

# Non-tensor entries written next to the weights (torchtitan / AReaL style).
TRAIN_STATE = {"step": 7, "note": "hello"}
LR_SCHEDULER_STATE = {"last_epoch": 7}

BATCH_SIZE = 2
SEQ_LEN = 16
LR = 1e-2


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(msg: str, all_ranks: bool = False) -> None:
    """Print on rank 0 (or on every rank with a rank prefix)."""
    if all_ranks:
        print(f"[rank {rank()}] {msg}", flush=True)
    elif rank() == 0:
        print(msg, flush=True)


def quiet_known_warnings() -> None:
    """Silence harmless, very chatty messages (one per rank per call).

    * FSDP2 warns that the root module "returned a view tensor" (seen with TP,
      where the gathered logits come back as a view); nothing here modifies
      the model outputs in place.
    * DTensor warns that gathering (_StridedShard, Shard) needs two sequential
      all-gathers; that is expected for FSDP2-over-TP and fine at this size.
    * FSDP1 deprecation notices (state_dict_type, ShardedTensor, ...): FSDP1
      is exactly what the save-fsdp1 / load-fsdp1 jobs exist to exercise.
    """
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r".*returned a view tensor.*")
    for pattern in (r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\)",
                    r"Please use DTensor instead and we are deprecating ShardedTensor",
                    r"`_get_pg_default_device` will be deprecated",
                    r"Multiple backends are registered with this ProcessGroup"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def init_distributed() -> None:
    """Join the torchrun job with the gloo backend on CPU."""
    if "RANK" not in os.environ:
        sys.exit("gloo_jobs.py must be run under torchrun "
                 "(python -m torch.distributed.run --standalone --nproc-per-node N ...)")
    torch.set_num_threads(1)
    quiet_known_warnings()
    dist.init_process_group(backend="gloo")


class Timer:
    """Wall-clock phases of a job, printed once at the end."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def __str__(self) -> str:
        parts = [f"{name} {secs:.2f}s" for name, secs in self.phases]
        return ", ".join(parts + [f"total {self.last - self.start:.2f}s"])


def reference_dir(out: str | os.PathLike) -> Path:
    """The reference folder for a checkpoint: ``OUT + '.reference'``."""
    return Path(str(out).rstrip("/") + ".reference")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts (and lists holding dicts/tensors) with '.' joins.

    Follows the rules DCP's default planner uses for on-disk keys
    (``torch.distributed.checkpoint._traverse.traverse_state_dict``): mappings
    are always descended into, lists only when they (recursively) hold a
    mapping or a tensor, everything else is a leaf.  So the keys of the result
    equal the keys in the checkpoint's ``.metadata``.  Written here rather
    than imported so that the reference does not depend on DCP internals.
    """
    out: dict[str, Any] = {}

    def holds_dict_or_tensor(value: Any) -> bool:
        if isinstance(value, Mapping) or torch.is_tensor(value):
            return True
        if isinstance(value, list):
            return any(holds_dict_or_tensor(v) for v in value)
        return False

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{path}.{k}" if path else str(k), v)
        elif isinstance(value, list) and holds_dict_or_tensor(value):
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v)
        else:
            if path in out:
                raise ValueError(f"duplicated flattened key {path}")
            out[path] = value

    walk(prefix, tree)
    return out


def split_tensors(flat: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a flat dict into (tensor leaves, non-tensor leaves)."""
    tensors = {k: v for k, v in flat.items() if torch.is_tensor(v)}
    objects = {k: v for k, v in flat.items() if not torch.is_tensor(v)}
    return tensors, objects


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def load_model_config(spec: str | None):
    """Build a ``LlamaConfig`` from a preset name, a JSON string or a path.

    The JSON (inline or a config.json file) overrides the "tiny" preset, so
    ``'{"hidden_size": 512, "intermediate_size": 1408}'`` is enough to make a
    bigger model.  Attention is forced to "eager" (pure PyTorch, identical on
    every rank and happy with TP-local head counts).
    """
    from transformers import LlamaConfig

    fields = dict(TINY_LLAMA)
    if spec and spec in PRESETS:
        fields = dict(PRESETS[spec])
    elif spec and Path(spec).is_file():
        fields.update(json.loads(Path(spec).read_text()))
    elif spec:
        fields.update(json.loads(spec))
    # Keys that a saved config.json carries but LlamaConfig should not get back.
    for key in ("architectures", "model_type", "transformers_version", "_attn_implementation"):
        fields.pop(key, None)
    fields["attn_implementation"] = "eager"
    return LlamaConfig(**fields)


def build_model(config, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Identical, deterministic model on every rank (CPU, before sharding)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    random.seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(dtype)


def training_batch(config, data_rank: int) -> torch.Tensor:
    """Deterministic token ids for one data-parallel rank (same for its TP peers)."""
    gen = torch.Generator().manual_seed(DATA_SEED + data_rank)
    return torch.randint(0, config.vocab_size, (BATCH_SIZE, SEQ_LEN), generator=gen)


def train_steps(model, optimizer, config, steps: int, data_rank: int) -> list[float]:
    """Real forward + backward + AdamW step(s); returns the losses.

    With TP the HF Llama attention still works on CPU: ColwiseParallel hands
    back local tensors, and LlamaAttention reshapes with ``-1`` heads, so each
    TP rank simply runs its local heads.  No synthetic gradients are needed
    (checked: dp=2,tp=2 reproduces the dp=2 losses over 3 steps to ~1e-6).
    """
    ids = training_batch(config, data_rank)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the plain per-parameter loop, which handles DTensor
    # parameters on different meshes (TP'd vs. non-TP'd) without fuss.
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)


def synthetic_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One real AdamW step on gradients made from the parameters themselves.

    The gradient is an elementwise function of each parameter, computed on the
    (sharded) DTensor, so it keeps the parameter's placements and needs no
    forward pass (the MoE experts under EP would need all-to-all routing).
    """
    for param in model.parameters():
        param.grad = torch.sin(3 * param.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------
# The tiny MoE model (torchtitan / AReaL Archon parameter names)
# ---------------------------------------------------------------------------
#
# Parameters only: the jobs never run it forward (see synthetic_step), so the
# modules carry just what decides the state dict and its sharding.


def load_moe_config(spec: str | None) -> dict[str, int]:
    """TINY_MOE overridden by a JSON string or a config.json path."""
    fields = dict(TINY_MOE)
    if spec and Path(spec).is_file():
        fields.update(json.loads(Path(spec).read_text()))
    elif spec and spec not in PRESETS:  # "tiny" means TINY_MOE itself
        fields.update(json.loads(spec))
    fields.pop("model", None)  # the marker a reference's config.json carries
    return fields


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)


class GroupedExperts(nn.Module):
    """All routed experts' weights as 3-D parameters [experts, out, in]."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.router = Router(dim, num_experts)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_experts = FeedForward(dim, hidden)
        # Load-balancing bias: a persistent float32 buffer, as in torchtitan.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)


class TransformerBlock(nn.Module):
    def __init__(self, config: dict[str, int], moe_enabled: bool) -> None:
        super().__init__()
        dim = config["dim"]
        self.moe_enabled = moe_enabled
        self.attention = Attention(dim, config["n_heads"], config["n_kv_heads"])
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        if moe_enabled:
            self.moe = MoE(dim, config["moe_hidden_dim"], config["num_experts"])
        else:
            self.feed_forward = FeedForward(dim, config["ffn_hidden_dim"])


class MoeTransformer(nn.Module):
    def __init__(self, config: dict[str, int]) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config["vocab_size"], config["dim"])
        # A ModuleDict, as torchtitan uses, so the keys read "layers.<i>....".
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(config, moe_enabled=i >= config["n_dense_layers"])
            for i in range(config["n_layers"])
        })
        self.norm = nn.RMSNorm(config["dim"])
        self.output = nn.Linear(config["dim"], config["vocab_size"], bias=False)


def build_moe_model(config: dict[str, int], dtype: torch.dtype, seed: int) -> MoeTransformer:
    """Identical model on every rank: every parameter and buffer drawn from ``seed``.

    Random normal everywhere (norm weights and expert_bias included), so a
    misplaced or permuted shard cannot go unnoticed.
    """
    model = MoeTransformer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in [*model.named_parameters(), *model.named_buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    model.to(dtype)
    # expert_bias stays float32 whatever the parameter dtype (torchtitan).
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.expert_bias = block.moe.expert_bias.float()
    return model


# ---------------------------------------------------------------------------
# Parallelism: one root mesh, TP, EP, FSDP2 / HSDP (torchtitan's rules)
# ---------------------------------------------------------------------------


@dataclass
class Parallel:
    """A job's parallel degrees and its device meshes, as torchtitan's ParallelDims lays them out.

    Dense parameters see the ranks row-major over (dp_replicate, dp_shard, tp).
    Expert parallelism borrows ranks rather than adding any: the experts see
    the same ranks as (dp_replicate, efsdp, ep, etp) when etp == tp > 1, or as
    (dp_replicate, efsdp, ep) when etp == 1, where ep then spans dp_shard and
    tp.  Both views are unflattened from one 1-D root mesh, because FSDP2
    insists that a parameter's TP/EP mesh and its dp mesh share their root.
    """

    dp_replicate: int
    dp: int
    tp: int
    ep: int
    etp: int
    dense: DeviceMesh | None = None
    experts: DeviceMesh | None = None

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp * self.tp

    @property
    def efsdp(self) -> int:
        """FSDP degree of the experts: what EP leaves of the ranks it borrows."""
        return self.dp * (self.tp if self.etp == 1 else 1) // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        # As torchtitan: FSDP for dp_shard > 1, and always with EP (then
        # possibly over a 1-rank dp mesh); pure TP jobs get no FSDP at all.
        return self.dp > 1 or self.ep > 1

    def check(self) -> None:
        if self.world_size != dist.get_world_size():
            raise SystemExit(f"dp_replicate*dp*tp = {self.dp_replicate}*{self.dp}*{self.tp} "
                             f"!= world size {dist.get_world_size()}")
        if self.etp not in (1, self.tp):
            raise SystemExit(f"--etp {self.etp} must be 1 or --tp ({self.tp})")
        borrowed = self.dp * (self.tp if self.etp == 1 else 1)
        if self.ep > 1 and (borrowed % self.ep or (self.etp == 1 and self.ep % self.tp)):
            raise SystemExit(f"--ep {self.ep} with --etp {self.etp}: ep must divide the {borrowed} "
                             "dp_shard (x tp when etp=1) ranks it borrows, and with etp=1 be a "
                             "multiple of tp")
        if self.dp_replicate > 1 and not self.fsdp_enabled:
            raise SystemExit("--dp-replicate with --dp 1 is DDP in torchtitan, not emulated here")

    def build(self) -> Parallel:
        self.check()
        root = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("world",))
        self.dense = root._unflatten(0, (self.dp_replicate, self.dp, self.tp),
                                     ("dp_replicate", "dp_shard", "tp"))
        if self.ep > 1:
            sizes = (self.dp_replicate, self.efsdp, self.ep)
            names = ("dp_replicate", "efsdp", "ep")
            if self.etp > 1:
                sizes, names = sizes + (self.etp,), names + ("etp",)
            self.experts = root._unflatten(0, sizes, names)
        return self

    def dp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the dense parameters: 2-D for HSDP."""
        return self.dense["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else self.dense["dp_shard"]

    def edp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the routed experts under EP: 2-D for HSDP."""
        return self.experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else self.experts["efsdp"]

    def data_rank(self) -> int:
        """Which batch this rank trains on (TP peers share one)."""
        return (self.dense.get_local_rank("dp_replicate") * self.dp
                + self.dense.get_local_rank("dp_shard"))

    def as_dict(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp": self.dp, "tp": self.tp,
                "ep": self.ep, "etp": self.etp}


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism on the HF Llama.

    Resulting TP placements of the weights:
      q/k/v/gate/up  ColwiseParallel  -> Shard(0)  (output features)
      o/down         RowwiseParallel  -> Shard(1)  (input features)
      embed_tokens   RowwiseParallel  -> Shard(0)  (vocab rows of nn.Embedding)
      lm_head        ColwiseParallel  -> Shard(0)  (vocab rows)
      norms          not parallelized (plain tensors, replicated over tp)
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            # Token ids come in replicated; the embedding output is all-reduced.
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            # Gather the logits so the HF loss sees the full vocab.
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan)


def apply_moe_tp(model: MoeTransformer, tp_mesh: DeviceMesh) -> None:
    """torchtitan's TP plan for the dense parts of the MoE transformer.

    Colwise (Shard(0)): wq/wk/wv, feed_forward.w1/w3, shared_experts.w1/w3,
    output.  Rowwise (Shard(1)): wo, feed_forward.w2, shared_experts.w2;
    tok_embeddings Shard(0).  Norms (SequenceParallel) and the router gate
    (torchtitan's NoParallel) become Replicate() DTensors on tp.  The model
    never runs forward, so the activation layouts of the plan do not matter.
    """
    from torch.distributed.tensor import Replicate, distribute_module
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(),
    })
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(),
            "ffn_norm": SequenceParallel(),
        }
        ffn = "moe.shared_experts" if block.moe_enabled else "feed_forward"
        plan.update({f"{ffn}.w1": ColwiseParallel(), f"{ffn}.w2": RowwiseParallel(),
                     f"{ffn}.w3": ColwiseParallel()})
        parallelize_module(block, tp_mesh, plan)
        if block.moe_enabled:
            distribute_module(block.moe.router.gate, tp_mesh)  # all Replicate()


def apply_experts_parallel(experts: GroupedExperts, parallel: Parallel) -> None:
    """EP / ETP / TP of the grouped experts, as torchtitan's ExpertParallel,
    ExpertTensorParallel and TensorParallel styles place them.

    w1/w3 are [experts, hidden, dim] (colwise: hidden split), w2 is
    [experts, dim, hidden] (rowwise: hidden split).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    if parallel.ep > 1 and parallel.etp > 1:
        mesh = parallel.experts["ep", "etp"]
        placements = {"w1": [Shard(0), Shard(1)], "w2": [Shard(0), Shard(2)],
                      "w3": [Shard(0), Shard(1)]}
    elif parallel.ep > 1:
        mesh = parallel.experts["ep"]
        placements = {"w1": [Shard(0)], "w2": [Shard(0)], "w3": [Shard(0)]}
    elif parallel.tp > 1:
        mesh = parallel.dense["tp"]
        placements = {"w1": [Shard(1)], "w2": [Shard(2)], "w3": [Shard(1)]}
    else:
        return
    for name, placement in placements.items():
        weight = distribute_tensor(getattr(experts, name).detach(), mesh, placement)
        experts.register_parameter(name, nn.Parameter(weight))


def apply_fsdp(model: torch.nn.Module, blocks: list[torch.nn.Module], parallel: Parallel) -> None:
    """FSDP2 per transformer block, root last; routed experts on their own mesh under EP."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    if not parallel.fsdp_enabled:
        return
    dp_mesh = parallel.dp_mesh()
    for block in blocks:
        if getattr(block, "moe_enabled", False) and parallel.ep > 1:
            experts = block.moe.experts
            # EP already splits dim 0 (the experts); once efsdp * ep exceeds
            # the expert count, torchtitan has FSDP shard dim 1 instead.
            placement_fn = None
            if parallel.efsdp * parallel.ep > experts.num_experts:
                placement_fn = lambda param: Shard(1)  # noqa: E731
            fully_shard(experts, mesh=parallel.edp_mesh(), shard_placement_fn=placement_fn)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def build_fsdp2_model(kind: str, config, dtype: torch.dtype, parallel: Parallel, seed: int):
    """Model -> TP / EP -> FSDP2 (HSDP) on the meshes of ``parallel`` (built here)."""
    parallel.build()
    if kind == "llama":
        if parallel.ep > 1:
            raise SystemExit("--ep needs --model moe (the Llama has no experts)")
        model = build_model(config, dtype, seed)
        if parallel.tp > 1:
            apply_tp(model, parallel.dense["tp"])
        blocks = list(model.model.layers)
    else:
        model = build_moe_model(config, dtype, seed)
        if parallel.tp > 1:
            apply_moe_tp(model, parallel.dense["tp"])
        blocks = list(model.layers.values())
        for block in blocks:
            if block.moe_enabled:
                apply_experts_parallel(block.moe.experts, parallel)
    apply_fsdp(model, blocks, parallel)
    return model


# Parameters (and the one buffer) whose placements the save / load jobs log.
LOGGED_NAMES = {
    "llama": ("model.embed_tokens.weight",
              "model.layers.0.self_attn.q_proj.weight",
              "model.layers.0.self_attn.o_proj.weight",
              "model.layers.0.input_layernorm.weight",
              "lm_head.weight"),
    "moe": ("tok_embeddings.weight",
            "layers.0.attention.wq.weight",
            "layers.0.attention.wo.weight",
            "layers.0.attention_norm.weight",
            "layers.1.moe.router.gate.weight",
            "layers.1.moe.experts.w1",
            "layers.1.moe.experts.w2",
            "layers.1.moe.experts.w3",
            "layers.1.moe.shared_experts.w1.weight",
            "layers.1.moe.expert_bias",
            "output.weight"),
}


def placements_of(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """({fqn: str(placements)}, {fqn: mesh dim names and shape}) of the parameters
    and persistent buffers."""
    keys = set(model.state_dict())
    placements, meshes = {}, {}
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        if name not in keys:
            continue
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            placements[name] = str(tuple(value.placements))
            meshes[name] = f"{tuple(mesh.mesh_dim_names or ())} {tuple(mesh.shape)}"
        else:
            placements[name] = meshes[name] = "plain tensor"
    return placements, meshes


def log_placements(model: torch.nn.Module, kind: str) -> tuple[dict[str, str], dict[str, str]]:
    """Log the placements of LOGGED_NAMES on rank 0; returns placements_of(model)."""
    placements, meshes = placements_of(model)
    for name in LOGGED_NAMES[kind]:
        log(f"placements {name}: {placements[name]} on mesh {meshes[name]}")
    return placements, meshes


# ---------------------------------------------------------------------------
# DCP state dict layouts
# ---------------------------------------------------------------------------


def dcp_state(model, optimizer, layout: str, model_only: bool = False,
              full: bool = False, train_state: dict | None = None,
              lr_state: dict | None = None, dataloader: dict | None = None) -> dict[str, Any]:
    """The nested state dict a trainer hands to ``dcp.save`` / ``dcp.load``.

    * torchtitan: model keys at top level, ``optimizer`` holding the optimizer
      state flattened by torch (``flatten_optimizer_state_dict=True``, exactly
      what torchtitan's OptimizersContainer does: keys
      ``state.<fqn>.exp_avg`` and ``param_groups.<fqn>.lr``), plus
      ``train_state`` and ``lr_scheduler`` objects, and ``dataloader`` when
      given (torchtitan's per-data-parallel-rank ``dp_rank_{i}`` entries).
    * areal: ``{"dcp": {"model": ..., "optim": ...}, "train_state": ...}``
      with the optimizer state in torch's nested form
      (``state -> fqn -> exp_avg`` and a ``param_groups`` list).

    ``full=True`` gives the gathered, unsharded, CPU-offloaded version (values
    only on rank 0), for writing the reference.
    """
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = None
    if not model_only:
        optim_options = StateDictOptions(
            full_state_dict=full,
            cpu_offload=full,
            flatten_optimizer_state_dict=(layout == "torchtitan"),
        )
        optim_sd = get_optimizer_state_dict(model, optimizer, options=optim_options)
    train_state = dict(TRAIN_STATE if train_state is None else train_state)
    lr_state = dict(LR_SCHEDULER_STATE if lr_state is None else lr_state)

    if layout == "torchtitan":
        sd: dict[str, Any] = dict(model_sd)
        if not model_only:
            sd["optimizer"] = optim_sd
            sd["train_state"] = train_state
            sd["lr_scheduler"] = lr_state
            if dataloader is not None:
                sd["dataloader"] = dataloader
        return sd
    if layout == "areal":
        inner: dict[str, Any] = {"model": model_sd}
        if not model_only:
            inner["optim"] = optim_sd
        sd = {"dcp": inner}
        if not model_only:
            sd["train_state"] = {"step": train_state["step"]}
        return sd
    raise ValueError(f"unknown layout {layout!r}")


def dataloader_state(data_ranks) -> dict[str, Any]:
    """torchtitan's ParallelAwareDataloader state: pickled position per data-parallel rank, plus the dp size."""
    import pickle

    return {f"dp_rank_{r}": pickle.dumps({"sample": 100 + r}) for r in data_ranks}


def apply_dcp_state(model, optimizer, sd: dict[str, Any], layout: str, model_only: bool) -> None:
    """Push a loaded DCP state back into model/optimizer (the trainer's path)."""
    if layout == "torchtitan":
        model_sd = {k: v for k, v in sd.items()
                    if k not in ("optimizer", "train_state", "lr_scheduler")}
        optim_sd = sd.get("optimizer")
    else:
        model_sd = sd["dcp"]["model"]
        optim_sd = sd["dcp"].get("optim")
    set_model_state_dict(model, model_sd)
    if not model_only and optim_sd is not None:
        set_optimizer_state_dict(
            model, optimizer, optim_sd,
            options=StateDictOptions(flatten_optimizer_state_dict=(layout == "torchtitan")),
        )


# ---------------------------------------------------------------------------
# Comparison of a loaded sharded state dict against a full reference
# ---------------------------------------------------------------------------


def local_region(full: torch.Tensor, dtensor: DTensor) -> torch.Tensor:
    """The part of ``full`` that this rank's local shard of ``dtensor`` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return full[index]


def compare_tensor(key: str, value: torch.Tensor, expected: torch.Tensor | None) -> str | None:
    """None if equal, else a reason.  Collective for DTensors: call on all ranks."""
    if isinstance(value, DTensor):
        # full_tensor() is a collective, so it runs even when the key is missing.
        gathered = value.full_tensor()
        if expected is None:
            return "missing from reference"
        if value.dtype != expected.dtype:
            return f"dtype {value.dtype} != {expected.dtype}"
        if tuple(value.shape) != tuple(expected.shape):
            return f"global shape {tuple(value.shape)} != {tuple(expected.shape)}"
        local = value.to_local()
        region = local_region(expected, value)
        if tuple(local.shape) != tuple(region.shape):
            return f"local shape {tuple(local.shape)} != region {tuple(region.shape)}"
        if not torch.equal(local, region):
            return f"local shard differs (placements {value.placements})"
        if not torch.equal(gathered, expected):
            return "full_tensor() differs"
        return None
    if expected is None:
        return "missing from reference"
    if value.dtype != expected.dtype or tuple(value.shape) != tuple(expected.shape):
        return f"{value.dtype}{tuple(value.shape)} != {expected.dtype}{tuple(expected.shape)}"
    if not torch.equal(value, expected):
        return "values differ"
    return None


def compare_all(flat: dict[str, Any], expected: dict[str, torch.Tensor]) -> tuple[int, str | None]:
    """Compare every tensor leaf; returns (count checked, first mismatch or None).

    Keeps going after a mismatch so every rank issues the same collectives.
    """
    first = None
    checked = 0
    for key in sorted(flat):
        value = flat[key]
        if not torch.is_tensor(value):
            continue
        reason = compare_tensor(key, value, expected.get(key))
        checked += 1
        if reason is not None and first is None:
            first = f"{key}: {reason}"
    return checked, first


def finish_check(first_mismatch: str | None, what: str) -> int:
    """Agree across ranks on pass/fail; print the first mismatch per rank."""
    if first_mismatch is not None:
        log(f"MISMATCH: first mismatching key {first_mismatch}", all_ranks=True)
    failed = torch.tensor([0 if first_mismatch is None else 1])
    dist.all_reduce(failed)
    if failed.item():
        log(f"FAIL: {int(failed.item())} rank(s) saw mismatches")
        return 1
    log(f"OK: {what}")
    return 0


# ---------------------------------------------------------------------------
# Subcommand: save-dcp
# ---------------------------------------------------------------------------


def parallel_of(args) -> Parallel:
    """The mesh options of a save-dcp / load-dcp command line (--etp defaults to --tp)."""
    etp = args.tp if args.etp is None else args.etp
    return Parallel(args.dp_replicate, args.dp, args.tp, args.ep, etp)


def load_config(kind: str, spec: str | None):
    """A LlamaConfig for --model llama, a dict of sizes for --model moe."""
    return load_model_config(spec) if kind == "llama" else load_moe_config(spec)


def build_job_model(kind: str, config, dtype: torch.dtype, parallel: Parallel, seed: int):
    """build_fsdp2_model + optimizer, logging the meshes and placements on rank 0."""
    model = build_fsdp2_model(kind, config, dtype, parallel, seed)
    log(f"mesh {parallel.dense}" + (f", experts mesh {parallel.experts}" if parallel.experts else ""))
    placements, meshes = log_placements(model, kind)
    return model, make_optimizer(model), placements, meshes


def cmd_save_dcp(args) -> int:
    timer = Timer()
    config = load_config(args.model, args.model_config)
    parallel = parallel_of(args)
    model, optimizer, placements, meshes = build_job_model(
        args.model, config, DTYPES[args.dtype], parallel, MODEL_SEED)
    timer.mark("build")
    if (args.model == "llama" and args.tp > 1 and args.dp > 1
            and "_StridedShard" not in placements["model.layers.0.self_attn.q_proj.weight"]):
        raise SystemExit("expected _StridedShard on a colwise weight with FSDP2 over TP")

    if args.model == "llama":
        losses = train_steps(model, optimizer, config, args.steps, parallel.data_rank())
        log(f"losses {losses}")
    else:
        for _ in range(args.steps):
            synthetic_step(model, optimizer)
    timer.mark("train")

    # torchtitan saves each data-parallel rank's dataloader position under its own key; loaders on
    # another mesh must leave it out (torchtitan#811), so load-dcp never asks for it.
    data_ranks = range(args.dp_replicate * args.dp)
    sd = dcp_state(model, optimizer, args.layout, dataloader=dataloader_state([parallel.data_rank()]))
    dcp.save(sd, checkpoint_id=args.out)
    timer.mark("dcp.save")

    # Reference: full (gathered) state via torch's own state_dict helpers.
    full = dcp_state(model, optimizer, args.layout, full=True, dataloader=dataloader_state(data_ranks))
    if rank() == 0:
        write_dcp_reference(args, parallel, config, full, placements, meshes)
    dist.barrier()
    timer.mark("reference")
    log(f"save-dcp done: {args.out} ({timer})")
    return 0


def write_dcp_reference(args, parallel: Parallel, config, full_sd: dict[str, Any],
                        placements: dict[str, str], meshes: dict[str, str]) -> None:
    """Rank 0: OUT.reference/{config.json, full.pt, objects.pt, reference.json}.

    config.json is the HF config for the Llama, and the sizes plus
    ``"model": "moe"`` for the MoE model (it has no HF config).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ref = reference_dir(args.out)
    ref.mkdir(parents=True, exist_ok=True)
    if args.model == "llama":
        config.save_pretrained(ref)
    else:
        (ref / "config.json").write_text(json.dumps({"model": "moe", **config}, indent=2) + "\n")

    tensors, objects = split_tensors(flatten(full_sd))
    torch.save(tensors, ref / "full.pt")
    torch.save(objects, ref / "objects.pt")

    # Cross-check: our flattened keys must be exactly the keys DCP wrote.
    md = FileSystemReader(args.out).read_metadata().state_dict_metadata
    disk_tensors = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    disk_objects = set(md) - disk_tensors
    if disk_tensors != set(tensors) or disk_objects != set(objects):
        raise SystemExit(
            "reference keys differ from DCP metadata keys: "
            f"tensors only on disk {sorted(disk_tensors - set(tensors))[:5]}, "
            f"only in reference {sorted(set(tensors) - disk_tensors)[:5]}; "
            f"objects only on disk {sorted(disk_objects - set(objects))[:5]}, "
            f"only in reference {sorted(set(objects) - disk_objects)[:5]}")

    info = {
        "model": args.model,
        "world_size": dist.get_world_size(),
        **parallel.as_dict(),
        "layout": args.layout,
        "dtype": args.dtype,
        "steps": args.steps,
        "placements": placements,
        "meshes": meshes,
    }
    (ref / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"reference: {len(tensors)} tensors, {len(objects)} objects -> {ref}")


# ---------------------------------------------------------------------------
# Subcommand: load-dcp
# ---------------------------------------------------------------------------


def infer_dtype(expected: dict[str, torch.Tensor]) -> torch.dtype:
    """The model dtype recorded in a reference (from its embedding weight)."""
    for key, value in expected.items():
        if key.endswith(("embed_tokens.weight", "tok_embeddings.weight")):
            return value.dtype
    return next(v.dtype for v in expected.values() if v.is_floating_point() and v.dim() > 0)


def reference_model(ref: Path) -> str:
    """The --model a reference folder was saved with (older ones: llama)."""
    info = ref / "reference.json"
    return json.loads(info.read_text()).get("model", "llama") if info.is_file() else "llama"


def cmd_load_dcp(args) -> int:
    timer = Timer()
    expected = torch.load(args.expect, map_location="cpu", weights_only=True)
    ref = Path(args.expect).parent
    kind = args.model or reference_model(ref)
    config_spec = args.model_config
    if config_spec is None and (ref / "config.json").is_file():
        config_spec = str(ref / "config.json")
    config = load_config(kind, config_spec)
    parallel = parallel_of(args)
    model, optimizer, _, _ = build_job_model(kind, config, infer_dtype(expected), parallel,
                                             LOADER_SEED)
    timer.mark("build")

    if args.save_layout:
        # What a trainer on this mesh writes: its own state, optimizer state
        # included (hence the step), in the same layout as the checkpoint.
        synthetic_step(model, optimizer)
        dcp.save(dcp_state(model, optimizer, args.layout, model_only=args.model_only),
                 checkpoint_id=args.save_layout)
        log(f"saved this mesh's own checkpoint to {args.save_layout}")
        timer.mark("dcp.save own layout")

    # Non-tensor placeholders that the load must overwrite.
    sd = dcp_state(model, optimizer, args.layout, model_only=args.model_only,
                   train_state={"step": -1, "note": ""}, lr_state={"last_epoch": -1})
    dcp.load(sd, checkpoint_id=args.ckpt)
    timer.mark("dcp.load")

    flat = flatten(sd)
    tensors, objects = split_tensors(flat)
    if objects:
        log("non-tensor entries: " + ", ".join(
            f"{k}={v!r}" for k, v in sorted(objects.items()) if "param_groups" not in k))

    first = None
    # Non-tensor leaves: compare with objects.pt when the reference has one.
    expected_objects = {}
    if (ref / "objects.pt").is_file():
        expected_objects = torch.load(ref / "objects.pt", weights_only=True)
    for key in sorted(objects):
        if key in expected_objects and objects[key] != expected_objects[key]:
            first = f"{key}: {objects[key]!r} != {expected_objects[key]!r}"
            break
    if first is None and not args.model_only and sd["train_state"]["step"] != TRAIN_STATE["step"]:
        first = f"train_state.step: {sd['train_state']['step']!r}"
    # Every reference tensor must have been requested (model part only with --model-only).
    optim_prefix = "optimizer." if args.layout == "torchtitan" else "dcp.optim."
    unchecked = sorted(k for k in set(expected) - set(tensors)
                       if not (args.model_only and k.startswith(optim_prefix)))
    if first is None and unchecked:
        first = f"{unchecked[0]}: in the reference but not in the loaded state dict"

    checked, first_tensor = compare_all(flat, expected)
    status = finish_check(first or first_tensor,
                          f"{checked} tensors + {len(objects)} objects on mesh "
                          f"{parallel.as_dict()} match {args.expect}")
    timer.mark("compare")
    if status == 0:
        # The trainer's way back into the modules must accept the loaded state.
        apply_dcp_state(model, optimizer, sd, args.layout, args.model_only)
        timer.mark("set_state_dict")
    log(f"load-dcp done ({timer})")
    return status


# ---------------------------------------------------------------------------
# FSDP1 (verl-style) helpers
# ---------------------------------------------------------------------------


def fsdp1_file(directory: str | os.PathLike, kind: str, world_size: int, r: int) -> Path:
    """verl's per-rank file name, e.g. model_world_size_2_rank_0.pt."""
    return Path(directory) / f"{kind}_world_size_{world_size}_rank_{r}.pt"


def build_fsdp1_model(config, world_size: int, values: str, seed: int):
    """FSDP1 over the whole world; one FSDP unit per decoder layer plus root.

    ``values="dtensor"`` passes a 1-D device mesh, which makes
    SHARDED_STATE_DICT values DTensors (as verl writes); without a mesh they
    are ShardedTensors.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    if dist.get_world_size() != world_size:
        raise SystemExit(f"--world-size {world_size} != torchrun world {dist.get_world_size()}")
    model = build_model(config, torch.float32, seed)
    kwargs = {}
    if values == "dtensor":
        kwargs["device_mesh"] = init_device_mesh("cpu", (world_size,))
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
        **kwargs,
    )


# NOTE: every FSDP1 state-dict config below uses offload_to_cpu=False.  The
# parameters already live on CPU, and with offload_to_cpu=True FSDP1's
# FULL_STATE_DICT post-hook segfaults on rank 0 in a CPU-only job (torch
# 2.13, SIGSEGV inside its ``state_dict[fqn].detach().clone()``; most likely
# the "offload" frees the unsharded flat parameter that the CPU "copy" still
# aliases, since both are the same CPU storage).


def fsdp1_full_state(model) -> dict[str, torch.Tensor]:
    """FULL_STATE_DICT gathered by FSDP itself (values on rank 0 only)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        return model.state_dict()


def fsdp1_full_optim_state(model, optimizer) -> dict[str, Any]:
    """Full (unsharded) optimizer state, rank 0 only, nested by FQN."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        return FSDP.optim_state_dict(model, optimizer)


def sharded_ctx(model):
    from torch.distributed.fsdp import (
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                ShardedStateDictConfig(offload_to_cpu=False),
                                ShardedOptimStateDictConfig(offload_to_cpu=False))


def type_name(value: Any) -> str:
    return type(value).__module__ + "." + type(value).__qualname__


def describe_value(value: Any) -> str:
    """Type of a sharded state-dict value plus where this rank's shard sits."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(value, ShardedTensor):
        shards = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes))
                  for s in value.local_shards()]
        return f"{type_name(value)} size {tuple(value.size())} local (offsets, sizes) {shards}"
    if isinstance(value, DTensor):
        return (f"{type_name(value)} shape {tuple(value.shape)} {tuple(value.placements)} "
                f"local {tuple(value.to_local().shape)}")
    return type_name(value)


# ---------------------------------------------------------------------------
# Subcommand: save-fsdp1
# ---------------------------------------------------------------------------


def cmd_save_fsdp1(args) -> int:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    timer = Timer()
    config = load_model_config(args.model_config)
    W = args.world_size
    model = build_fsdp1_model(config, W, args.values, MODEL_SEED)
    optimizer = make_optimizer(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    timer.mark("build")
    losses = train_steps(model, optimizer, config, args.steps, rank())
    scheduler.step()
    log(f"losses {losses}")
    timer.mark("train")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    r = rank()
    with sharded_ctx(model):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, optimizer)
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        log(f"sharded value {key}: {describe_value(model_sd[key])}", all_ranks=True)
    torch.save(model_sd, fsdp1_file(out, "model", W, r))
    torch.save(optim_sd, fsdp1_file(out, "optim", W, r))
    extra = {
        "lr_scheduler": scheduler.state_dict(),
        "rng": {"cpu": torch.get_rng_state(), "random": random.getstate()},
    }
    torch.save(extra, fsdp1_file(out, "extra_state", W, r))
    timer.mark("torch.save shards")

    # Reference, gathered by FSDP itself (collective: every rank calls it).
    full_model = fsdp1_full_state(model)
    full_optim = fsdp1_full_optim_state(model, optimizer)
    if r == 0:
        (out / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 1, "world_size": W}) + "\n")
        config.save_pretrained(out / "huggingface")
        ref = reference_dir(out)
        ref.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(ref)
        torch.save(dict(full_model), ref / "full.pt")
        # Optimizer reference: "state.<fqn>.{step,exp_avg,exp_avg_sq}".
        optim_tensors, _ = split_tensors(flatten(full_optim["state"], "state"))
        torch.save(optim_tensors, ref / "full_optim.pt")
        (ref / "reference.json").write_text(json.dumps({
            "world_size": W,
            "fsdp_version": 1,
            "values": args.values,
            "value_type": type_name(model_sd["model.embed_tokens.weight"]),
        }, indent=2) + "\n")
    dist.barrier()
    timer.mark("reference")
    log(f"save-fsdp1 done: {out} ({timer})")
    return 0


# ---------------------------------------------------------------------------
# Subcommand: load-fsdp1
# ---------------------------------------------------------------------------


def cmd_load_fsdp1(args) -> int:
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    timer = Timer()
    W = args.world_size
    r = rank()
    directory = Path(args.dir)
    config_spec = args.model_config
    if config_spec is None and (directory / "huggingface" / "config.json").is_file():
        config_spec = str(directory / "huggingface" / "config.json")
    config = load_model_config(config_spec)

    # weights_only=False: these are our own files, and ShardedTensor / DTensor
    # values need full unpickling.  (ShardedTensor unpickling also insists on
    # an initialized process group with the same rank and world size as at
    # save time, so these files can only be torch.load-ed inside such a job.)
    model_sd = torch.load(fsdp1_file(directory, "model", W, r), weights_only=False)
    optim_path = fsdp1_file(directory, "optim", W, r)
    values = args.values
    if values == "auto":
        sample = model_sd["model.embed_tokens.weight"]
        if not isinstance(sample, (DTensor, ShardedTensor)):
            raise SystemExit(f"unexpected value type {type_name(sample)}")
        values = "dtensor" if isinstance(sample, DTensor) else "sharded_tensor"
    log(f"values: {values}")

    model = build_fsdp1_model(config, W, values, LOADER_SEED)
    optimizer = make_optimizer(model)
    timer.mark("build")
    first = None
    with sharded_ctx(model):
        result = model.load_state_dict(model_sd)
        if optim_path.is_file():
            optim_sd = torch.load(optim_path, weights_only=False)
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, optim_sd))
    if result.missing_keys or result.unexpected_keys:
        first = f"load_state_dict: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
    timer.mark("load_state_dict")

    # Gather with FSDP itself (collectives on all ranks), compare on rank 0.
    checked = 0
    full = fsdp1_full_state(model)
    full_optim = fsdp1_full_optim_state(model, optimizer) if optim_path.is_file() else None
    if r == 0 and first is None:
        expected = torch.load(args.expect, map_location="cpu", weights_only=True)
        got = dict(full)
        optim_ref = Path(args.expect).parent / "full_optim.pt"
        if full_optim is not None and optim_ref.is_file():
            expected.update(torch.load(optim_ref, map_location="cpu", weights_only=True))
            got.update(split_tensors(flatten(full_optim["state"], "state"))[0])
        # FSDP1 FQNs (use_orig_params=True) are already the HF names.
        if set(got) != set(expected):
            first = (f"key sets differ: only loaded {sorted(set(got) - set(expected))[:5]}, "
                     f"only expected {sorted(set(expected) - set(got))[:5]}")
        else:
            for key in sorted(got):
                checked += 1
                reason = compare_tensor(key, got[key], expected[key])
                if reason is not None:
                    first = f"{key}: {reason}"
                    break
    status = finish_check(first, f"{checked} gathered FSDP1 tensors match {args.expect}")
    timer.mark("compare")
    log(f"load-fsdp1 done ({timer})")
    return status


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_opts(p, default_note=""):
        p.add_argument("--model-config", default=None,
                       help='preset name ("tiny"), JSON string, or path to a config.json; '
                            "JSON overrides the tiny preset (TINY_LLAMA or TINY_MOE)"
                            + default_note)

    def mesh_opts(p):
        p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
        p.add_argument("--dp", type=int, required=True, help="FSDP shard degree (dp_shard)")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--ep", type=int, default=1,
                       help="expert parallel degree (--model moe); borrows dp (and tp) ranks")
        p.add_argument("--etp", type=int, default=None,
                       help="tensor parallel degree of the experts: 1 or --tp (default)")

    p = sub.add_parser("save-dcp", help="FSDP2(+TP/EP) job that writes a DCP checkpoint")
    p.add_argument("out")
    p.add_argument("--model", choices=MODELS, default="llama")
    mesh_opts(p)
    p.add_argument("--layout", choices=("torchtitan", "areal"), default="torchtitan")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    model_opts(p)
    p.set_defaults(func=cmd_save_dcp)

    p = sub.add_parser("load-dcp", help="load a DCP checkpoint (any mesh) and verify it")
    p.add_argument("ckpt")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="default: the model in reference.json next to --expect, else llama")
    mesh_opts(p)
    p.add_argument("--expect", required=True, help="full.pt with flat '.'-joined keys")
    p.add_argument("--layout", choices=("torchtitan", "areal"), default="torchtitan")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--save-layout", metavar="DIR", default=None,
                   help="first dcp.save this job's own state (after one step) to DIR, "
                        "as a trainer on this mesh would, then load and check CKPT")
    model_opts(p, " (default: config.json next to --expect, else tiny)")
    p.set_defaults(func=cmd_load_dcp)

    p = sub.add_parser("save-fsdp1", help="FSDP1 job that writes verl-style shards")
    p.add_argument("out")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--values", choices=("sharded_tensor", "dtensor"), default="sharded_tensor")
    p.add_argument("--steps", type=int, default=1)
    model_opts(p)
    p.set_defaults(func=cmd_save_fsdp1)

    p = sub.add_parser("load-fsdp1", help="load verl-style FSDP1 shards and verify them")
    p.add_argument("dir")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--expect", required=True, help="full.pt of the full model state dict")
    p.add_argument("--values", choices=("auto", "sharded_tensor", "dtensor"), default="auto",
                   help="how to build FSDP1 (auto: from the type of the saved values)")
    model_opts(p, " (default: DIR/huggingface/config.json, else tiny)")
    p.set_defaults(func=cmd_load_fsdp1)

    return parser.parse_args(argv)


THEN = "--then"  # separates the command lines of the steps of one job


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cuts = [-1] + [i for i, arg in enumerate(argv) if arg == THEN] + [len(argv)]
    steps = [parse_args(argv[start + 1:end]) for start, end in zip(cuts, cuts[1:])]  # every one before any runs
    init_distributed()
    status = 0
    try:
        for number, args in enumerate(steps):
            # The barriers keep what every rank prints for a step between its two lines.
            dist.barrier()
            log(f"== step {number} begins")
            step_status = args.func(args)
            dist.barrier()
            log(f"== step {number} exit {step_status}")
            status = status or step_status
    finally:
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    status = main()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception", SIGABRT) at random; everything is written and flushed by now, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
