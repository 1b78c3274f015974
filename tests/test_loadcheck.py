"""verify --load-on: real multi-process gloo jobs load a checkpoint with dcp.load on a mesh and check every rank's shard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import dcptool, load_reference, read_dcp


def tensor_count(checkpoint) -> int:
    """The tensors of a DCP checkpoint, as torch's own metadata lists them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata.values()
    return sum(isinstance(entry, TensorStorageMetadata) for entry in entries)


def test_loads_on_the_saving_mesh_and_on_others(checkpoints):
    """FSDP2 + TP (dp=2, tp=2) and FSDP2 (dp=2) checkpoints, on their own meshes and on others: every rank
    checks its shard of every tensor."""
    dense_tp, _ = checkpoints("fsdp2_dp2_tp2")
    dense, _ = checkpoints("fsdp2_dp2")
    for source, mesh, ranks in ((dense_tp, "dp=2,tp=2", 4), (dense_tp, "dp=4", 4), (dense_tp, "dp=1,tp=2", 2),
                                (dense, "dp=2", 2)):
        report = json.loads(dcptool("verify", source, "--load-on", mesh, "--json").stdout)
        assert report["ok"] and report["backend"] == "gloo" and report["nproc"] == ranks, report
        assert [r["tensors"] for r in report["ranks"]] == [tensor_count(source)] * ranks
        assert report["load_seconds"] > 0


def test_a_checkpoint_with_no_config_beside_it_loads_on_tp_with_config_dir(checkpoints, tmp_path):
    """Saved on dp=2 alone, with no config.json beside it: tp=2 may cut a head unless the config gives the counts."""
    source, reference = checkpoints("fsdp2_dp2")
    assert not (source / "config.json").exists() and (reference / "config.json").is_file()
    refused = dcptool("verify", source, "--load-on", "dp=1,tp=2", check=False)
    assert refused.returncode == 2 and "give --config-dir" in refused.stderr.strip().splitlines()[-1], refused.stderr
    report = json.loads(dcptool("verify", source, "--load-on", "dp=1,tp=2", "--config-dir", reference, "--json").stdout)
    assert report["ok"] and report["nproc"] == 2 and [r["tensors"] for r in report["ranks"]] == [tensor_count(source)] * 2, report
    # the config is read: counts that tp does not divide are refused, naming it
    config = json.loads((reference / "config.json").read_text())
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    refused = dcptool("verify", source, "--load-on", "dp=1,tp=2", "--config-dir", wrong, check=False)
    assert refused.returncode == 2 and str(wrong / "config.json") in refused.stderr, refused.stderr


def test_nproc_and_backend_choose_the_job(checkpoints):
    """--nproc sets the job's ranks (the mesh's dp follows: 2 ranks at tp=2 is dp=1, where the 4 that saved the
    checkpoint would give dp=2); --backend is the process group's, whatever auto would choose here."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    report = json.loads(dcptool("verify", source, "--load-on", "tp=2", "--nproc", "2", "--backend", "gloo",
                                "--json").stdout)
    assert report["ok"] and report["nproc"] == 2 and len(report["ranks"]) == 2 and report["backend"] == "gloo"
    assert (report["mesh"]["dp"], report["mesh"]["tp"]) == (1, 2)
    refused = dcptool("verify", source, "--load-on", "tp=2", "--nproc", "3", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        "dcptool: error: --nproc 3 processes cannot hold the mesh of --load-on tp=2: give a multiple of "
        "dp_replicate*cp*tp = 2"), refused.stderr
    result = dcptool("verify", source, "--load-on", "tp=2", "--nproc", "2", "--backend", "nccl", "--json", check=False)
    if torch.cuda.device_count() >= 2:
        assert result.returncode == 0 and json.loads(result.stdout)["backend"] == "nccl", result.stderr
    else:  # nccl needs a GPU per rank: refused before a job starts that could not start its process group
        assert result.returncode == 2 and not result.stdout, result.stdout
        assert result.stderr.strip().splitlines()[-1] == (
            f"dcptool: error: --backend nccl needs a GPU for each of the job's 2 processes; this machine has "
            f"{torch.cuda.device_count()}: use --backend gloo"), result.stderr


@pytest.fixture
def damaged(checkpoints, tmp_path):
    source, _ = checkpoints("fsdp2_dp2_tp2")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    return copy


def test_truncated_data_file_fails_naming_file_and_tensor(damaged):
    data = damaged / "__1_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    result = dcptool("verify", damaged, "--load-on", "dp=2,tp=2", check=False)
    # Bad input, found before any job starts: exit 2 and one line naming the file and the tensor.
    assert result.returncode == 2, result.stdout + result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"dcptool: error: {data}: truncated: ") and ".exp_avg" in error, result.stderr


def test_missing_data_file_fails_naming_it(damaged):
    (damaged / "__3_0.distcp").unlink()
    result = dcptool("verify", damaged, "--load-on", "dp=4", check=False)
    assert result.returncode in (1, 2), result.stdout + result.stderr
    assert "__3_0.distcp" in result.stdout + result.stderr


def test_a_shard_that_loads_other_bytes_than_saved_fails_naming_rank_and_tensor(checkpoints, tmp_path):
    """One data byte of one weight's chunk flipped: torch's dcp.load does not check the records' CRC-32s and
    loads it silently as another value (against the job's gathered reference, that weight alone differs);
    --load-on catches it on the rank that loads the chunk, naming the tensor, and exits 1."""
    from test_records import copy_with_damaged_data

    source, reference = checkpoints("fsdp2_dp2")
    full = load_reference(reference)
    key = next(k for k in full if k.endswith("self_attn.q_proj.weight"))
    damaged = tmp_path / "damaged"
    data_file = copy_with_damaged_data(source, damaged, key)
    loaded = read_dcp(damaged, tmp_path)  # torch's own reading of every entry
    assert [k for k, v in full.items() if not torch.equal(loaded[k], v)] == [key]

    result = dcptool("verify", damaged, "--load-on", "dp=2", check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"dcptool: error: {damaged}: ranks [0] failed the load check on dp=2"
    # the job loads on the mesh that saved it: rank r reads its own file __r_0.distcp
    assert data_file == "__0_0.distcp"
    lines = result.stdout.splitlines()
    failing = lines.index(f"rank 0: FAIL, {len(full) - 1} tensors checked")
    assert lines[failing + 1].startswith(f"  {key}: cannot read it from the files: {damaged / data_file} ")
    assert f"rank 1: ok, {len(full)} tensors checked" in lines


def _job_processes(parent: int) -> dict[int, int | None]:
    """{pid: rank} of torchrun (rank None) and the loadcheck workers started by this test (read from /proc, Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"dcptool.checks.loadcheck" in cmdline and environ.get(b"DCPTOOL_TEST_PARENT") == str(parent).encode():
            rank = environ.get(b"RANK")
            found[int(entry.name)] = None if rank is None else int(rank)
    return found


def _workers(parent: int) -> dict[int, int]:
    return {rank: pid for pid, rank in _job_processes(parent).items() if rank is not None}


def poll(condition, seconds: float = 120) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (a deadline for a stuck test, never a measured bound)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_rank_that_dies_fails_the_check_and_leaves_no_process(checkpoints):
    """SIGKILL of one worker: the job is stopped (not left to its --timeout) with that rank named, exit 2, and no
    process of it outlives the command."""
    source, _ = checkpoints("fsdp2_dp2_tp2")
    marker = os.getpid()
    env = {**os.environ, "DCPTOOL_TEST_PARENT": str(marker)}
    # Two ranks (of the four the checkpoint was saved by): rank 0 is the one left to stop and clean up.
    verify = subprocess.Popen([sys.executable, "-m", "dcptool", "verify", source, "--load-on", "dp=1,tp=2",
                               "--timeout", "600"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert poll(lambda: 1 in _workers(marker) or verify.poll() is not None)
    assert 1 in _workers(marker), verify.communicate()
    os.kill(_workers(marker)[1], signal.SIGKILL)
    stdout, stderr = verify.communicate(timeout=600)
    assert verify.returncode == 2, stdout + stderr
    assert "rank 1 was killed by SIGKILL" in stderr  # not "timed out after 600 s"
    assert poll(lambda: not _job_processes(marker)), _job_processes(marker)
