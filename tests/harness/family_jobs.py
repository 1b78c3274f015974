"""Real gloo jobs that save and load checkpoints named as AReaL Archon or torchtitan name them.

Run under torchrun from the repository root, with the tests folder on the path, for example::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 -m harness.family_jobs \
        save-family /tmp/ckpt --kind qwen3_moe --family archon --hf /tmp/hf --dp 2 --ep 2
    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 -m harness.family_jobs \
        load-family /tmp/ckpt --kind qwen3_moe --family archon --expect /tmp/hf --dp 2 --ep 2

Subcommands:

* ``save-family OUT``  Convert an HF folder's weights to the family's names with the
                       test oracle (harness.family_models), build a module tree with
                       exactly those names, shard it with FSDP2 (experts: EP Shard(0),
                       then FSDP on the rest), take one AdamW step on synthetic
                       gradients and ``dcp.save`` it in the family's layout:
                       archon ``{"dcp": {"model", "optim"}}``, torchtitan model keys at the top
                       level plus ``optimizer``, ``train_state``, ``lr_scheduler``
                       (optimizer state flattened by torch in both).  Rank 0 also
                       writes ``OUT.reference/`` (full.pt: the gathered state after the
                       step, keyed as on disk; objects.pt; config.json; reference.json).
* ``load-family CKPT`` Build the same sharded module from another seed, ``dcp.load`` the
                       model part of CKPT into it and compare every rank's local shards
                       bitwise with the oracle's conversion of ``--expect``'s weights.
                       With ``--expect-optim FILE`` it resumes model and AdamW state as the
                       family's engine does (AReaL's load_from_dcp: ``{"dcp": DCPState}``;
                       torchtitan: model keys at the top level plus ``optimizer``), applies
                       them with set_model_state_dict / set_optimizer_state_dict (strict) and
                       compares the optimizer state with FILE too.

Several command lines joined by ``--then`` run one after the other in one job (as in harness.gloo_jobs:
torch starts once; each step builds its own module and mesh; ``== step N ...`` lines tell them apart).

The module tree has parameters only (and expert_bias buffers): it never runs
forward, so what decides the checkpoint is its names, shapes and sharding.
Exit status 0 means success; 1 means a comparison failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from harness import family_models
from harness.models import LOADER_SEED, LR, MODEL_SEED, make_optimizer, synthetic_step
from harness.parallel import Parallel, placements_of
from harness.runtime import Timer, exit_now, log, rank, reference_dir, run_commands
from harness.states import (
    LR_SCHEDULER_STATE,
    TRAIN_STATE,
    compare_all,
    finish_check,
    flatten,
    split_tensors,
)

# Model state kept as persistent buffers, not parameters (torchtitan's MoE load-balancing bias).
BUFFER_SUFFIXES = (".expert_bias", ".expert_bias_E")


# ---------------------------------------------------------------------------
# The module tree and its sharding
# ---------------------------------------------------------------------------


def build_module(state: dict[str, torch.Tensor], tie: str | None) -> nn.Module:
    """A tree of plain modules whose state_dict keys are exactly ``state``'s names.

    ``tie`` names the output projection that shares the embedding's parameter
    (tied embeddings: both keys saved, one optimizer entry, as in a real run).
    """
    root = nn.Module()

    def owner(name: str) -> tuple[nn.Module, str]:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        return module, leaf

    for name, tensor in state.items():
        if name == tie:
            continue
        module, leaf = owner(name)
        if name.endswith(BUFFER_SUFFIXES):
            module.register_buffer(leaf, tensor.clone(), persistent=True)
        else:
            module.register_parameter(leaf, nn.Parameter(tensor.clone()))
    if tie is not None:
        module, leaf = owner(tie)
        module.register_parameter(leaf, root.tok_embeddings.weight)
    return root


def shard(model: nn.Module, parallel: Parallel) -> None:
    """FSDP2 per layer and at the root; 3-D expert weights first EP Shard(0), then FSDP on efsdp."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    if not parallel.fsdp_enabled:
        return
    dp_mesh = parallel.dp_mesh()
    for block in model.layers.children():
        experts = [m for m in block.modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]
        if experts and parallel.ep > 1:
            for module in experts:
                for name, param in list(module.named_parameters(recurse=False)):
                    local = distribute_tensor(param.detach(), parallel.experts["ep"], [Shard(0)])
                    module.register_parameter(name, nn.Parameter(local))
                num_experts = next(module.parameters()).shape[0]
                # As torchtitan: once efsdp * ep exceeds the expert count, FSDP shards dim 1.
                placement_fn = None
                if parallel.efsdp * parallel.ep > num_experts:
                    placement_fn = lambda param: Shard(1)  # noqa: E731
                fully_shard(module, mesh=parallel.edp_mesh(), shard_placement_fn=placement_fn)
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def build_sharded(state: dict[str, torch.Tensor], config: dict[str, Any], args) -> tuple[nn.Module, Parallel]:
    """build_module + shard on a fresh mesh from ``--dp`` / ``--ep``; logs the mesh and placements."""
    tie = "output.weight" if args.family == "archon" else "lm_head.weight"
    model = build_module(state, tie if config.get("tie_word_embeddings") else None)
    parallel = Parallel(dp_replicate=1, dp=args.dp, tp=1, ep=args.ep, etp=1).build()
    if parallel.ep > 1 and not any(p.dim() == 3 for p in model.parameters()):
        raise SystemExit(f"--ep {args.ep}: kind {args.kind} has no experts")
    shard(model, parallel)
    log(f"mesh {parallel.dense}" + (f", experts mesh {parallel.experts}" if parallel.experts else ""))
    placements, meshes = placements_of(model)
    for name in sorted(placements):
        if name.startswith("layers.") and not name.startswith("layers.1."):
            continue  # layer 1 (an MoE layer in every MoE model here) stands for the others
        log(f"placements {name}: {placements[name]} on mesh {meshes[name]}")
    return model, parallel


# ---------------------------------------------------------------------------
# Family layouts
# ---------------------------------------------------------------------------


def family_state(model: nn.Module, optimizer, family: str, full: bool = False) -> dict[str, Any]:
    """The nested state dict the family's trainer hands to dcp.save / dcp.load.

    ``optimizer=None`` gives the model part only.  ``full=True`` gives the
    gathered, CPU-offloaded version (values on rank 0) for the reference.
    """
    model_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    optim_sd = None
    if optimizer is not None:
        options = StateDictOptions(full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=True)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if family == "archon":  # AReaL's save_to_dcp: {"dcp": DCPState}, DCPState.state_dict() = {"model", "optim"}
        return {"dcp": {"model": model_sd} | ({"optim": optim_sd} if optim_sd is not None else {})}
    if optim_sd is None:
        return dict(model_sd)
    # torchtitan's CheckpointManager: ModelWrapper's keys at the top level (_flattened_model_states_sd)
    return {**model_sd, "optimizer": optim_sd, "train_state": dict(TRAIN_STATE),
            "lr_scheduler": dict(LR_SCHEDULER_STATE)}


def engine_state(model: nn.Module, optimizer, family: str) -> dict[str, Any]:
    """The state dict the family's engine hands dcp.load to resume model and optimizer.

    archon: AReaL's load_from_dcp, ``{"dcp": DCPState}``; torchtitan: CheckpointManager's states with the
    model flattened to the top level, its other entries left out (``checkpoint.exclude_from_loading``).
    Both flatten the optimizer state by parameter name, as their containers do.
    """
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    if family == "archon":
        return {"dcp": {"model": model_sd, "optim": optim_sd}}
    return {**model_sd, "optimizer": optim_sd}


def titan_resume(model: nn.Module, optimizer, ckpt: str) -> None:
    """torchtitan 0.3's own resume of model and optimizer (needs ``torchtitan`` importable): CheckpointManager
    hands dcp.load its ModelWrapper's state dict flattened to the top level beside the optimizer's Stateful
    (``_flattened_model_states_sd``), then loads the model through ModelWrapper.load_state_dict. Its
    OptimizersContainer is a Stateful over torchtitan's flat optimizer state dict; here over one AdamW."""
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.components.optimizer.utils import (
        get_flat_optim_state_dict,
        init_optim_state,
        load_flat_optim_state_dict,
    )

    class Optimizers(Stateful):  # OptimizersContainer.state_dict / load_state_dict, for one optimizer
        def state_dict(self):
            init_optim_state(optimizer)
            return get_flat_optim_state_dict(optimizer)

        def load_state_dict(self, state_dict):
            init_optim_state(optimizer)
            load_flat_optim_state_dict(optimizer, state_dict)

    wrapper = ModelWrapper(model)
    states = {**wrapper.state_dict(), "optimizer": Optimizers()}
    dcp.load(states, checkpoint_id=ckpt)
    wrapper.load_state_dict(states)


def apply_engine_state(model: nn.Module, optimizer, state: dict[str, Any], family: str) -> None:
    """What the engine does with the loaded state: DCPState.load_state_dict (strict), or torchtitan's
    ModelWrapper and OptimizersContainer load_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if family == "archon":
        model_sd, optim_sd = state["dcp"]["model"], state["dcp"]["optim"]
    else:
        model_sd = {k: v for k, v in state.items() if k != "optimizer"}
        optim_sd = state["optimizer"]
    set_model_state_dict(model, model_sd, options=StateDictOptions(strict=True))
    set_optimizer_state_dict(model, optimizer, optim_sd,
                             options=StateDictOptions(strict=True, flatten_optimizer_state_dict=True))


def random_like(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


# ---------------------------------------------------------------------------
# Subcommands
# ---------------------------------------------------------------------------


def cmd_save_family(args) -> int:
    timer = Timer()
    config = family_models.read_config(args.hf)
    state = family_models.hf_to_family(family_models.load_hf_state(args.hf), args.kind, args.family, config)
    state |= family_models.training_extras(state, args.kind, args.family, MODEL_SEED)
    model, parallel = build_sharded(state, config, args)
    optimizer = make_optimizer(model)
    synthetic_step(model, optimizer)
    timer.mark("build + step")

    dcp.save(family_state(model, optimizer, args.family), checkpoint_id=args.out)
    timer.mark("dcp.save")
    full = family_state(model, optimizer, args.family, full=True)
    if rank() == 0:
        write_reference(args, parallel, full, placements_of(model)[0])
    dist.barrier()
    timer.mark("reference")
    log(f"save-family done: {args.out} ({timer})")
    return 0


def write_reference(args, parallel: Parallel, full: dict[str, Any], placements: dict[str, str]) -> None:
    """Rank 0: OUT.reference/{full.pt, objects.pt, config.json, reference.json}, keys as on disk."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ref = reference_dir(args.out)
    ref.mkdir(parents=True, exist_ok=True)
    tensors, objects = split_tensors(flatten(full))
    torch.save(tensors, ref / "full.pt")
    torch.save(objects, ref / "objects.pt")
    shutil.copy(Path(args.hf) / "config.json", ref / "config.json")

    md = FileSystemReader(args.out).read_metadata().state_dict_metadata
    on_disk = {k for k, v in md.items() if isinstance(v, TensorStorageMetadata)}
    if on_disk != set(tensors) or set(md) - on_disk != set(objects):
        raise SystemExit(f"reference keys differ from the DCP metadata: "
                         f"{sorted(set(md) ^ (set(tensors) | set(objects)))[:5]}")
    info = {"kind": args.kind, "family": args.family, "hf": str(args.hf),
            "world_size": dist.get_world_size(), **parallel.as_dict(), "placements": placements}
    (ref / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    log(f"reference: {len(tensors)} tensors, {len(objects)} objects -> {ref}")


def cmd_load_family(args) -> int:
    timer = Timer()
    config = family_models.read_config(args.expect)
    expected = family_models.hf_to_family(family_models.load_hf_state(args.expect), args.kind,
                                          args.family, config)
    model, parallel = build_sharded(random_like(expected, LOADER_SEED), config, args)
    timer.mark("build")

    expected = family_models.layout_keys(expected, args.family)
    if args.expect_optim:  # resume model and optimizer as the engine does
        if args.torchtitan_code:  # torchtitan builds its optimizers on (name, param) pairs
            optimizer = torch.optim.AdamW(list(model.named_parameters()), lr=LR, weight_decay=0.01, foreach=False)
            titan_resume(model, optimizer, args.ckpt)
        else:
            optimizer = make_optimizer(model)
            synthetic_step(model, optimizer)  # the state a resuming job has before it loads
            sd = engine_state(model, optimizer, args.family)
            dcp.load(sd, checkpoint_id=args.ckpt)
            apply_engine_state(model, optimizer, sd, args.family)
        sd = engine_state(model, optimizer, args.family)  # what the model and optimizer now hold
        expected |= torch.load(args.expect_optim, weights_only=True)
    else:
        sd = family_state(model, None, args.family)
        dcp.load(sd, checkpoint_id=args.ckpt)
    timer.mark("dcp.load")

    checked, first = compare_all(flatten(sd), expected)
    status = finish_check(first, f"{checked} tensors on mesh {parallel.as_dict()} match "
                                 f"{args.expect} as {args.family} names")
    log(f"load-family done ({timer})")
    return status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--kind", choices=family_models.KINDS, required=True)
        p.add_argument("--family", choices=family_models.FAMILIES, required=True)
        p.add_argument("--dp", type=int, required=True, help="FSDP shard degree (= world size)")
        p.add_argument("--ep", type=int, default=1, help="expert parallel degree (borrows dp ranks)")

    p = sub.add_parser("save-family", help="FSDP2(+EP) job that writes a family-named DCP checkpoint")
    p.add_argument("out")
    p.add_argument("--hf", required=True, help="HF folder (safetensors + config.json) with the weights")
    common(p)
    p.set_defaults(func=cmd_save_family)

    p = sub.add_parser("load-family", help="load a family-named DCP checkpoint and check it")
    p.add_argument("ckpt")
    p.add_argument("--expect", required=True, help="HF folder whose weights CKPT must hold")
    p.add_argument("--torchtitan-code", action="store_true",
                   help="with --expect-optim and --family torchtitan: resume with torchtitan's own ModelWrapper and "
                        "flat optimizer state dict (torchtitan must be importable)")
    p.add_argument("--expect-optim", help="torch.save'd {key as the family's engine loads it: full tensor} of the "
                                          "optimizer state CKPT must hold; loads model and optimizer as the engine does")
    common(p)
    p.set_defaults(func=cmd_load_family)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the steps of the command line (joined by --then) in one job; 0 if every step passed."""
    return run_commands(parse_args, argv)


if __name__ == "__main__":
    exit_now(main())
