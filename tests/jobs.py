"""Run things for the tests: gloo jobs under torchrun, and dcptool's command line in forked children.

    from jobs import run_job, run_steps, FAMILY_JOBS
    run_job(2, "save-dcp", str(out), "--dp", "2")
    run_job(2, "load-family", str(ckpt), "--kind", "llama", ..., module=FAMILY_JOBS)
    steps = run_steps(4, {"dp4": ["load-dcp", a, "--dp", "4", ...], "tp4": ["load-dcp", b, ...]})

    runs = ForkServer(work)
    [result] = runs.run([["inspect", str(ckpt)]])   # a CompletedProcess, as subprocess.run gives

Works from any working directory: jobs run from the repository root with the tests folder on the path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The torchrun entry points of the test harness (tests/harness/), run as modules.
GLOO_JOBS = "harness.gloo_jobs"
FAMILY_JOBS = "harness.family_jobs"
VERL_JOBS = "harness.verl_jobs"
ACCELERATE_JOBS = "harness.accelerate_jobs"
STORAGE_JOBS = "harness.storage_jobs"
LORA_JOBS = "harness.lora_jobs"
MEGATRON_JOBS = "harness.megatron"  # megatron-core 0.19.2 saving and loading (tests/harness/megatron.py)


def run_job(nproc: int, *args: str, timeout: float = 300, check: bool = True,
            env: dict[str, str] | None = None, module: str = GLOO_JOBS) -> subprocess.CompletedProcess:
    """Run ``python -m MODULE ARGS...`` (default harness.gloo_jobs) on ``nproc`` CPU ranks with torchrun.

    Returns the CompletedProcess (stdout and stderr merged into ``.stdout``).
    With ``check=True`` (the default) a non-zero exit raises AssertionError
    carrying the command line and the tail of the output.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", module, *map(str, args)]
    job_env = dict(os.environ)
    job_env.setdefault("OMP_NUM_THREADS", "1")
    job_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), job_env.get("PYTHONPATH")]))
    job_env.update(env or {})
    proc = subprocess.run(cmd, cwd=REPO, env=job_env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-60:])
        raise AssertionError(
            f"job failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc


def joined(argvs: list[list]) -> list[str]:
    """Command lines of a harness module joined by its ``--then``: the steps of one job (torch starts once)."""
    job_args = []
    for argv in argvs:
        job_args += (["--then"] if job_args else []) + [str(arg) for arg in argv]
    return job_args


def run_steps(nproc: int, steps: dict[str, list], timeout: float = 300,
              module: str = GLOO_JOBS) -> dict[str, subprocess.CompletedProcess]:
    """Run command lines of ``module`` (harness.gloo_jobs, family_jobs, verl_jobs or storage_jobs) one after the
    other in one job of ``nproc`` ranks (``joined``): torch starts once for all of them, each still checks on
    its own.

    Returns, by the names of ``steps``, a CompletedProcess with the step's exit status and its part of the
    output; for a step that never finished (an earlier one stopped the job) the status is None and the
    output the job's last lines.
    """
    job = run_job(nproc, *joined(list(steps.values())), timeout=timeout, check=False, module=module)
    outputs: dict[int, list[str]] = {}
    codes: dict[int, int] = {}
    current = None
    for line in job.stdout.splitlines():
        if match := re.fullmatch(r"== step (\d+) begins", line):
            current = int(match.group(1))
            outputs[current] = []
        elif match := re.fullmatch(r"== step (\d+) exit (-?\d+)", line):
            codes[int(match.group(1))] = int(match.group(2))
            current = None
        elif current is not None:
            outputs[current].append(line)
    tail = "\n".join(job.stdout.splitlines()[-60:])
    unfinished = f"(the job exited {job.returncode} before this step finished)\n{tail}"
    return {name: subprocess.CompletedProcess([str(arg) for arg in argv], codes.get(number),
                                              "\n".join(outputs[number]) if number in codes else unfinished)
            for number, (name, argv) in enumerate(steps.items())}


# ---------------------------------------------------------------------------------------------
# dcptool's command line, forked: a run costs a fork instead of starting Python and importing
# dcptool (about half a second each, hundreds of times in the suite). A child is the process
# ``python -m dcptool ARGS`` would be, with the server's environment and working directory: it
# runs dcptool.__main__ and exits as the interpreter would (run_to_exit_code).

SOURCES = (REPO / "dcptool", REPO / "converters")


def sources_stamp() -> list[tuple[str, int]]:
    """The modification times of dcptool's sources: a server that imported older ones is restarted."""
    return sorted((str(p), p.stat().st_mtime_ns) for folder in SOURCES for p in folder.rglob("*.py"))


def without_test_name(env) -> dict[str, str]:
    """``env`` less PYTEST_CURRENT_TEST, pytest's name of the running test (dcptool never reads it)."""
    return {name: value for name, value in env.items() if name != "PYTEST_CURRENT_TEST"}


class ForkServer:
    """The client of ``serve``: runs dcptool command lines in children of one server process.

    ``warmup``: command lines run in the server before any fork, so that what they import lazily is
    imported once; ``memory_limit`` (bytes of address space) and ``timeout`` (seconds, then SIGALRM)
    limit each run; ``at_once``: runs of one request forked at a time; ``env`` and ``cwd``: the server's
    environment and working directory (default: this process's now), and so every child's.
    """

    def __init__(self, work: Path, warmup: list[list[str]] = (), memory_limit: int | None = None,
                 timeout: int | None = None, at_once: int = 1, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        work.mkdir(parents=True, exist_ok=True)
        (work / "runs").mkdir(exist_ok=True)
        self.settings = work / "settings.json"
        self.settings.write_text(json.dumps({"runs": str(work / "runs"), "warmup": list(warmup),
                                             "memory_limit": memory_limit, "timeout": timeout, "at_once": at_once}))
        self.log = work / "server.log"
        self.env = without_test_name(os.environ if env is None else env)
        self.cwd = os.getcwd() if cwd is None else cwd
        self.server = None

    def serves_here(self) -> bool:
        """Whether a run now is the one a new process would be: the same environment and directory."""
        return without_test_name(os.environ) == self.env and os.getcwd() == self.cwd

    def run(self, argvs: list[list[str]]) -> list[subprocess.CompletedProcess]:
        """Run each command line (arguments after ``dcptool``); what each did, in the same order."""
        if self.server is not None and sources_stamp() != self.stamp:
            self.close()
        if self.server is None:
            self.stamp = sources_stamp()
            with open(self.log, "a") as log:
                self.server = subprocess.Popen([sys.executable, __file__, "serve", str(self.settings)], cwd=self.cwd,
                                               env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=log, text=True)
        self.server.stdin.write(json.dumps(argvs) + "\n")
        self.server.stdin.flush()
        answer = self.server.stdout.readline()
        if not answer:
            self.close()
            raise AssertionError(f"the dcptool fork server died:\n{self.log.read_text()[-3000:]}")
        return [subprocess.CompletedProcess(["dcptool", *argv], ran["code"], ran["stdout"], ran["stderr"])
                for argv, ran in zip(argvs, json.loads(answer))]

    def close(self) -> None:
        if self.server is not None:
            self.server.stdin.close()
            self.server.wait(60)
            self.server.stdout.close()
            self.server = None


def run_to_exit_code(main) -> int:
    """Run ``main`` as the interpreter runs a script, to its exit code: what an exception escaping it
    prints, then what exiting does that a run can see (non-daemon threads joined, atexit handlers run,
    streams flushed). Without tearing down every module, which in a forked child copies the server's
    whole heap (several times the run itself)."""
    import atexit
    import threading

    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (reported as the interpreter reports it)
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # private, but what the interpreter itself calls first on exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def serve(settings_file: str) -> None:
    """Answer each line on stdin (a JSON list of command lines) with one line on stdout: a JSON list of
    {"code", "stdout", "stderr"}, one per run."""
    import importlib
    import pkgutil
    import resource
    import signal
    import threading
    import time

    settings = json.loads(Path(settings_file).read_text())
    runs = Path(settings["runs"])
    from dcptool import __main__ as entry, cli

    # Every module of dcptool imported here once rather than in each run (none imports torch at its top).
    for package in ("dcptool", "dcptool.families", "dcptool.models", "dcptool.converters"):
        for module in pkgutil.iter_modules(importlib.import_module(package).__path__, f"{package}."):
            importlib.import_module(module.name)

    answers = os.dup(1)  # a bare descriptor: a child closes it, and has no file object that would flush it
    os.dup2(2, 1)  # what the server itself prints goes to its log
    quiet = os.open(os.devnull, os.O_RDWR)
    for argv in settings["warmup"]:
        saved = os.dup(1), os.dup(2)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        try:
            cli.main(argv)
        except SystemExit:
            pass
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
    # typer builds the click command on every call of cli.main: built once here, each child has its copy.
    command = cli._command()
    cli._command = lambda: command
    command.commands["inspect"].make_context("inspect", ["x"])  # parsing imports what typer loads only then
    for thread in threading.enumerate():  # forking while another thread holds a lock could hang a child
        if thread is not threading.main_thread():
            thread.join(10)

    def fork(index: int, argv: list[str]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        os.close(answers)
        os.dup2(quiet, 0)
        for fd, name in ((1, f"{index}.out"), (2, f"{index}.err")):
            os.dup2(os.open(runs / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        if settings["memory_limit"]:
            resource.setrlimit(resource.RLIMIT_AS, (settings["memory_limit"],) * 2)
        if settings["timeout"]:
            signal.alarm(settings["timeout"])
        sys.argv = [entry.__file__, *argv]
        os._exit(run_to_exit_code(entry.run))

    for request in sys.stdin:
        argvs = json.loads(request)
        results: list[dict | None] = [None] * len(argvs)
        running: dict[int, tuple[int, float]] = {}  # pid -> (index, started)
        waiting = list(enumerate(argvs))[::-1]
        while waiting or running:
            while waiting and len(running) < settings["at_once"]:
                index, argv = waiting.pop()
                running[fork(index, argv)] = index, time.monotonic()
            for pid, (index, started) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                if not done and settings["timeout"] and time.monotonic() - started > settings["timeout"] + 30:
                    os.kill(pid, signal.SIGKILL)  # the alarm did not end it
                    done, status = os.waitpid(pid, 0)
                if done:
                    del running[pid]
                    results[index] = {"code": os.waitstatus_to_exitcode(status),
                                      "stdout": (runs / f"{index}.out").read_text(errors="backslashreplace"),
                                      "stderr": (runs / f"{index}.err").read_text(errors="backslashreplace")}
            if running:
                time.sleep(0.002)
        reply = memoryview((json.dumps(results) + "\n").encode())
        while reply:
            reply = reply[os.write(answers, reply):]


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    sys.path[0] = os.getcwd()  # as for python -m dcptool: the working directory, not this file's
    serve(sys.argv[2])
