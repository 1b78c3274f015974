"""dcptool under torchrun: the output files are split across ranks, and the result is the same, byte for
byte, as one process writing it; a failure on any rank stops every rank, with one error line and no output.

Also the script of a job whose hf writer fails on rank 1 (run under torchrun):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_torchrun.py export-hf SRC DST
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import dcptool

HERE = Path(__file__).resolve()
NPROC = 2

# Each writes several files, so both ranks write some: 4 rank files (and .metadata) of a reshard,
# safetensors shards (and the index), per-rank fsdp1 files; a torch file is written by rank 0 alone.
COMMANDS = {
    "reshard-dp4": ["reshard", "{src}", "{dst}", "--dp", "4", "--tp", "1"],
    "export-hf-shards": ["export-hf", "{src}", "{dst}", "--max-shard-size", "200KB"],
    "fsdp1-w4": ["convert", "{src}", "{dst}", "--to", "fsdp1", "--world-size", "4"],
    "torch-file": ["convert", "{src}", "{dst}", "--to", "torch"],
    # computed tensors (each a mean of its regions in both sources) split over the ranks as copies are
    "average-dp4": ["average", "{src}", "{src}", "{dst}", "--dp", "4", "--weights", "0.25,0.75"],
    # quantized weights and their scales, computed where their shard is written
    "export-hf-fp8": ["export-hf", "{src}", "{dst}", "--max-shard-size", "100KB", "--quantize", "fp8",
                      "--block-size", "32x32"],
}


def command_line(command: str, source, destination) -> list[str]:
    return [arg.format(src=source, dst=destination) for arg in COMMANDS[command]]


def torchrun(*args, script: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``dcptool ARGS`` (or ``script ARGS``) on NPROC ranks of a standalone torchrun job."""
    target = [str(script)] if script else ["-m", "dcptool"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
               *target, *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def contents(path: Path) -> dict[str, bytes]:
    """Every file of an output (a folder, or one file), by its path inside it."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


def exit_codes(result: subprocess.CompletedProcess) -> list[int]:
    """The exit codes of the failed ranks, from torchrun's summary."""
    return [int(code) for code in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", result.stderr, re.MULTILINE)]


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("dcptool: error:")]


def temporaries(folder: Path) -> list[str]:
    """Temporary outputs left beside the destination (``.out.dcptool-tmp-*``)."""
    return [p.name for p in folder.iterdir() if ".dcptool-" in p.name]


@pytest.fixture(scope="module")
def alone(checkpoints, tmp_path_factory):
    """Each command's output written by one process (made once, on first use): {command: contents}."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    root = tmp_path_factory.mktemp("alone")
    made = {}

    def get(command: str) -> dict[str, bytes]:
        if command not in made:
            out = root / (f"{command}.pt" if command == "torch-file" else command)
            dcptool(*command_line(command, source, out))
            made[command] = contents(out)
        return made[command]

    return get


@pytest.mark.parametrize("command", COMMANDS, ids=list(COMMANDS))
def test_output_is_identical_to_one_process(checkpoints, alone, command, tmp_path):
    source, _ = checkpoints("fsdp2_dp2_tp2")
    shared = tmp_path / ("shared.pt" if command == "torch-file" else "shared")
    result = torchrun(*command_line(command, source, shared))
    assert result.returncode == 0, result.stderr[-3000:]
    expected, got = alone(command), contents(shared)
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if got[name] != expected[name]] == []
    if command != "torch-file":
        assert len(expected) > NPROC  # enough files for every rank to write some
    assert result.stdout.count("wrote ") == 1  # the summary, from rank 0 only
    assert temporaries(tmp_path) == []


@pytest.mark.parametrize("command", ["reshard-dp4", "torch-file"])
def test_remote_destination_each_rank_uploads_its_files(checkpoints, alone, command, tmp_path):
    """A URL destination under torchrun: every rank stages and uploads its own files, rank 0 the index
    last. fsspec's ``local://`` protocol goes through the same upload path as s3:// and is seen by
    every rank (``memory://`` lives inside one process)."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    uploaded = tmp_path / ("uploaded.pt" if command == "torch-file" else "uploaded")
    if command != "torch-file":
        uploaded.mkdir()
        (uploaded / "stale.distcp").write_bytes(b"from an earlier run")  # --overwrite removes the old output
    result = torchrun(*command_line(command, source, f"local://{uploaded}"), "--overwrite")
    assert result.returncode == 0, result.stderr[-3000:]
    assert contents(uploaded) == alone(command)


def test_bad_source_fails_on_every_rank_with_one_line(tmp_path):
    result = torchrun("convert", tmp_path / "nothing-here", tmp_path / "out", "--to", "dcp")
    assert result.returncode != 0
    assert error_lines(result) == [f"dcptool: error: {tmp_path / 'nothing-here'}: no such file or folder"]
    assert len(exit_codes(result)) == NPROC and all(code != 0 for code in exit_codes(result))
    assert not (tmp_path / "out").exists() and temporaries(tmp_path) == []


def test_failure_on_one_rank_stops_all_and_writes_nothing(checkpoints, tmp_path):
    """Rank 1 fails while writing its shards: rank 0 stops, reports rank 1's error and removes the output."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    result = torchrun("export-hf", source, tmp_path / "out", "--max-shard-size", "200KB", script=HERE)
    assert result.returncode != 0
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].endswith("injected failure (on rank 1 of 2)"), result.stderr[-3000:]
    assert len(exit_codes(result)) == NPROC and all(code != 0 for code in exit_codes(result))
    assert not (tmp_path / "out").exists() and temporaries(tmp_path) == []


def test_torch_stays_off_the_single_process_path(checkpoints, tmp_path):
    source, _ = checkpoints("fsdp2_dp2_tp2")
    code = (
        "import sys\n"
        "from dcptool.cli import main\n"
        f"sys.argv = ['dcptool', 'export-hf', {str(source)!r}, {str(tmp_path / 'hf')!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch was imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


if __name__ == "__main__":  # the job of test_failure_on_one_rank_stops_all_and_writes_nothing
    sys.path.insert(0, str(HERE.parents[1]))
    from dcptool.engine import transfer
    from dcptool.cli import main
    from dcptool.errors import CheckpointError

    run = transfer._Mover.run

    def fail_on_rank_1(self, task):  # as a disk error would, in a thread moving bytes
        if os.environ["RANK"] == "1":
            raise CheckpointError(f"{task.piece.tensor.key}: injected failure")
        return run(self, task)

    transfer._Mover.run = fail_on_rank_1
    main(sys.argv[1:])


def test_average_checks_the_records_of_every_source_on_every_rank(checkpoints, tmp_path):
    """Each rank reads only parts of the second source's records (the dp=4 chunks of its files): the parts of
    a damaged record are checked whole when the rank's copy finishes, so the damage is found."""
    from test_records import copy_with_damaged_data

    source, _ = checkpoints("fsdp2_dp2_tp2")
    damaged = tmp_path / "damaged"
    name = copy_with_damaged_data(source, damaged, "dcp.model.model.layers.0.self_attn.o_proj.weight")
    result = torchrun("average", source, damaged, tmp_path / "out", "--dp", "4", "--tp", "1")
    lines = error_lines(result)
    assert result.returncode != 0 and len(lines) == 1 and "CRC-32" in lines[0], result.stderr[-3000:]
    assert name in lines[0]
    assert not (tmp_path / "out").exists() and temporaries(tmp_path) == []
