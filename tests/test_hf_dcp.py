"""torch's HF-storage DCP (HuggingFaceStorageWriter / Reader) as format hf-dcp: files written by torch in real
gloo jobs are read bitwise, and dcptool's --to hf-dcp output is loaded by dcp.load with HuggingFaceStorageReader."""

import shutil

import pytest
import torch

from conftest import dcptool, read_tensor
from jobs import STORAGE_JOBS, run_job
from dcptool import formats


def reference(path):
    return torch.load(f"{path}.reference.pt", weights_only=True)


def test_sharded_save_is_read_bitwise(storage_saves):
    checkpoint = formats.open_checkpoint(storage_saves("sharded-only"))
    assert checkpoint.format == "hf-dcp"
    expected = reference(storage_saves("sharded-only"))
    assert set(checkpoint.tensors) == set(expected)
    assert len(checkpoint.tensors["embed.weight"].chunks) == 2  # 7 rows: 4 + 3 on two ranks
    for key, tensor in expected.items():
        assert torch.equal(read_tensor(checkpoint, key), tensor), key


def test_consolidated_folder_is_hf_and_its_sharded_folder_hf_dcp(storage_saves, tmp_path):
    folder = storage_saves("consolidated")
    assert formats.detect(folder) == "hf" and formats.detect(folder / "sharded") == "hf-dcp"
    expected = reference(folder)
    # a consolidation that never ran leaves only sharded/: the folder is read from there
    shutil.copytree(folder / "sharded", tmp_path / "failed" / "sharded")
    for path in (folder, tmp_path / "failed"):
        checkpoint = formats.open_checkpoint(path)
        for key, tensor in expected.items():
            assert torch.equal(read_tensor(checkpoint, key), tensor), (path, key)


@pytest.mark.parametrize("command", [["convert", "--to", "hf-dcp"], ["reshard", "--to", "hf-dcp", "--dp", "2"]])
def test_hf_dcp_output_loads_with_torch_reader(storage_saves, tmp_path, command):
    """convert writes every chunk into one rank's file; reshard lays them out as a job on dp=2 saves them."""
    source = storage_saves("sharded-only")
    dcptool(command[0], source, tmp_path / "out", *command[1:])
    if command[0] == "reshard":
        assert len(list((tmp_path / "out").glob("shard-*.safetensors"))) == 2  # one file per rank
    # every rank checks its loaded shards against the reference (the job fails on a mismatch)
    job = run_job(2, "load-hf", tmp_path / "out", f"{source}.reference.pt", module=STORAGE_JOBS)
    assert job.stdout.count("5 tensors equal") == 2
