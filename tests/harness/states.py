"""State dicts as trainers hand them to DCP (torchtitan's and AReaL's layouts), flattened as DCP names
their entries on disk, and compared shard by shard with a full reference."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from harness.runtime import log

# Non-tensor entries written next to the weights (torchtitan / AReaL style).
TRAIN_STATE = {"step": 7, "note": "hello"}
LR_SCHEDULER_STATE = {"last_epoch": 7}


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
