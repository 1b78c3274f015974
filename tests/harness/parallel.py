"""Parallelism, as torchtitan lays it out: one root mesh, TP, EP and FSDP2 / HSDP on the models of
``harness.models``, and the placements a job logs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from harness.models import GroupedExperts, MoeTransformer, build_model, build_moe_model, make_optimizer
from harness.runtime import log


@dataclass
class Parallel:
    """A job's parallel degrees and its device meshes, as torchtitan's ParallelDims lays them out.

    Dense parameters see the ranks row-major over (dp_replicate, dp_shard, tp),
    or (dp_replicate, dp_shard, cp, tp) with context parallelism, whose FSDP
    shards over dp_shard and cp flattened (torchtitan's dp_shard_cp).
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
    cp: int = 1
    dense: DeviceMesh | None = None
    experts: DeviceMesh | None = None
    sharding: DeviceMesh | None = None  # with cp: (dp_replicate, dp_shard_cp, tp), dp_shard and cp flattened

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp * self.cp * self.tp

    @property
    def efsdp(self) -> int:
        """FSDP degree of the experts: what EP leaves of the ranks it borrows."""
        return self.dp * self.cp * (self.tp if self.etp == 1 else 1) // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        # As torchtitan: FSDP for dp_shard > 1 or cp > 1, and always with EP
        # (then possibly over a 1-rank dp mesh); pure TP jobs get no FSDP at all.
        return self.dp > 1 or self.cp > 1 or self.ep > 1

    def check(self) -> None:
        """Exit with a message if the degrees do not fit the job or each other."""
        if self.world_size != dist.get_world_size():
            raise SystemExit(f"dp_replicate*dp*cp*tp = {self.dp_replicate}*{self.dp}*{self.cp}*{self.tp} "
                             f"!= world size {dist.get_world_size()}")
        if self.etp not in (1, self.tp):
            raise SystemExit(f"--etp {self.etp} must be 1 or --tp ({self.tp})")
        borrowed = self.dp * self.cp * (self.tp if self.etp == 1 else 1)
        if self.ep > 1 and (borrowed % self.ep or (self.etp == 1 and self.ep % self.tp)):
            raise SystemExit(f"--ep {self.ep} with --etp {self.etp}: ep must divide the {borrowed} "
                             "dp_shard (x tp when etp=1) ranks it borrows, and with etp=1 be a "
                             "multiple of tp")
        if self.dp_replicate > 1 and not self.fsdp_enabled:
            raise SystemExit("--dp-replicate with --dp 1 is DDP in torchtitan, not emulated here")

    def build(self) -> Parallel:
        """Check the degrees and make the meshes; returns self."""
        self.check()
        root = init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("world",))
        if self.cp > 1:
            self.dense = root._unflatten(0, (self.dp_replicate, self.dp, self.cp, self.tp),
                                         ("dp_replicate", "dp_shard", "cp", "tp"))
            self.sharding = root._unflatten(0, (self.dp_replicate, self.dp * self.cp, self.tp),
                                            ("dp_replicate", "dp_shard_cp", "tp"))
        else:
            self.dense = self.sharding = root._unflatten(0, (self.dp_replicate, self.dp, self.tp),
                                                         ("dp_replicate", "dp_shard", "tp"))
        if self.ep > 1:
            sizes = (self.dp_replicate, self.efsdp, self.ep)
            names = ("dp_replicate", "efsdp", "ep")
            if self.etp > 1:
                sizes, names = sizes + (self.etp,), names + ("etp",)
            self.experts = root._unflatten(0, sizes, names)
        return self

    def dp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the dense parameters (dp_shard, with cp dp_shard_cp): 2-D for HSDP."""
        shard = "dp_shard_cp" if self.cp > 1 else "dp_shard"
        return self.sharding["dp_replicate", shard] if self.dp_replicate > 1 else self.sharding[shard]

    def edp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the routed experts under EP: 2-D for HSDP."""
        return self.experts["dp_replicate", "efsdp"] if self.dp_replicate > 1 else self.experts["efsdp"]

    def data_rank(self) -> int:
        """Which batch this rank trains on (TP peers share one)."""
        return (self.dense.get_local_rank("dp_replicate") * self.dp
                + self.dense.get_local_rank("dp_shard"))

    def as_dict(self) -> dict[str, int]:
        """The degrees, as references record them."""
        return {"dp_replicate": self.dp_replicate, "dp": self.dp, "cp": self.cp, "tp": self.tp,
                "ep": self.ep, "etp": self.etp}


def parallel_of(args) -> Parallel:
    """The mesh options of a save-dcp / load-dcp command line (--etp defaults to --tp)."""
    etp = args.tp if args.etp is None else args.etp
    return Parallel(args.dp_replicate, args.dp, args.tp, args.ep, etp, args.cp)


def apply_tp(model: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallelism on the HF Llama (transformers' or ``llama_skeleton``).

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
        if not block.moe_enabled or block.moe.shared_experts is not None:  # an MoE may have no shared expert
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


def parallelize(model: torch.nn.Module, kind: str, parallel: Parallel) -> torch.nn.Module:
    """TP / EP, then FSDP2 (HSDP) of a ``kind`` model (llama: HF names; moe) on the built meshes of ``parallel``."""
    if kind == "llama":
        if parallel.ep > 1:
            raise SystemExit("--ep needs --model moe (the Llama has no experts)")
        if parallel.tp > 1:
            apply_tp(model, parallel.dense["tp"])
        blocks = list(model.model.layers)
    else:
        if parallel.tp > 1:
            apply_moe_tp(model, parallel.dense["tp"])
        blocks = list(model.layers.values())
        for block in blocks:
            if block.moe_enabled:
                apply_experts_parallel(block.moe.experts, parallel)
    apply_fsdp(model, blocks, parallel)
    return model


def build_fsdp2_model(kind: str, config, dtype: torch.dtype, parallel: Parallel, seed: int):
    """Model from ``seed`` -> TP / EP -> FSDP2 (HSDP) on the meshes of ``parallel`` (built here)."""
    parallel.build()
    model = build_model(config, dtype, seed) if kind == "llama" else build_moe_model(config, dtype, seed)
    return parallelize(model, kind, parallel)


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


def build_job_model(kind: str, config, dtype: torch.dtype, parallel: Parallel, seed: int):
    """build_fsdp2_model + optimizer, logging the meshes and placements on rank 0."""
    model = build_fsdp2_model(kind, config, dtype, parallel, seed)
    log(f"mesh {parallel.dense}" + (f", experts mesh {parallel.experts}" if parallel.experts else ""))
    placements, meshes = log_placements(model, kind)
    return model, make_optimizer(model), placements, meshes
