"""The DCP jobs of ``gloo_jobs``: ``save-dcp`` trains and saves a checkpoint (and its full reference),
``load-dcp`` loads one into any mesh and checks every local shard bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from harness.models import DTYPES, LOADER_SEED, MODEL_SEED, load_config, synthetic_step, train_steps
from harness.parallel import Parallel, build_job_model, parallel_of
from harness.runtime import Timer, log, rank, reference_dir
from harness.states import (
    TRAIN_STATE,
    apply_dcp_state,
    compare_all,
    dataloader_state,
    dcp_state,
    finish_check,
    flatten,
    split_tensors,
)


def cmd_save_dcp(args) -> int:
    """FSDP2 / HSDP (+ TP, + EP) training step(s), then dcp.save in the layout of ``--layout`` and the
    reference beside the checkpoint."""
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
    """dcp.load of CKPT into a model on this job's mesh (from another seed), every entry checked against
    the reference; then the trainer's way back into the modules."""
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
    first = first_entry_mismatch(args, ref, sd, expected, tensors, objects)
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


def first_entry_mismatch(args, ref: Path, sd: dict[str, Any], expected: dict[str, torch.Tensor],
                         tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> str | None:
    """What the tensor comparison does not see: a non-tensor entry unlike objects.pt's, a train step not
    loaded, a reference tensor the load never asked for (model part only with --model-only)."""
    expected_objects = {}
    if (ref / "objects.pt").is_file():
        expected_objects = torch.load(ref / "objects.pt", weights_only=True)
    for key in sorted(objects):
        if key in expected_objects and objects[key] != expected_objects[key]:
            return f"{key}: {objects[key]!r} != {expected_objects[key]!r}"
    if not args.model_only and sd["train_state"]["step"] != TRAIN_STATE["step"]:
        return f"train_state.step: {sd['train_state']['step']!r}"
    optim_prefix = "optimizer." if args.layout == "torchtitan" else "dcp.optim."
    unchecked = sorted(k for k in set(expected) - set(tensors)
                       if not (args.model_only and k.startswith(optim_prefix)))
    if unchecked:
        return f"{unchecked[0]}: in the reference but not in the loaded state dict"
    return None
