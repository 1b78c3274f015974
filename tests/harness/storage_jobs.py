"""Gloo jobs that save and load with torch's other DCP storage layers (run under torchrun by tests/jobs.py,
as ``-m harness.storage_jobs``):
HuggingFaceStorageWriter / Reader (HF-storage DCP) and FileSystemWriter with the ZStandard extension.

    save-hf OUT [--consolidate]   FSDP2 on every rank; dcp.save(HuggingFaceStorageWriter(save_distributed=True))
    save-zstd OUT [--large]       FSDP2; dcp.save(FileSystemWriter(_extensions=[ZStandard()])); --large adds a
                                  tensor sharded by rows whose records decompress to 128 KiB a rank
    load-hf DIR REFERENCE         dcp.load(HuggingFaceStorageReader(DIR)) into FSDP2; every shard checked
    load-zstd DIR REFERENCE       dcp.load (torch's default reader, which undoes the zstd transform); checked

Saves write ``REFERENCE = OUT.reference.pt``: the full state dict, from rank 0. Command lines joined by
``--then`` run one after the other in one job (torch starts once; tests/jobs.py run_steps).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.runtime import exit_now, run_steps


class Net(torch.nn.Module):
    """Uneven dim 0 (7 rows on 2 ranks) and a bf16 part, as real models have."""

    def __init__(self):
        super().__init__()
        self.embed, self.proj = torch.nn.Embedding(7, 6), torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3).to(torch.bfloat16)

    def forward(self, x):
        return self.head(self.proj(self.embed(x)).to(torch.bfloat16))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net()
    for part in (net.embed, net.proj, net.head):
        fully_shard(part)
    return fully_shard(net)


def full(state: dict) -> dict:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


def save(args) -> None:
    net = model()
    state = net.state_dict()
    if args.command == "save-hf":
        writer = HuggingFaceStorageWriter(args.path, save_distributed=True, enable_consolidation=args.consolidate)
    else:
        writer = FileSystemWriter(args.path, _extensions=[ZStandard()])
        state = {**state, "train_state": {"step": 7}}  # a non-tensor entry: its record is compressed too
        if args.large:
            values = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            state["large.weight"] = distribute_tensor(values, mesh, [Shard(0)])
    dcp.save(state, storage_writer=writer)
    reference = full({k: v for k, v in state.items() if k != "train_state"})
    if dist.get_rank() == 0:
        torch.save(reference, f"{args.path}.reference.pt")


def load(args) -> int:
    torch.manual_seed(1)
    net = model()
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    state = net.state_dict()
    reader = HuggingFaceStorageReader(args.path) if args.command == "load-hf" else FileSystemReader(args.path)
    dcp.load(state, storage_reader=reader)
    expected = torch.load(args.reference, weights_only=True)
    loaded = full(state)
    bad = [k for k in expected if not torch.equal(loaded[k].view(torch.uint8), expected[k].view(torch.uint8))]
    if bad:
        print(f"rank {dist.get_rank()}: mismatch in {bad}", flush=True)
        return 1
    print(f"rank {dist.get_rank()}: {len(expected)} tensors equal", flush=True)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["save-hf", "save-zstd", "load-hf", "load-zstd"])
    parser.add_argument("path")
    parser.add_argument("reference", nargs="?")
    parser.add_argument("--consolidate", action="store_true")
    parser.add_argument("--large", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the steps of the command line (joined by --then) in one job; 0 if every step passed. After each step
    every rank waits for the others (rank 0 may still be consolidating) before the next or the group's end: a
    rank tearing gloo down while another still uses it can abort ("terminate called ...")."""
    def parse(step_argv: list[str]):
        args = parse_args(step_argv)
        return lambda: save(args) if args.command.startswith("save") else load(args)

    return run_steps(sys.argv[1:] if argv is None else argv, parse)


if __name__ == "__main__":
    exit_now(main())  # gloo's threads can abort the interpreter's teardown
