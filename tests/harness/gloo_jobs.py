"""Real distributed-checkpoint jobs on CPU (gloo) for testing dcptool.

Run under torchrun from the repository root, with the tests folder on the path, for example::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 \
        -m harness.gloo_jobs save-dcp /tmp/ckpt --dp 2 --tp 2
    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 \
        -m harness.gloo_jobs save-dcp /tmp/moe --model moe --dp 2 --tp 2 --ep 2

Subcommands (see ``--help`` of each):

* ``save-dcp OUT``    FSDP2 / HSDP (optionally + TP, + EP for the MoE) training
                      step on a tiny HF Llama or a tiny torchtitan-style MoE,
                      then ``torch.distributed.checkpoint.save`` in a torchtitan
                      or AReaL layout.  Rank 0 also writes ``OUT.reference/``
                      with the full (gathered) state, flattened to the DCP keys.
* ``save-fsdp1 OUT``  FSDP1 SHARDED_STATE_DICT per-rank ``torch.save`` files,
                      named the way verl names them.
* ``load-dcp CKPT``   Load a DCP checkpoint into a (possibly different) mesh and
                      compare every local shard bitwise with a full reference;
                      ``--save-layout DIR`` first saves that mesh's own checkpoint.
* ``load-fsdp1 DIR``  Load verl-style FSDP1 shards into a real FSDP1 job and
                      compare the gathered full state dict with a reference.

Several command lines joined by ``--then`` run one after the other in one job, so
that torch starts once for all of them (each checks on its own: it builds its own
model and mesh); each is told apart in the output by ``== step N ...`` lines::

    ... -m harness.gloo_jobs load-dcp A --dp 4 --expect A.reference/full.pt --then load-dcp B --dp 4 ...

Nothing here is mocked: real process groups, real FSDP2 / FSDP1 / TP / EP.  Every
rank builds the identical model on CPU from a fixed seed before sharding.
Exit status 0 means success; 1 means a comparison failed (in any step).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one thread per rank

from harness.dcp_jobs import cmd_load_dcp, cmd_save_dcp  # noqa: E402
from harness.fsdp1_jobs import cmd_load_fsdp1, cmd_save_fsdp1  # noqa: E402
from harness.models import DTYPES, MODELS  # noqa: E402
from harness.runtime import exit_now, run_commands  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """One step's command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_opts(p, default_note=""):
        p.add_argument("--model-config", default=None,
                       help='preset name ("tiny"), JSON string, or path to a config.json; '
                            "JSON overrides the tiny preset (TINY_LLAMA or TINY_MOE)"
                            + default_note)

    def mesh_opts(p):
        p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
        p.add_argument("--dp", type=int, required=True, help="FSDP shard degree (dp_shard)")
        p.add_argument("--tp", type=int, default=1)
        p.add_argument("--cp", type=int, default=1,
                       help="context parallel degree: FSDP shards over dp*cp (torchtitan's dp_shard_cp)")
        p.add_argument("--ep", type=int, default=1,
                       help="expert parallel degree (--model moe); borrows dp (and tp) ranks")
        p.add_argument("--etp", type=int, default=None,
                       help="tensor parallel degree of the experts: 1 or --tp (default)")

    p = sub.add_parser("save-dcp", help="FSDP2(+TP/EP) job that writes a DCP checkpoint")
    p.add_argument("out")
    p.add_argument("--model", choices=MODELS, default="llama")
    mesh_opts(p)
    p.add_argument("--layout", choices=("torchtitan", "areal"), default="torchtitan")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    model_opts(p)
    p.set_defaults(func=cmd_save_dcp)

    p = sub.add_parser("load-dcp", help="load a DCP checkpoint (any mesh) and verify it")
    p.add_argument("ckpt")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="default: the model in reference.json next to --expect, else llama")
    mesh_opts(p)
    p.add_argument("--expect", required=True, help="full.pt with flat '.'-joined keys")
    p.add_argument("--layout", choices=("torchtitan", "areal"), default="torchtitan")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--save-layout", metavar="DIR", default=None,
                   help="first dcp.save this job's own state (after one step) to DIR, "
                        "as a trainer on this mesh would, then load and check CKPT")
    model_opts(p, " (default: config.json next to --expect, else tiny)")
    p.set_defaults(func=cmd_load_dcp)

    p = sub.add_parser("save-fsdp1", help="FSDP1 job that writes verl-style shards")
    p.add_argument("out")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--values", choices=("sharded_tensor", "dtensor"), default="sharded_tensor")
    p.add_argument("--steps", type=int, default=1)
    model_opts(p)
    p.set_defaults(func=cmd_save_fsdp1)

    p = sub.add_parser("load-fsdp1", help="load verl-style FSDP1 shards and verify them")
    p.add_argument("dir")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--expect", required=True, help="full.pt of the full model state dict")
    p.add_argument("--values", choices=("auto", "sharded_tensor", "dtensor"), default="auto",
                   help="how to build FSDP1 (auto: from the type of the saved values)")
    model_opts(p, " (default: DIR/huggingface/config.json, else tiny)")
    p.set_defaults(func=cmd_load_fsdp1)

    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the steps of the command line (joined by --then) in one job; 0 if every step passed."""
    return run_commands(parse_args, argv)


if __name__ == "__main__":
    exit_now(main())
