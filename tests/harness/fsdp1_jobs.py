"""The FSDP1 jobs of ``gloo_jobs``: ``save-fsdp1`` writes SHARDED_STATE_DICT per-rank ``torch.save`` files
named as verl names them, ``load-fsdp1`` loads such files into a real FSDP1 job and checks what FSDP
gathers of them.

Every FSDP1 state-dict config here uses offload_to_cpu=False.  The parameters
already live on CPU, and with offload_to_cpu=True FSDP1's FULL_STATE_DICT
post-hook segfaults on rank 0 in a CPU-only job (torch 2.13, SIGSEGV inside
its ``state_dict[fqn].detach().clone()``; most likely the "offload" frees the
unsharded flat parameter that the CPU "copy" still aliases, since both are the
same CPU storage).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from harness.models import LOADER_SEED, MODEL_SEED, build_model, load_model_config, make_optimizer, train_steps
from harness.runtime import Timer, log, rank, reference_dir
from harness.states import compare_tensor, finish_check, flatten, split_tensors


def fsdp1_file(directory: str | os.PathLike, kind: str, world_size: int, r: int) -> Path:
    """verl's per-rank file name, e.g. model_world_size_2_rank_0.pt."""
    return Path(directory) / f"{kind}_world_size_{world_size}_rank_{r}.pt"


def build_fsdp1_model(config, world_size: int, values: str, seed: int):
    """FSDP1 over the whole world; one FSDP unit per decoder layer plus root.

    ``values="dtensor"`` passes a 1-D device mesh, which makes
    SHARDED_STATE_DICT values DTensors (as verl writes); without a mesh they
    are ShardedTensors.
    """
    if dist.get_world_size() != world_size:
        raise SystemExit(f"--world-size {world_size} != torchrun world {dist.get_world_size()}")
    kwargs = {}
    if values == "dtensor":
        kwargs["device_mesh"] = init_device_mesh("cpu", (world_size,))
    return wrap_fsdp1(build_model(config, torch.float32, seed), **kwargs)


def wrap_fsdp1(model, **kwargs):
    """``model`` under FSDP1 as these jobs wrap it (``kwargs``: its mesh or process group)."""
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        use_orig_params=True,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def fsdp1_full_state(model) -> dict[str, torch.Tensor]:
    """FULL_STATE_DICT gathered by FSDP itself (values on rank 0 only)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        return model.state_dict()


def fsdp1_full_optim_state(model, optimizer) -> dict[str, Any]:
    """Full (unsharded) optimizer state, rank 0 only, nested by FQN."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        return FSDP.optim_state_dict(model, optimizer)


def sharded_ctx(model):
    """FSDP1's SHARDED_STATE_DICT context for the model and the optimizer state."""
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                ShardedStateDictConfig(offload_to_cpu=False),
                                ShardedOptimStateDictConfig(offload_to_cpu=False))


def type_name(value: Any) -> str:
    """The qualified name of ``value``'s type."""
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


def cmd_save_fsdp1(args) -> int:
    """Train under FSDP1 and save each rank's model, optimizer and extra state as verl does, plus the
    reference FSDP gathers in full."""
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
    alone = [dist.new_group([peer]) for peer in range(W)][r]  # every rank makes every group
    if r == 0:
        # FSDP1's own names of its parameters (``_fsdp_wrapped_module.``, as named_parameters gives them outside
        # summon_full_params), with whole values: the trained weights wrapped again over a group of this rank alone.
        again = build_model(config, torch.float32, LOADER_SEED)
        again.load_state_dict(full_model)
        named = {name: value.detach().clone() for name, value in wrap_fsdp1(again, process_group=alone).named_parameters()}
        (out / "fsdp_config.json").write_text(
            json.dumps({"FSDP_version": 1, "world_size": W}) + "\n")
        config.save_pretrained(out / "huggingface")
        ref = reference_dir(out)
        ref.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(ref)
        torch.save(dict(full_model), ref / "full.pt")
        torch.save(named, ref / "fsdp1_named_parameters.pt")
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


def cmd_load_fsdp1(args) -> int:
    """Load each rank's files into FSDP1 (built from another seed) and check what FSDP gathers, optimizer
    state included, against the reference."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

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
