"""verl's FSDP1 checkpoint save and resume, in real gloo jobs on CPU, for testing dcptool.

Run under torchrun from the repository root, with the tests folder on the path (``PYTHONPATH=tests``);
``JOB`` stands for ``python -m torch.distributed.run --standalone --nproc-per-node``::

    JOB 2 -m harness.verl_jobs save OUT [--by-name] [--dtensor] [--flat-params]
    JOB 4 -m harness.verl_jobs resume-verl DIR RESULT.json [--dtensor] [--orig-params]
    JOB 4 -m harness.verl_jobs resume DIR RESULT.json
    JOB 4 -m harness.verl_jobs resume-fsdp2 DIR RESULT.json

``save`` trains two steps of a tiny model under FSDP1 and saves it as verl's
``FSDPCheckpointManager.save_checkpoint`` does (verl/utils/checkpoint/fsdp_checkpoint_manager.py):
inside ``FSDP.state_dict_type(model, SHARDED_STATE_DICT, ShardedStateDictConfig(),
ShardedOptimStateDictConfig())`` every rank ``torch.save``s ``model.state_dict()``, the optimizer
state and ``{"lr_scheduler": ..., "rng": ...}`` to ``{model,optim,extra_state}_world_size_W_rank_r.pt``;
rank 0 writes ``fsdp_config.json`` and ``huggingface/``. The optimizer state is verl's plain
``optimizer.state_dict()`` (with ``use_orig_params=True``: 1-D pieces of each flattened parameter,
keyed by position; with ``--flat-params``, verl's default ``use_orig_params=False``: each FSDP
unit's shard of its flat parameter), or with ``--by-name`` ``FSDP.optim_state_dict`` (keyed by
name, moments sharded like their parameters). ``--dtensor`` gives FSDP1 verl's device mesh
(``init_device_mesh("cpu", (W,), mesh_dim_names=("fsdp",))``: DTensor values). Rank 0 also writes
``OUT.full.pt``: the model, optimizer and scheduler state gathered in full (FULL_STATE_DICT), for a
reference run.

``resume-verl`` loads those files at the torchrun world size exactly as verl's ``load_checkpoint``
does: FSDP1 built as verl builds it (``--dtensor``: with its device mesh; ``--orig-params``:
``use_orig_params=True``, else verl's default False), each rank's files ``torch.load``ed, then
under SHARDED_STATE_DICT ``model.load_state_dict`` and ``optimizer.load_state_dict`` of them as
they are; the scheduler from the extra state. ``resume`` instead puts the optimizer file through
``FSDP.optim_state_dict_to_load`` (the ``named`` form, on FSDP1 without a mesh, use_orig_params).
``save-fsdp2`` and ``resume-fsdp2`` are verl's FSDP2 save and load (``fully_shard`` on verl's mesh).
All resumes take one training step and write its losses (before and after the step) to RESULT.json.
Command lines joined by ``--then`` run one after the other in one job (torch starts once); each builds its own
model from its own seed, as it would in a job of its own::

    JOB 2 -m harness.verl_jobs save A --dtensor --flat-params --then save B --then save-fsdp2 C
``reference(full.pt)`` is the same step, in one process without FSDP, from the full state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from harness.runtime import exit_now, run_steps

BATCH = torch.arange(4 * 6).reshape(4, 6) % 11  # the global batch: every world size dividing 4 sees the same rows


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.back = torch.nn.Linear(6, 8, bias=False)

    def forward(self, x):
        return x + self.back(torch.tanh(self.norm(self.proj(x))))


class Net(torch.nn.Module):
    """11 and 5 rows: uneven shards over 2 and 4 ranks (a rank of 4 holds no row of ``head``)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 5)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_of(model, ids) -> torch.Tensor:
    return model(ids).float().pow(2).mean()


def make_training(model):
    """AdamW and a scheduler whose state matters: the step after resuming uses the resumed lr."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return optimizer, scheduler


def step(model, optimizer, scheduler, ids) -> tuple[float, float]:
    """One training step: the loss before it (a mean over the rank's rows) and after it."""
    optimizer.zero_grad()
    loss = loss_of(model, ids)
    loss.backward()
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        after = loss_of(model, ids)
    return loss.item(), after.item()


def build_fsdp1(seed: int, values: str, orig_params: bool = True):
    """FSDP1 as verl's fsdp_workers builds it: each Block a unit of its own (verl: transformer_auto_wrap_policy
    over the decoder-layer class), and for DTensor values verl's create_device_mesh (a 1-D mesh named fsdp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    mesh = {"device_mesh": init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))}
    return FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=orig_params,
                device_id=torch.device("cpu"), **(mesh if values == "dtensor" else {}))


def sharded(model):
    """verl's ``get_fsdp_state_ctx(model, SHARDED_STATE_DICT, ShardedStateDictConfig, ShardedOptimStateDictConfig)``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=False),
                                ShardedOptimStateDictConfig(offload_to_cpu=False))


def rows_of_rank(ids: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    return ids.chunk(dist.get_world_size())[dist.get_rank()]


def job_save(out: Path, values: str, by_name: bool, orig_params: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp1(seed=0, values=values, orig_params=orig_params)
    optimizer, scheduler = make_training(model)
    for _ in range(2):
        step(model, optimizer, scheduler, rows_of_rank((BATCH + 1) % 11))
    with sharded(model):
        model_state = model.state_dict()
        # verl's call: the plain optimizer state (of flat parameters, or of each parameter's 1-D piece).
        optim_state = FSDP.optim_state_dict(model, optimizer) if by_name else optimizer.state_dict()
    extra = {"lr_scheduler": scheduler.state_dict(), "rng": {"cpu": torch.get_rng_state()}}
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, out / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(optim_state, out / f"optim_world_size_{world}_rank_{rank}.pt")
    torch.save(extra, out / f"extra_state_world_size_{world}_rank_{rank}.pt")
    full_config = (FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                   FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *full_config):
        full_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full_optim = FSDP.optim_state_dict(model, optimizer)
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": world}))
        (out / "huggingface").mkdir(exist_ok=True)
        (out / "huggingface" / "config.json").write_text(json.dumps({"model_type": "tiny"}))
        torch.save({"model": full_model, "optimizer": full_optim, "lr_scheduler": scheduler.state_dict()},
                   out.parent / f"{out.name}.full.pt")
    dist.barrier()


def build_fsdp2(seed: int):
    """FSDP2 as verl's apply_fsdp2 builds it: ``fully_shard`` each Block, then the root, on verl's
    create_device_mesh (a 1-D mesh of the world named fsdp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    torch.manual_seed(seed)
    model = Net()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def job_save_fsdp2(out: Path) -> None:
    """verl's FSDP2 save (``fsdp_version == 2``): plain ``model.state_dict()`` / ``optimizer.state_dict()``
    (DTensor values; the optimizer keyed by parameter position), as its checkpoint manager calls them
    outside any state-dict context."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp2(seed=0)
    optimizer, scheduler = make_training(model)
    for _ in range(2):
        step(model, optimizer, scheduler, rows_of_rank((BATCH + 1) % 11))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(optimizer.state_dict(), out / f"optim_world_size_{world}_rank_{rank}.pt")
    torch.save({"lr_scheduler": scheduler.state_dict(), "rng": {"cpu": torch.get_rng_state()}},
               out / f"extra_state_world_size_{world}_rank_{rank}.pt")
    full = StateDictOptions(full_state_dict=True)
    full_model = get_model_state_dict(model, options=full)
    full_optim = get_optimizer_state_dict(model, optimizer, options=full)
    if rank == 0:
        (out / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
        torch.save({"model": full_model, "optimizer": full_optim, "lr_scheduler": scheduler.state_dict()},
                   out.parent / f"{out.name}.full.pt")
    dist.barrier()


def job_resume(folder: Path, result: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp1(seed=1234, values="sharded_tensor")  # other values than the saved ones
    optimizer, scheduler = make_training(model)
    config = json.loads((folder / "fsdp_config.json").read_text())
    assert config["world_size"] == world, f"fsdp_config.json says world size {config['world_size']}, job has {world}"
    with sharded(model):
        # weights_only=False, as verl loads them: ShardedTensor values need the full unpickler.
        model.load_state_dict(torch.load(folder / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False))
        saved = torch.load(folder / f"optim_world_size_{world}_rank_{rank}.pt", weights_only=False)
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, saved))
    extra = torch.load(folder / f"extra_state_world_size_{world}_rank_{rank}.pt", weights_only=False)
    scheduler.load_state_dict(extra["lr_scheduler"])
    write_losses(result, step(model, optimizer, scheduler, rows_of_rank(BATCH)), extra, scheduler)


def job_resume_verl(folder: Path, result: Path, values: str, orig_params: bool) -> None:
    """verl's FSDPCheckpointManager.load_checkpoint: every file as torch.load gives it, loaded directly."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_fsdp1(seed=1234, values=values, orig_params=orig_params)  # other values than the saved ones
    optimizer, scheduler = make_training(model)
    model_state = torch.load(folder / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False)
    optim_state = torch.load(folder / f"optim_world_size_{world}_rank_{rank}.pt", weights_only=False)
    extra = torch.load(folder / f"extra_state_world_size_{world}_rank_{rank}.pt", weights_only=False)
    with sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
    scheduler.load_state_dict(extra["lr_scheduler"])
    write_losses(result, step(model, optimizer, scheduler, rows_of_rank(BATCH)), extra, scheduler)


def job_resume_fsdp2(folder: Path, result: Path) -> None:
    """verl's FSDPCheckpointManager.load_checkpoint of an FSDP2 model: every file as torch.load gives it,
    loaded directly by ``model.load_state_dict`` and ``optimizer.load_state_dict``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    config = json.loads((folder / "fsdp_config.json").read_text())
    assert config == {"FSDP_version": 2, "world_size": world}, f"fsdp_config.json says {config}, the job has {world}"
    model = build_fsdp2(seed=1234)  # other values than the saved ones
    optimizer, scheduler = make_training(model)
    model.load_state_dict(torch.load(folder / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False))
    optimizer.load_state_dict(torch.load(folder / f"optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
    extra = torch.load(folder / f"extra_state_world_size_{world}_rank_{rank}.pt", weights_only=False)
    scheduler.load_state_dict(extra["lr_scheduler"])
    write_losses(result, step(model, optimizer, scheduler, rows_of_rank(BATCH)), extra, scheduler)


def write_losses(result: Path, losses: tuple[float, float], extra: dict, scheduler) -> None:
    import torch.distributed as dist

    # Every rank's mean over equally many rows: their mean is the loss over the global batch.
    total = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"losses": (total / dist.get_world_size()).tolist(), "extra_keys": sorted(extra),
                                      "lr": scheduler.get_last_lr()}))
    dist.barrier()


def reference(full: Path) -> dict:
    """The resumed step in one process without FSDP, from the state gathered in full."""
    state = torch.load(full, weights_only=True)
    torch.manual_seed(0)
    model = Net()
    model.load_state_dict(state["model"])
    optimizer, scheduler = make_training(model)
    names = [name for name, _ in model.named_parameters()]
    saved = state["optimizer"]
    # Positions in the model's order, which load_state_dict pairs with the parameters (FSDP1 lists flat ones by unit).
    groups = [{**group, "params": sorted(names.index(fqn) for fqn in group["params"])} for group in saved["param_groups"]]
    # FSDP1 gathers one step tensor per flat parameter, which its parameters' entries share (and torch.save
    # keeps shared): each parameter gets its own, as AdamW counts its steps in place.
    own = {names.index(fqn): {k: v.clone() for k, v in value.items()} for fqn, value in saved["state"].items()}
    optimizer.load_state_dict({"state": own, "param_groups": groups})
    scheduler.load_state_dict(state["lr_scheduler"])
    before, after = step(model, optimizer, scheduler, BATCH)
    return {"losses": [before, after], "lr": scheduler.get_last_lr()}


def parse(argv: list[str]):
    """One step's command line, as the call that runs it."""
    values = "dtensor" if "--dtensor" in argv else "sharded_tensor"
    jobs = {
        "save": lambda: job_save(Path(argv[1]), values, "--by-name" in argv, orig_params="--flat-params" not in argv),
        "save-fsdp2": lambda: job_save_fsdp2(Path(argv[1])),
        "resume-verl": lambda: job_resume_verl(Path(argv[1]), Path(argv[2]), values,
                                               orig_params="--orig-params" in argv),
        "resume": lambda: job_resume(Path(argv[1]), Path(argv[2])),
        "resume-fsdp2": lambda: job_resume_fsdp2(Path(argv[1]), Path(argv[2])),
    }
    if not argv or argv[0] not in jobs:
        raise SystemExit(f"unknown job {' '.join(argv)!r}: {', '.join(jobs)}")
    return jobs[argv[0]]


if __name__ == "__main__":
    exit_now(run_steps(sys.argv[1:], parse))  # exit_now: gloo's threads can abort the interpreter's teardown
