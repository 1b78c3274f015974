"""Prove a DCP checkpoint loads on a mesh: a real N-process job runs torch's ``dcp.load`` and checks every rank's shard.

``run()`` starts ``torchrun`` with this module as the worker. Each rank builds, for every tensor,
a DTensor with the placements the mesh and plan give it (the same ones ``reshard`` writes), loads
the checkpoint into them with ``dcp.load``, then compares its local shards bitwise with the same
regions read straight from the files by dcptool's own reader, and writes its result as JSON. The
parent collects the results, names the ranks and tensors that fail, and never hangs: the whole
process group is killed on a timeout, on Ctrl-C, and when a rank dies.

>>> report = run("step-1000", LoadOn("dp=2,tp=2", nproc=4))     # doctest: +SKIP
>>> report.ok, report.load_seconds                            # doctest: +SKIP
(True, 3.1)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dcptool.errors import UsageError, option
from dcptool.options import LoadOn, MeshOptions


@dataclass
class RankResult:
    rank: int
    tensors: int = 0
    failures: list[dict] = field(default_factory=list)  # {"key", "reason"}
    load_seconds: float | None = None
    error: str | None = None


@dataclass
class LoadReport:
    checkpoint: str
    mesh: dict
    backend: str
    nproc: int
    ranks: list[RankResult]
    missing_ranks: list[int]  # ranks that never reported: they died or were killed
    problem: str | None = None  # why the job did not finish (timeout, a rank died)

    @property
    def ok(self) -> bool:
        return not self.problem and not self.missing_ranks and all(
            not r.failures and not r.error for r in self.ranks)

    @property
    def load_seconds(self) -> float | None:
        times = [r.load_seconds for r in self.ranks if r.load_seconds is not None]
        return max(times) if times else None

    def to_json(self) -> dict:
        return {"checkpoint": self.checkpoint, "mesh": self.mesh, "backend": self.backend, "nproc": self.nproc,
                "ok": self.ok, "load_seconds": self.load_seconds, "problem": self.problem,
                "missing_ranks": self.missing_ranks, "ranks": [vars(r) for r in self.ranks]}


def _backend(requested: str, ranks: int) -> str:
    """The process group's backend: ``auto`` is nccl where there are GPUs, else gloo; nccl without a GPU for each
    of the ``ranks`` is refused before any process starts (its job could not start its process group)."""
    import torch

    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    gpus = torch.cuda.device_count()
    if requested == "nccl" and gpus < ranks:
        raise UsageError(f"{option('backend', 'nccl')} needs a GPU for each of the job's {ranks} processes; this machine "
                         f"has {gpus}: use {option('backend', 'gloo')}")
    return requested


def check_runnable(checkpoint: str | Path) -> None:
    """Refuse a load job that cannot start: without torch (the light install) or on a URL."""
    from dcptool.storage import is_remote

    if importlib.util.find_spec("torch") is None:  # torch is the extra dcptool[torch]
        raise UsageError(f"{option('load_on')} needs torch: pip install 'dcptool[torch]'")
    if is_remote(checkpoint):
        raise UsageError(f"{checkpoint}: {option('load_on')} runs torch's dcp.load on a local folder; copy the checkpoint here first")


def check_nproc(load_on: LoadOn) -> None:
    """The mesh's sizes and ``nproc`` against them, refused in verify's own terms (the mesh's planning would
    name reshard's world size)."""
    sizes = load_on.sizes()
    if not load_on.nproc:
        return
    others = sizes.get("dp_replicate", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    world = others * sizes["dp"] if sizes.get("dp") else None
    if load_on.nproc % others or (world is not None and world != load_on.nproc):
        raise UsageError(f"{option('nproc', load_on.nproc)} processes cannot hold the mesh of "
                         f"{option('load_on', load_on.mesh)}: give a multiple of dp_replicate*cp*tp = {others}"
                         + (f" ({world} with its dp)" if world is not None else ""))


def run(checkpoint: str | Path, load_on: LoadOn, *, include: str | None = None, exclude: str | None = None,
        config_dir: str | Path | None = None) -> LoadReport:
    """Load ``checkpoint`` on ``load_on``'s mesh in a real ``nproc``-process job and check every rank's shards.
    ``config_dir``: the model's config.json, whose head and expert counts the mesh is checked against
    before the job starts, as ``reshard`` checks them (default: a config the checkpoint comes with)."""
    from dcptool import formats
    from dcptool.planning.resharding import prepare, raise_problems

    check_runnable(checkpoint)
    checkpoint = Path(checkpoint)
    source = formats.open_checkpoint(checkpoint)
    if not formats.get(source.format).dcp_loadable:
        raise UsageError(f"{checkpoint}: {option('load_on')} loads DCP checkpoints with dcp.load (this is {source.format})")
    check_nproc(load_on)
    planned = prepare(source, MeshOptions(**load_on.sizes(), world_size=load_on.nproc or None, plan=load_on.plan),
                      config_dir=config_dir)
    raise_problems(planned)  # bad meshes are refused before any process starts
    mesh = planned.mesh
    backend = _backend(load_on.backend, mesh.world)
    with tempfile.TemporaryDirectory(prefix="dcptool-loadcheck-") as results:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={mesh.world}",
                   "-m", "dcptool.checks.loadcheck", str(checkpoint), "--mesh", json.dumps(mesh.as_dict()), "--plan", load_on.plan,
                   "--backend", backend, "--results", results]
        for flag, value in (("--include", include), ("--exclude", exclude), ("--config-dir", config_dir)):
            if value:
                command += [flag, str(value)]
        log = Path(results) / "torchrun.log"
        problem = None
        with open(log, "w") as output:
            # A session of its own, so the whole tree (torchrun and its workers) can be killed at once.
            job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            try:
                code = job.wait(timeout=load_on.timeout)
                if code != 0:
                    problem = _why_failed(log.read_text(errors="replace"), code)
            except subprocess.TimeoutExpired:
                problem = f"timed out after {load_on.timeout:g} s"
            finally:
                _kill_tree(job)
        ranks, missing = [], []
        for rank in range(mesh.world):
            path = Path(results) / f"rank{rank}.json"
            if path.is_file():
                ranks.append(RankResult(**json.loads(path.read_text())))
            else:
                missing.append(rank)
    return LoadReport(str(checkpoint), mesh.as_dict(), backend, mesh.world, ranks, missing, problem)


def _why_failed(log: str, code: int) -> str:
    """torchrun's own account of the first rank that failed, e.g. ``rank 1 exited with signal SIGKILL``."""
    cause = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
    if cause:
        rank, exitcode = int(cause.group(1)), int(cause.group(2))
        how = f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"
        return f"rank {rank} {how}"
    return f"the job exited with code {code}"


def _kill_tree(job: subprocess.Popen) -> None:
    """Kill torchrun and every worker (same session), and reap torchrun."""
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    job.wait()


# The worker: one per rank, started by torchrun.


def _worker(args) -> int:
    """One rank of the load job: DTensors laid out on the mesh, filled by ``dcp.load``, then checked
    against the files; the rank's result goes to its JSON file."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcptool import formats
    from dcptool.mesh import Mesh
    from dcptool.planning.resharding import prepare
    from dcptool.selection import select

    rank = int(os.environ["RANK"])
    result = RankResult(rank)
    out = Path(args.results) / f"rank{rank}.json"
    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = "cuda"
    dist.init_process_group(args.backend)
    try:
        mesh = Mesh(**json.loads(args.mesh))
        checkpoint = formats.open_checkpoint(args.checkpoint)
        # The same config as the parent's: the plan chosen by it is the one the parent checked.
        planned = prepare(checkpoint, MeshOptions(**mesh.as_dict(), plan=args.plan), keep_rank_state=True,
                          config_dir=args.config_dir)
        chosen = select({layout.tensor.key: layout for layout in planned.layouts}, args.include, args.exclude)
        state, regions = _empty_state(chosen, mesh, rank, device)
        dist.barrier()
        started = time.perf_counter()
        try:
            dcp.load(state, checkpoint_id=args.checkpoint)
        except CheckpointException as exc:  # a BaseException; the shard check below names the file and tensor
            failed = "; ".join(f"rank {r}: {type(error).__name__} {error}".strip()
                               for r, (error, _traceback) in sorted(exc.failures.items()))
            result.error = f"dcp.load failed ({failed})"
        result.load_seconds = round(time.perf_counter() - started, 3)
        _check_shards(checkpoint, chosen, state, regions, result)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(vars(result)))
    dist.destroy_process_group()
    return 0


def _empty_state(chosen: dict, mesh, rank: int, device: str) -> tuple[dict, dict]:
    """The state dict this rank hands ``dcp.load``: each tensor an empty DTensor placed as its layout says
    (plain where every rank holds it whole), and each tensor's region on this rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dcptool.mesh import Strided, local_chunk
    from dcptool.torch_archive import row_major

    # Dense tensors live on (dp_replicate, fsdp, tp); experts on (dp_replicate, efsdp, ep[, etp]).
    inner = (("etp", mesh.tp),) if mesh.etp == mesh.tp else ()
    views = {
        "dense": (("dp_replicate", mesh.dp_replicate), ("fsdp", mesh.fsdp), ("tp", mesh.tp)),
        "experts": (("dp_replicate", mesh.dp_replicate), ("efsdp", mesh.efsdp), ("ep", mesh.ep)) + inner,
    }
    device_meshes = {view: init_device_mesh(device, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
                     for view, dims in views.items()}
    coordinates = mesh.coordinates(rank)

    def torch_placement(placement):
        if isinstance(placement, Strided):
            return _StridedShard(placement.dim, split_factor=placement.split_factor)
        return Shard(placement.dim) if placement is not None else Replicate()

    state, regions = {}, {}
    for key, layout in chosen.items():
        offsets, sizes = local_chunk(layout.tensor.shape, layout.spec, coordinates)
        regions[key] = (offsets, sizes)
        local = torch.empty(sizes, dtype=getattr(torch, layout.tensor.dtype), device=device)
        if not layout.spec:
            state[key] = local
            continue
        view = "experts" if any(a.name == "ep" for a in layout.spec) else "dense"
        on_axis = {a.name: a.placement for a in layout.spec}
        placements = [torch_placement(on_axis.get(name)) for name, _ in views[view]]
        state[key] = DTensor.from_local(local, device_meshes[view], placements, run_check=False,
                                        shape=torch.Size(layout.tensor.shape), stride=tuple(row_major(layout.tensor.shape)))
    return state, regions


def _check_shards(checkpoint, chosen: dict, state: dict, regions: dict, result: RankResult) -> None:
    """Every loaded local shard against the same region read from the files by dcptool; mismatches and
    unreadable tensors go into ``result``."""
    import numpy as np
    import torch
    from torch.distributed.tensor import DTensor

    from dcptool import dtypes

    scratch = memoryview(bytearray(1 << 22))
    for key, layout in chosen.items():
        source = checkpoint.tensors[layout.tensor.source.key]
        offsets, sizes = regions[key]
        value = state[key].to_local() if isinstance(state[key], DTensor) else state[key]
        view_type = dtypes.raw_view_type(dtypes.dtype(source.dtype).itemsize)
        expected = np.empty(sizes, dtype=view_type)
        try:
            checkpoint.read_region(source, offsets, sizes, expected, scratch)
        except Exception as exc:
            result.failures.append({"key": key, "reason": f"cannot read it from the files: {exc}"})
            continue
        result.tensors += 1
        if result.error:
            continue
        loaded = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().view(view_type)
        if not np.array_equal(loaded.reshape(sizes), expected):
            mismatch = np.argwhere(loaded.reshape(sizes) != expected)[0]
            index = [int(i) + o for i, o in zip(mismatch, offsets)]
            result.failures.append({"key": key, "reason": f"local shard differs from the files first at {index}"})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dcptool.checks.loadcheck", description="worker of `dcptool verify --load-on`")
    parser.add_argument("checkpoint")
    parser.add_argument("--mesh", required=True, help="JSON of Mesh fields")
    parser.add_argument("--plan", default="auto")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--results", required=True)
    parser.add_argument("--include")
    parser.add_argument("--exclude")
    parser.add_argument("--config-dir")
    return _worker(parser.parse_args(argv))


if __name__ == "__main__":
    status = main()
    # gloo's threads can abort the interpreter's teardown at random (SIGABRT); the result file is
    # written, so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
