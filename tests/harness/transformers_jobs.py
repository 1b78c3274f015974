"""Real gloo jobs that train any transformers model as transformers' own distributed training does.

Run under torchrun from the repository root, with the tests folder on the path, for example::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 -m harness.transformers_jobs \
        save /tmp/ckpt --config /tmp/qwen3_next --dp 2
    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 -m harness.transformers_jobs \
        load /tmp/resharded --config /tmp/qwen3_next --tp 2 --expect /tmp/ckpt.reference/full.pt --save-layout /tmp/own

Both build the model of a config.json (its ``architectures`` class) and parallelize it with
transformers' own code, the path ``from_pretrained(distributed_config=...)`` takes: ``DistributedConfig``,
``initialize_distributed_mesh`` and ``maybe_distribute_model``, which applies the model's TP plan
(``apply_tensor_parallelism``: colwise, rowwise, packed_colwise, ...), its EP plan (``grouped_gemm``,
``ep_dispatch_experts``) and FSDP2 by its FSDP plan.

* ``save OUT``  The model from a fixed seed, FSDP2 over ``--dp`` ranks, one AdamW step on synthetic
                gradients, ``dcp.save`` of model and optimizer as torchtitan lays them out (model keys at the
                top, ``optimizer`` flattened by torch, ``train_state``, ``lr_scheduler``). Rank 0 also writes
                ``OUT.reference/`` (full.pt: the gathered state, keyed as on disk; objects.pt; config.json).
* ``load CKPT`` The model built on the meta device and parallelized on ``--dp`` x ``--tp`` (``--ep``) ranks, an
                AdamW step for its optimizer state, then the state as transformers saves and loads it
                (``_redistribute_state_dict``: a strided shard, which dcp.save cannot record, made contiguous).
                ``--save-layout DIR`` first ``dcp.save``\\ s that state (the job's own layout); then ``dcp.load``
                of CKPT into it, every rank's local shards compared bitwise with ``--expect``.

Several command lines joined by ``--then`` run one after the other in one job (torch starts once).
Exit status 0 means success; 1 means a comparison failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread per rank

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from harness.models import MODEL_SEED, make_optimizer, synthetic_step  # noqa: E402
from harness.runtime import Timer, exit_now, log, rank, reference_dir, run_commands  # noqa: E402
from harness.states import compare_all, dcp_state, finish_check, flatten, split_tensors  # noqa: E402


def distributed_model(config_dir: str, dp: int, tp: int, ep: int, *, meta: bool):
    """The model of ``config_dir/config.json`` parallelized by transformers on dp x tp ranks (ep borrowing them):
    built from MODEL_SEED on every rank, or on the meta device and then given storage (``meta``)."""
    import transformers
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.utils import initialize_distributed_mesh

    config = transformers.AutoConfig.from_pretrained(config_dir)
    model_class = getattr(transformers, config.architectures[0])  # a causal LM, or a vision-language model
    distributed = DistributedConfig(fsdp_size=dp, tp_size=tp, ep_size=ep)
    _, meshes = initialize_distributed_mesh(distributed)
    torch.manual_seed(MODEL_SEED)
    if meta:
        with torch.device("meta"):
            model = model_class._from_config(config, dtype=torch.float32)
    else:
        model = model_class._from_config(config, dtype=torch.float32)
    model = model_class.maybe_distribute_model(model, distributed, meshes)
    if meta:
        model.to_empty(device="cpu")
    return model


def cmd_save(args) -> int:
    timer = Timer()
    model = distributed_model(args.config, args.dp, 1, 1, meta=False)
    optimizer = make_optimizer(model)
    synthetic_step(model, optimizer)
    timer.mark("build and step")
    dcp.save(dcp_state(model, optimizer, "torchtitan"), checkpoint_id=args.out)
    full = dcp_state(model, optimizer, "torchtitan", full=True)
    if rank() == 0:
        reference = reference_dir(args.out)
        reference.mkdir(parents=True, exist_ok=True)
        tensors, objects = split_tensors(flatten(full))
        torch.save(tensors, reference / "full.pt")
        torch.save(objects, reference / "objects.pt")
        shutil.copy(Path(args.config) / "config.json", reference / "config.json")
    dist.barrier()
    timer.mark("dcp.save")
    log(f"save done: {args.out} ({timer})")
    return 0


def transformers_state(model, optimizer) -> dict:
    """Model and optimizer state as transformers' save_pretrained / save_optimizer_distributed hand it to DCP."""
    from transformers.distributed.checkpoint import _redistribute_state_dict

    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, optimizer,
                                                  options=StateDictOptions(flatten_optimizer_state_dict=True))
    return _redistribute_state_dict(state)


def cmd_load(args) -> int:
    timer = Timer()
    expected = torch.load(args.expect, map_location="cpu", weights_only=True)
    model = distributed_model(args.config, args.dp, args.tp, args.ep, meta=True)
    optimizer = make_optimizer(model)
    synthetic_step(model, optimizer)  # the optimizer state a job has before it loads
    state = transformers_state(model, optimizer)
    timer.mark("build")
    if args.save_layout:
        dcp.save(state, checkpoint_id=args.save_layout)
        log(f"saved this mesh's own checkpoint to {args.save_layout}")
    dcp.load(state, checkpoint_id=args.ckpt)
    timer.mark("dcp.load")
    checked, first = compare_all(flatten(state), expected)
    status = finish_check(first, f"{checked} tensors on dp={args.dp} tp={args.tp} ep={args.ep} match {args.expect}")
    log(f"load done ({timer})")
    return status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("save", help="FSDP2 job of transformers that saves model and optimizer with dcp.save")
    p.add_argument("out")
    p.add_argument("--config", required=True, help="folder of the model's config.json")
    p.add_argument("--dp", type=int, required=True, help="FSDP degree (= world size)")
    p.set_defaults(func=cmd_save)

    p = sub.add_parser("load", help="a job on another mesh that loads CKPT and checks every local shard")
    p.add_argument("ckpt")
    p.add_argument("--config", required=True, help="folder of the model's config.json")
    p.add_argument("--expect", required=True, help="full.pt of the save job's reference")
    p.add_argument("--dp", type=int, default=1, help="FSDP degree")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (borrows dp x tp ranks)")
    p.add_argument("--save-layout", help="first dcp.save this job's own state here")
    p.set_defaults(func=cmd_load)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the steps of the command line (joined by --then) in one job; 0 if every step passed."""
    return run_commands(parse_args, argv)


if __name__ == "__main__":
    exit_now(main())
