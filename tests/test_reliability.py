"""Reliability: outputs appear whole or not at all, whatever happens to the process writing them.

Real processes throughout: two runs racing for one output, ``kill -9`` and Ctrl-C (SIGINT) at
random moments, a full disk (a file-size limit), a bug. Every assertion is an invariant that holds
wherever the signal lands or whichever run wins: nothing here depends on timing, and no test needs
a race or an interrupt to land at a particular place (delays only spread them out).

Also the script of a torchrun job whose rank 1 hits a bug (an internal error, exit 3):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_reliability.py convert SRC DST --to hf
"""

from __future__ import annotations

import os
import random
import re
import resource
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
PYTHON = sys.executable
HANG = 300  # seconds: a run still going after this is hung (a run takes about one second; CI is loaded)
SEED = int(os.environ.get("DCPTOOL_TEST_SEED", random.randrange(2**32)))

# Three kinds of output: one file in a folder (dcp), a single file (torch), several files (hf shards).
# A small --max-memory makes many small tasks, so the main thread waits on the writing threads
# hundreds of times per run: where Ctrl-C once deadlocked the thread pool.
COMMANDS = {
    "dcp": ("", ["--to", "dcp", "--max-memory", "64KiB"]),
    "torch": (".pt", ["--to", "torch", "--max-memory", "64KiB"]),
    "hf": ("", ["--to", "hf", "--max-shard-size", "2MB", "--max-memory", "64KiB"]),
}
# Each command gets runs of its own (run number modulo 3); the seed changes every test run, so the
# moments the signals land add up over CI runs rather than within one.
INTERRUPT_RUNS = 30
KILL_RUNS = 9
RACES = 6  # of which the last third with --overwrite


def dcptool_command(*args) -> list[str]:
    return [PYTHON, "-m", "dcptool", *map(str, args)]


def run(*args, timeout: float = HANG, **options) -> subprocess.CompletedProcess:
    return subprocess.run(dcptool_command(*args), capture_output=True, text=True, timeout=timeout, **options)


def contents(path: Path) -> dict[str, bytes] | None:
    """Every file of an output (a folder, or one file) by its path inside it; None when there is none."""
    if not os.path.lexists(path):
        return None
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def temporaries(folder: Path) -> list[str]:
    """Temporary outputs beside the destination (``.NAME.dcptool-tmp-HOST-PID-XXXXXXXX``)."""
    return sorted(p.name for p in folder.iterdir() if ".dcptool-" in p.name)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two different sources (safetensors, 8 MiB each) and, lazily, each one's output by a clean run."""
    import numpy as np
    from safetensors.numpy import save_file

    root = tmp_path_factory.mktemp("reliability")
    sources = {}
    for name, seed in (("a", 1), ("b", 2)):
        generator = np.random.default_rng(seed)
        sources[name] = root / f"{name}.safetensors"
        save_file({f"layers.{i}.weight": generator.standard_normal((256, 1024), dtype=np.float32) for i in range(8)},
                  str(sources[name]))
    expected: dict[tuple[str, str], dict[str, bytes]] = {}

    class Made:
        def source(self, name: str = "a") -> Path:
            return sources[name]

        def expected(self, command: str, name: str = "a") -> dict[str, bytes]:
            if (command, name) not in expected:
                suffix, args = COMMANDS[command]
                out = root / f"reference-{command}-{name}{suffix}"
                result = run("convert", sources[name], out, *args)
                assert result.returncode == 0, result.stderr
                expected[command, name] = contents(out)
            return expected[command, name]

    return Made()


def outcome_problems(code: int | None, stderr: str, out: Path, expected: dict[str, bytes]) -> list[str]:
    """What is wrong with how a run ended, if anything: the output whole (exit 0) or absent (exit 130,
    one line saying so); never a traceback; never a temporary left."""
    problems = []
    lines = stderr.strip().splitlines()
    if "Traceback" in stderr:
        problems.append("traceback")
    if code == 0:
        if contents(out) != expected:
            problems.append("exit 0 without the whole output")
    elif code == 130:
        if len(lines) != 1:
            problems.append(f"{len(lines)} lines on stderr")
        elif lines[0] == f"dcptool: interrupted after {out} was written":
            if contents(out) != expected:
                problems.append("said written, but the output is not whole")
        elif lines[0] not in ("dcptool: interrupted", f"dcptool: interrupted; {out} not written"):
            problems.append(f"unexpected line {lines[0]!r}")
        elif os.path.lexists(out):
            problems.append("interrupted, yet an output is there")
    else:
        problems.append(f"exit code {code}")
    if temporaries(out.parent):
        problems.append(f"temporaries left: {temporaries(out.parent)}")
    return problems


# ---------------------------------------------------------------------------------------------
# Two runs writing the same output


def test_of_two_runs_writing_one_output_exactly_one_wins(made, tmp_path):
    """Started together, both pass the check at start; the commit then refuses to replace what the
    other put in place. Whichever wins and however they interleave: not both exit 0 (unless
    --overwrite), the loser exits 2 with one line, and the output is one run's, whole."""
    lost = []
    for race in range(RACES):
        command = list(COMMANDS)[race % len(COMMANDS)]
        suffix, args = COMMANDS[command]
        out = tmp_path / f"race{race}{suffix}"
        overwrite = ["--overwrite"] if race >= RACES * 2 // 3 else []
        runs = {name: subprocess.Popen(dcptool_command("convert", made.source(name), out, *args, *overwrite),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for name in ("a", "b")}
        ended = {name: (process.wait(HANG), process.communicate()[1]) for name, process in runs.items()}
        codes = sorted(code for code, _ in ended.values())
        got = contents(out)
        assert got in (made.expected(command, "a"), made.expected(command, "b")), f"race {race}: not one run's output"
        assert temporaries(tmp_path) == [], f"race {race}"
        if overwrite:
            assert codes == [0, 0], ended
            continue
        assert codes == [0, 2], ended
        winner = next(name for name, (code, _) in ended.items() if code == 0)
        assert got == made.expected(command, winner)
        [line] = next(stderr for code, stderr in ended.values() if code == 2).strip().splitlines()
        assert line in (f"dcptool: error: {out}: appeared while writing; not replaced (use --overwrite)",
                        f"dcptool: error: {out}: already exists (pass --overwrite to replace it)"), line
        lost.append("appeared" in line)
    print(f"{sum(lost)} of {len(lost)} races were lost at the commit, the others at the start")


@pytest.mark.parametrize("kernel_rename", [True, False], ids=["renameat2", "fallback"])
@pytest.mark.parametrize("is_dir", [True, False], ids=["folder", "file"])
def test_commit_refuses_an_output_that_appeared_while_writing(tmp_path, monkeypatch, kernel_rename, is_dir):
    """In one process, deterministically: DST appears between the start and the commit."""
    from dcptool import storage
    from dcptool.errors import UsageError
    from dcptool.storage import renames

    if not kernel_rename:  # no renameat2 here: a hard link for a file, rename for a folder
        monkeypatch.setattr(renames, "_renameat2", lambda: None)
    out = tmp_path / "out"
    with pytest.raises(UsageError, match="appeared while writing; not replaced"):
        with storage.atomic_output(out, overwrite=False, is_dir=is_dir) as temporary:
            (temporary / "data" if is_dir else temporary).write_bytes(b"mine")
            out.mkdir()
            (out / "theirs").write_bytes(b"theirs")
    assert contents(out) == {"theirs": b"theirs"} and temporaries(tmp_path) == []

    with storage.atomic_output(out, overwrite=True, is_dir=is_dir) as temporary:  # --overwrite replaces it
        (temporary / "data" if is_dir else temporary).write_bytes(b"mine")
        (out / "theirs").write_bytes(b"changed meanwhile")
    assert contents(out) == ({"data": b"mine"} if is_dir else {".": b"mine"}) and temporaries(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Temporaries of runs that died


def test_stale_temporaries_of_dead_writers_are_removed_and_only_those(made, tmp_path):
    from dcptool.storage.outputs import _HOST

    out = tmp_path / "out"
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    zombie = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(600)"])
    live = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(600)"])
    try:
        zombie.kill()
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        names = {
            "gone": f".out.dcptool-tmp-{_HOST}-{pid_max + 1}-0badc0de",  # a pid no process can have
            "zombie": f".out.dcptool-tmp-{_HOST}-{zombie.pid}-0badf00d",
            "live": f".out.dcptool-tmp-{_HOST}-{live.pid}-00c0ffee",
            "other host": f".out.dcptool-tmp-{_HOST}x-{pid_max + 1}-0000beef",
            "old dcptool": ".out.dcptool-tmp-0badcafe",
            "other output": f".out2.dcptool-tmp-{_HOST}-{pid_max + 1}-0000cafe",
        }
        for name in names.values():
            (tmp_path / name).mkdir()
            (tmp_path / name / "__0_0.distcp").write_bytes(b"partial")
        result = run("convert", made.source(), out, *COMMANDS["dcp"][1])
        assert result.returncode == 0, result.stderr
        left = set(temporaries(tmp_path))
        assert left == set(names.values()) - {names["gone"], names["zombie"]}, left
    finally:
        for process in (zombie, live):
            process.kill()
            process.wait()


def test_inspect_of_the_parent_lists_the_temporaries_of_dead_writers(tmp_path):
    from dcptool.storage.outputs import _HOST

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = f".out.dcptool-tmp-{_HOST}-{pid_max + 1}-0badc0de"  # a pid no process can have
    live = f".out.dcptool-tmp-{_HOST}-{os.getpid()}-00c0ffee"
    for name in (dead, live):
        (tmp_path / name).mkdir()
    result = run("inspect", tmp_path)
    assert result.returncode == 2 and dead in result.stderr and live not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_kill_9_at_any_moment_leaves_no_partial_output_and_the_next_run_cleans_up(made, tmp_path):
    """SIGKILL at random moments of a run: DST is whole or absent; what the killed run left is
    removed by the next run on the same DST (which also replaces a whole DST with --overwrite)."""
    rng = random.Random(SEED)
    span = 0.0
    left_behind = 0
    for number in range(KILL_RUNS):
        command = list(COMMANDS)[number % len(COMMANDS)]
        suffix, args = COMMANDS[command]
        expected = made.expected(command)
        out = tmp_path / f"out{number}{suffix}"
        started = time.monotonic()
        process = subprocess.Popen(dcptool_command("convert", made.source(), out, *args),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if number == 0:  # a whole run first: its length spreads the kills over a run
            assert process.wait(HANG) == 0
            span = time.monotonic() - started
        else:
            try:  # the first half of a run imports and plans; one that ends first shortens the next delays
                process.wait(span * rng.uniform(0.5, 1.0))
            except subprocess.TimeoutExpired:
                process.kill()
            else:
                span = min(span, time.monotonic() - started)
            process.wait(HANG)
        assert contents(out) in (None, expected), f"seed {SEED}, run {number}: a partial output"
        stale = temporaries(tmp_path)
        assert all(f"-{process.pid}-" in name for name in stale), stale
        left_behind += bool(stale)
        result = run("convert", made.source(), out, *args, "--overwrite")
        assert result.returncode == 0, result.stderr
        assert contents(out) == expected and temporaries(tmp_path) == [], f"seed {SEED}, run {number}"
    print(f"{left_behind} of {KILL_RUNS - 1} killed runs left a temporary, removed by the next run")


# ---------------------------------------------------------------------------------------------
# Ctrl-C

# Runs ``python -m dcptool ARGS`` and writes a line to the pipe FD once dcptool handles Ctrl-C
# itself (installs its own SIGINT handler): from then on, any SIGINT must end in one line and
# exit 130 (or exit 0, had the run finished). An interrupt before that point, in the imports of
# ``dcptool.cli``, is test_interrupt_while_the_command_line_is_imported.
LAUNCHER = r"""
import os, runpy, signal, sys
ready, install, told = int(sys.argv.pop(1)), signal.signal, []
def watched(signum, handler):
    previous = install(signum, handler)
    if signum == signal.SIGINT and not told and handler not in (signal.default_int_handler, signal.SIG_DFL,
                                                                 signal.SIG_IGN):
        told.append(True)
        os.write(ready, b"ready\n")
        os.close(ready)
    return previous
signal.signal = watched
runpy.run_module("dcptool", run_name="__main__", alter_sys=True)
"""


def start_handling_interrupts(*args) -> tuple[subprocess.Popen, bool]:
    """Start dcptool and wait until it handles Ctrl-C; returns the process and whether it got there."""
    reader, writer = os.pipe()
    try:
        process = subprocess.Popen([PYTHON, "-c", LAUNCHER, str(writer), *map(str, args)], pass_fds=(writer,),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        os.close(writer)
        readable, _, _ = select.select([reader], [], [], HANG)
        ready = bool(readable) and os.read(reader, 16) == b"ready\n"
    finally:
        os.close(reader)
    return process, ready


def test_ctrl_c_at_any_moment_exits_130_with_one_line_and_leaves_nothing(made, tmp_path):
    rng = random.Random(SEED)
    span = 0.0
    seen: dict[str, int] = {}
    for number in range(INTERRUPT_RUNS):
        command = list(COMMANDS)[number % len(COMMANDS)]
        suffix, args = COMMANDS[command]
        out = tmp_path / f"out{number}{suffix}"
        process, ready = start_handling_interrupts("convert", made.source(), out, *args)
        assert ready, process.communicate(timeout=HANG)[1]
        started = time.monotonic()
        if number == 0:  # a whole run first: its length spreads the interrupts over a run
            assert process.wait(HANG) == 0
            span = time.monotonic() - started
        else:
            # Two in three land in the last half of a run, where the threads write (the first half
            # imports and plans); a run that ends before its interrupt shortens the next delays.
            delay = span * (rng.uniform(0.5, 1.0) if number % 3 else rng.uniform(0, 1.0))
            try:
                process.wait(delay)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGINT)
            else:
                span = min(span, time.monotonic() - started)
        try:
            _, stderr = process.communicate(timeout=HANG)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail(f"seed {SEED}, run {number}: hung after Ctrl-C ({command})")
        problems = outcome_problems(process.returncode, stderr, out, made.expected(command))
        assert not problems, f"seed {SEED}, run {number} ({command}): {problems}\n{stderr}"
        key = stderr.strip().replace(str(out), "OUT") or "exit 0"
        seen[key] = seen.get(key, 0) + 1
    print(f"{INTERRUPT_RUNS} runs: {seen}")


def test_interrupt_while_the_command_line_is_imported(made, tmp_path):
    """SIGINT during ``import typer`` (the first import of dcptool.cli), delivered by a sitecustomize."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "class Trap:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'typer':\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Trap())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    out = tmp_path / "out"
    # Python keeps Ctrl-C ignored where it starts ignored (the tests run in the background of a shell): not here.
    result = run("convert", made.source(), out, *COMMANDS["dcp"][1], env=env,
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.returncode == 130 and result.stderr.strip().splitlines() == ["dcptool: interrupted"], result.stderr
    assert not out.exists() and temporaries(tmp_path) == []


# Sends SIGINT at the AT-th import from dcptool's own on (the first import is the package itself,
# before its first line runs: Python's start-up, out of reach), and with REPEAT at every later one
# too (a user pressing Ctrl-C again and again); with AT=0 writes the number of imports to COUNT.
# Start-up is mostly imports: the moments follow it step by step, and none depends on timing.
INTERRUPTING_SITE = r"""
import os, signal, sys
at, repeat, count = int(os.environ["AT"]), bool(os.environ.get("REPEAT")), os.environ.get("COUNT")
imports = []
def interrupt(event, args):
    if event != "import" or not (imports or args[0] == "dcptool"):
        return
    imports.append(args[0])
    if at and (len(imports) == at or (repeat and len(imports) > at)):
        os.kill(os.getpid(), signal.SIGINT)
    if count and len(imports) == 1:
        import atexit
        atexit.register(lambda: open(count, "w").write(str(len(imports))))
sys.addaudithook(interrupt)
"""


def test_ctrl_c_anywhere_in_start_up_ends_in_one_line(made, tmp_path):
    """SIGINT at imports spread over the whole start-up of ``python -m dcptool`` and of the ``dcptool``
    console script, once or repeatedly: every run exits 130 with the one line (or 0, finished), never a traceback."""
    script = Path(sys.executable).with_name("dcptool")
    if not script.is_file():
        pytest.skip("the dcptool console script is not installed beside this Python")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(INTERRUPTING_SITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    launches = {"python -m dcptool": dcptool_command, "console script": lambda *args: [str(script), *map(str, args)]}

    def start(launch: str, out: Path, **settings) -> subprocess.CompletedProcess:
        # Python keeps Ctrl-C ignored where it starts ignored (the tests run in the background of a shell): not here.
        return subprocess.run(launches[launch]("convert", made.source(), out, *COMMANDS["dcp"][1]), check=False,
                              capture_output=True, text=True, timeout=HANG, env={**env, **settings},
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    counted = tmp_path / "imports"
    whole = start("python -m dcptool", tmp_path / "whole", AT="0", COUNT=str(counted))
    assert whole.returncode == 0, whole.stderr
    total = int(counted.read_text())
    assert total > 100  # the command line's imports, then the conversion's
    moments = sorted({2, 3, total - 1, total, *range(2, total, max(1, total // 12))})
    outcomes: dict[str, int] = {}
    for number, at in enumerate(moments):
        launch, repeat = list(launches)[number % 2], "1" if number % 4 >= 2 else ""
        out = tmp_path / f"out{number}"
        result = start(launch, out, AT=str(at), REPEAT=repeat)
        problems = outcome_problems(result.returncode, result.stderr, out, made.expected("dcp"))
        assert not problems, f"{launch}, SIGINT at import {at} of {total}{' and after' if repeat else ''}: {problems}\n{result.stderr}"
        outcome = result.stderr.strip().replace(str(out), "OUT") or "exit 0"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert "dcptool: interrupted" in outcomes, outcomes


# ---------------------------------------------------------------------------------------------
# A full disk, and bugs


def limit_file_size(nbytes: int):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return limit


@pytest.mark.parametrize("command", ["hf", "torch"])
def test_a_full_disk_names_the_file_and_writes_nothing(made, tmp_path, command):
    suffix, args = COMMANDS[command]
    out = tmp_path / f"out{suffix}"
    result = run("convert", made.source(), out, *args, preexec_fn=limit_file_size(2**20))
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    file = re.escape(f"{out}/") + r"model-\d{5}-of-\d{5}\.safetensors" if command == "hf" else re.escape(str(out))
    assert re.fullmatch(rf"dcptool: error: writing {file} at byte [\d,]+: File too large", line), line
    assert not os.path.lexists(out) and temporaries(tmp_path) == []


# Runs dcptool with a bug planted in the threads that write: ``1 // 0`` on RANK's tasks (all without torchrun).
BUGGY = r"""
import os, sys
from dcptool.engine import transfer
from dcptool.cli import main
run = transfer._Mover.run
def buggy(self, task):
    return 1 // 0 if os.environ.get("RANK", "1") == "1" else run(self, task)
transfer._Mover.run = buggy
sys.argv[0] = "dcptool"
main()
"""


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_bug_exits_3_asking_for_a_report(made, tmp_path, debug):
    out = tmp_path / "out"
    flags = ["--debug"] if debug else []
    result = subprocess.run([PYTHON, "-c", BUGGY, *flags, "convert", str(made.source()), str(out), "--to", "hf"],
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("dcptool: internal error: ZeroDivisionError: integer division or modulo by zero (")
    assert "please report it" in lines[-1]
    if debug:
        assert "Traceback" in result.stderr and "in buggy" in result.stderr
    else:
        assert len(lines) == 1 and "--debug" in lines[0]
    assert not out.exists() and temporaries(tmp_path) == []


def test_a_bug_on_one_rank_stops_every_rank_with_exit_3(made, tmp_path):
    """Under torchrun rank 1 hits the bug: rank 0 stops too and reports it, once, as an internal error."""
    out = tmp_path / "out"
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE),
               "convert", str(made.source()), str(out), "--to", "hf", "--max-shard-size", "1MB"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("dcptool:")]
    assert len(lines) == 1 and lines[0].startswith("dcptool: internal error: ZeroDivisionError"), result.stderr[-3000:]
    assert "(on rank 1 of 2)" in lines[0] and "please report it" in lines[0]
    codes = [int(code) for code in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", result.stderr, re.MULTILINE)]
    assert codes and all(code != 0 for code in codes), result.stderr[-3000:]
    assert not out.exists() and temporaries(tmp_path) == []


if __name__ == "__main__":  # the job of test_a_bug_on_one_rank_stops_every_rank_with_exit_3
    sys.path.insert(0, str(ROOT))
    exec(BUGGY)
