"""Run scripts/gloo_jobs.py (or scripts/family_jobs.py) under torchrun, for tests, demos and benchmarks.

    from jobs import run_job, FAMILY_JOBS
    run_job(2, "save-dcp", str(out), "--dp", "2")
    run_job(2, "load-family", str(ckpt), "--kind", "llama", ..., script=FAMILY_JOBS)

Works from any working directory: the script path is resolved from this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GLOO_JOBS = REPO / "scripts" / "gloo_jobs.py"
FAMILY_JOBS = REPO / "scripts" / "family_jobs.py"


def run_job(nproc: int, *args: str, timeout: float = 300, check: bool = True,
            env: dict[str, str] | None = None, script: Path = GLOO_JOBS) -> subprocess.CompletedProcess:
    """Run ``script ARGS...`` (default gloo_jobs.py) on ``nproc`` CPU ranks with torchrun.

    Returns the CompletedProcess (stdout and stderr merged into ``.stdout``).
    With ``check=True`` (the default) a non-zero exit raises AssertionError
    carrying the command line and the tail of the output.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(script), *map(str, args)]
    job_env = dict(os.environ)
    job_env.setdefault("OMP_NUM_THREADS", "1")
    job_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=job_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-60:])
        raise AssertionError(
            f"job failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc
