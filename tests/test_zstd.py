"""DCP records compressed with torch's zstd extension (``transform_descriptors``): a real gloo job's
``dcp.save(FileSystemWriter(_extensions=[ZStandard()]))`` is read bitwise, and dcptool's
``--compress zstd`` output is loaded by ``dcp.load`` in a real gloo job."""

import pytest
import torch

from conftest import dcptool, read_tensor
from jobs import REPO, run_job
from dcptool import compression, formats
from dcptool.errors import CheckpointError

pytest.importorskip("zstandard", reason="zstd DCP needs the zstandard package (pip install 'dcptool[zstd]')")
STORAGE_JOBS = REPO / "tests" / "storage_jobs.py"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("zstd") / "ckpt"
    run_job(2, "save-zstd", path, script=STORAGE_JOBS)
    return path


def test_zstd_save_is_read_bitwise(saved, tmp_path):
    checkpoint = formats.open_checkpoint(saved)
    assert {c.encoding for t in checkpoint.tensors.values() for c in t.chunks} == {"zstd-archive"}
    expected = torch.load(f"{saved}.reference.pt", weights_only=True)
    for key, tensor in expected.items():
        assert torch.equal(read_tensor(checkpoint, key), tensor), key
    dcptool("convert", saved, tmp_path / "out.pt", "--to", "torch", "--max-memory", "64KiB")
    written = torch.load(tmp_path / "out.pt", weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in expected.items())


def test_compressed_output_loads_in_a_real_job(saved, tmp_path):
    dcptool("reshard", saved, tmp_path / "out", "--dp", "2", "--compress", "zstd")
    out = formats.open_checkpoint(tmp_path / "out")
    assert {c.encoding for t in out.tensors.values() for c in t.chunks} == {"zstd-archive"}
    job = run_job(2, "load-zstd", tmp_path / "out", f"{saved}.reference.pt", script=STORAGE_JOBS)
    assert job.stdout.count("5 tensors equal") == 2


def test_other_transforms_are_named():
    assert compression.encoding_of(None, "x") == "torch-archive"
    with pytest.raises(CheckpointError, match=r"transforms \[stream.lz4/1\]; dcptool reads stream.zstd/1 only"):
        compression.encoding_of(["stream.lz4/1"], "ckpt/.metadata: w chunk at [0]")


def test_zstd_bomb_is_refused(saved, tmp_path):
    import shutil

    import zstandard

    bomb = tmp_path / "bomb"
    shutil.copytree(saved, bomb)
    chunk = formats.open_checkpoint(bomb).tensors["embed.weight"].chunks[0]
    data = zstandard.ZstdCompressor().compress(b"\0" * (9 * 2**20))  # 9 MiB for a chunk of 84 bytes
    assert len(data) <= chunk.length
    with open(bomb / chunk.file, "r+b") as file:
        file.seek(chunk.offset)
        file.write(data)
    result = dcptool("convert", bomb, tmp_path / "out.pt", "--to", "torch", check=False)
    assert result.returncode == 2 and "decompresses to more than" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out.pt").exists()
