"""What every gloo job of the harness shares: joining the job, printing from rank 0, timing its phases,
and leaving without the interpreter's teardown."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any
from itertools import pairwise
from pathlib import Path

import torch
import torch.distributed as dist


def rank() -> int:
    """This process's rank in the job (0 outside one)."""
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
    warnings.filterwarnings("ignore", message=r".*returned a view tensor.*")
    for pattern in (r"FSDP\.state_dict_type\(\) and FSDP\.set_state_dict_type\(\)",
                    r"Please use DTensor instead and we are deprecating ShardedTensor",
                    r"`_get_pg_default_device` will be deprecated",
                    r"Multiple backends are registered with this ProcessGroup"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def init_distributed() -> None:
    """Join the torchrun job with the gloo backend on CPU, one thread per rank."""
    if "RANK" not in os.environ:
        sys.exit(f"{os.path.basename(sys.argv[0])} must be run under torchrun "
                 "(python -m torch.distributed.run --standalone --nproc-per-node N ...)")
    torch.set_num_threads(1)
    quiet_known_warnings()
    dist.init_process_group(backend="gloo")


THEN = "--then"  # separates the command lines of the steps of one job


def run_steps(argv: list[str], parse: Callable[[list[str]], Callable[[], int | None]]) -> int:
    """Run the command lines of ``argv`` joined by ``--then`` one after the other in this job, so that torch
    starts once for all of them; ``parse`` makes one command line the call that runs it (every one is parsed
    before any runs). Each step is told apart in the output by ``== step N begins`` and ``== step N exit
    STATUS`` lines (tests/jobs.py run_steps). Returns 0 if every step passed, else the first failing status."""
    cuts = [-1] + [i for i, arg in enumerate(argv) if arg == THEN] + [len(argv)]
    steps = [parse(argv[start + 1:end]) for start, end in pairwise(cuts)]
    init_distributed()
    status = 0
    try:
        for number, step in enumerate(steps):
            # The barriers keep what every rank prints for a step between its two lines.
            dist.barrier()
            log(f"== step {number} begins")
            step_status = step() or 0
            dist.barrier()
            log(f"== step {number} exit {step_status}")
            status = status or step_status
    finally:
        dist.destroy_process_group()
    return status



def run_commands(parse_args: Callable[[list[str]], Any], argv: list[str] | None = None) -> int:
    """``run_steps`` of a job module whose command lines ``parse_args`` turns into arguments with the ``func`` that
    runs them (argparse's ``set_defaults(func=...)``); ``argv``: the process's by default."""
    def parse(step_argv: list[str]) -> Callable[[], int | None]:
        args = parse_args(step_argv)
        return lambda: args.func(args)

    return run_steps(sys.argv[1:] if argv is None else argv, parse)

def exit_now(status: int) -> None:
    """Leave with ``status``, skipping the interpreter's teardown: gloo's threads can abort it at random
    ("terminate called without an active exception", SIGABRT), and everything is written and flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Timer:
    """Wall-clock phases of a job, printed once at the end."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """End the phase named ``phase`` now."""
        now = time.perf_counter()
        self.phases.append((phase, now - self.last))
        self.last = now

    def __str__(self) -> str:
        parts = [f"{name} {secs:.2f}s" for name, secs in self.phases]
        return ", ".join(parts + [f"total {self.last - self.start:.2f}s"])


def reference_dir(out: str | os.PathLike) -> Path:
    """The reference folder for a checkpoint: ``OUT + '.reference'``."""
    return Path(str(out).rstrip("/") + ".reference")
