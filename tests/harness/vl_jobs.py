"""A real FSDP2 job of a tiny vision-language model (transformers' Qwen2.5-VL or Qwen3-VL): gloo, AdamW, ``dcp.save``.

Run under torchrun from the repository root, with the tests folder on the path::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 -m harness.vl_jobs \
        save-vl /tmp/vl --hf /tmp/vl-hf

``save-vl OUT --hf FOLDER`` loads FOLDER (``save_pretrained``'s: harness.family_models.save_vl) with
``from_pretrained``, shards every decoder layer, every vision block and the root with FSDP2 over the job's
ranks, takes one AdamW step on synthetic gradients and ``dcp.save``s ``{"model": get_model_state_dict(model),
"optim": get_optimizer_state_dict(...)}``, as an FSDP engine saves it: under the model's own names, which
transformers v5 gives VL models apart from those of their files (``model.visual.*``, ``model.language_model.*``).
Rank 0 writes ``OUT.reference/full.pt``: the gathered model state after the step. Exit status 0 means success.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness.models import make_optimizer, synthetic_step
from harness.runtime import Timer, exit_now, log, rank, reference_dir, run_steps


def save_vl(out: Path, hf: Path) -> int:
    from transformers import AutoModelForImageTextToText

    timer = Timer()
    model = AutoModelForImageTextToText.from_pretrained(hf, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    units = [module for name, stack in model.named_modules() if name.endswith((".layers", ".blocks"))
             and isinstance(stack, torch.nn.ModuleList) for module in stack]
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log(f"FSDP2 over {dist.get_world_size()} ranks: {len(units)} layers and blocks, and the root")
    optimizer = make_optimizer(model)
    synthetic_step(model, optimizer)
    timer.mark("step")
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=out)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank() == 0:
        reference_dir(out).mkdir(parents=True, exist_ok=True)
        torch.save(full, reference_dir(out) / "full.pt")
    timer.mark("save")
    log(f"saved {out}: {timer}")
    return 0


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="harness.vl_jobs")
    commands = parser.add_subparsers(dest="command", required=True)
    save = commands.add_parser("save-vl", help="FSDP2 + AdamW step of a VL model, then dcp.save")
    save.add_argument("out", type=Path)
    save.add_argument("--hf", type=Path, required=True, help="the model's save_pretrained folder")
    args = parser.parse_args(argv)
    return lambda: save_vl(args.out, args.hf)


if __name__ == "__main__":
    exit_now(run_steps(sys.argv[1:], parse))
