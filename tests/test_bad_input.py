"""Bad input: exit code 2, one clear line naming the file and what is wrong, no traceback, nothing written."""

import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import dcptool
from safetensors.torch import save_file


@pytest.fixture
def small_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    dcp.save({"model": {"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(8)}, "step": 3}, checkpoint_id=path)
    return path


def refused(source, *args, names, tmp_path):
    """Run convert and check the refusal: exit 2, one line naming ``names``, no output, source unchanged."""
    before = {p: p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()} if source.is_dir() else None
    out = tmp_path / "out"
    result = dcptool("convert", source, out, "--to", "torch", *args, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert names in lines[0], lines[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "dcptool-tmp" in p.name]
    if before is not None:
        assert before == {p: p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}
    return lines[0]


def test_missing_metadata(small_dcp, tmp_path):
    (small_dcp / ".metadata").unlink()
    line = refused(small_dcp, names=".metadata", tmp_path=tmp_path)
    assert "missing" in line


def test_truncated_distcp(small_dcp, tmp_path):
    data = small_dcp / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    line = refused(small_dcp, names="__0_0.distcp", tmp_path=tmp_path)
    assert "truncated" in line


def test_metadata_pickle_that_runs_code_is_refused(small_dcp, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (small_dcp / ".metadata").write_bytes(pickle.dumps(Exploit()))
    for command in (["inspect", small_dcp], ["convert", small_dcp, tmp_path / "x", "--to", "hf"]):
        result = dcptool(*command, check=False)
        assert result.returncode == 2 and "refuses to unpickle" in result.stderr and ".metadata" in result.stderr
    assert not marker.exists()


def test_chunk_offset_past_end_of_file(small_dcp, tmp_path):
    metadata = pickle.loads((small_dcp / ".metadata").read_bytes())  # our own file: trusted here
    for info in metadata.storage_data.values():
        info.offset += 10**6
    (small_dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    refused(small_dcp, names="__0_0.distcp", tmp_path=tmp_path)


def test_missing_chunk_is_reported_by_tensor(small_dcp, tmp_path):
    metadata = pickle.loads((small_dcp / ".metadata").read_bytes())
    metadata.state_dict_metadata["model.w"].size = torch.Size([16, 8])
    (small_dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    line = refused(small_dcp, names="model.w", tmp_path=tmp_path)
    assert "missing" in line


@pytest.fixture
def sharded_hf(tmp_path):
    path = tmp_path / "hf"
    path.mkdir()
    save_file({"a": torch.ones(4)}, path / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.zeros(4)}, path / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"metadata": {"total_size": 32}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                            "b": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def test_index_names_missing_file(sharded_hf, tmp_path):
    (sharded_hf / "model-00002-of-00002.safetensors").unlink()
    line = refused(sharded_hf, names="model.safetensors.index.json", tmp_path=tmp_path)
    assert "model-00002-of-00002.safetensors" in line


def test_index_names_file_outside_the_folder(sharded_hf, tmp_path):
    shutil.copy(sharded_hf / "model-00002-of-00002.safetensors", tmp_path / "x.safetensors")
    index = json.loads((sharded_hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = "../x.safetensors"
    (sharded_hf / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(sharded_hf, names="outside the checkpoint folder", tmp_path=tmp_path)
    assert "../x.safetensors" in line


def test_truncated_safetensors(sharded_hf, tmp_path):
    shard = sharded_hf / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    refused(sharded_hf, names="model-00001-of-00002.safetensors", tmp_path=tmp_path)


def test_existing_destination_is_left_untouched(small_dcp, tmp_path):
    out = tmp_path / "out.pt"
    out.write_text("precious")
    result = dcptool("convert", small_dcp, out, "--to", "torch", check=False)
    assert result.returncode == 2 and "--overwrite" in result.stderr and len(result.stderr.splitlines()) == 1
    assert out.read_text() == "precious"
    dcptool("convert", small_dcp, out, "--to", "torch", "--overwrite")
    assert torch.load(out, weights_only=True)["step"] == 3


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = dcptool("inspect", tmp_path, check=False)
    assert result.returncode == 2 and "not a checkpoint" in result.stderr


@pytest.mark.parametrize("kept, suffix", [(kept, suffix) for kept in ("half", "first record", "10 bytes", "nothing")
                                          for suffix in (".pt", ".bin", "") if suffix or kept != "nothing"])
def test_a_torch_save_file_cut_short_says_what_is_wrong(tmp_path, kept, suffix):
    """Cut short, a torch.save file is still recognized (by its suffix, or the zip header it starts with),
    and the reader says what is wrong, as with --from torch."""
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.arange(4096.0), "b": torch.ones(8)}, whole)
    data = whole.read_bytes()
    length = {"half": len(data) // 2, "first record": 200, "10 bytes": 10, "nothing": 0}[kept]
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[:length])
    with pytest.raises((RuntimeError, EOFError, OSError)):  # torch's own loader fails on it
        torch.load(cut, weights_only=True)
    line = refused(cut, names=str(cut), tmp_path=tmp_path)
    assert "end of central directory" in line and "recognizes" not in line, line
    assert line == refused(cut, "--from", "torch", names=str(cut), tmp_path=tmp_path)


def test_a_folder_of_checkpoints_leaves_out_the_files_that_cannot_be_read(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for step in (1, 2, 3):
        torch.save({"w": torch.full((64,), float(step))}, run / f"step-{step}.pt")
    (run / "step-3.pt").write_bytes((run / "step-3.pt").read_bytes()[:100])
    result = dcptool("inspect", run, check=False)
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and "a folder holding 2 checkpoints" in line, line
    assert "newest first): step-2.pt, step-1.pt;" in line and "step-3.pt (" in line.split(";")[1], line
    assert "end of central directory" in line, line

    only = tmp_path / "only"
    only.mkdir()
    shutil.move(run / "step-3.pt", only / "step-3.pt")
    result = dcptool("inspect", only, check=False)
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and "cannot be read: step-3.pt (" in line and "pass" not in line, line

    (run / "step-1.pt").unlink()
    result = dcptool("inspect", run, check=False)
    assert result.returncode == 2 and result.stderr.strip().endswith(f"pass {run / 'step-2.pt'}"), result.stderr


def test_an_output_inside_its_source_or_holding_it_is_refused(small_dcp, tmp_path):
    """Every command that writes: exit 2, one line naming both, the source unchanged and nothing added to it."""
    hf = tmp_path / "hf"
    dcptool("export-hf", small_dcp, hf)
    (tmp_path / "link").symlink_to(small_dcp)
    source_files = lambda: {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}  # noqa: E731
    before = source_files()
    runs = [(["convert", small_dcp, small_dcp / "inner", "--to", "dcp"], "inside the source checkpoint"),
            (["convert", small_dcp, small_dcp / "model.pt", "--to", "torch", "--dry-run"], "inside the source checkpoint"),
            (["reshard", small_dcp, small_dcp / "inner", "--dp", "2"], "inside the source checkpoint"),
            (["reshard", small_dcp, small_dcp, "--dp", "2", "--overwrite"], "is the source checkpoint itself"),
            (["reshard", small_dcp, tmp_path, "--dp", "2", "--overwrite"], "holds the source checkpoint"),
            (["export-hf", tmp_path / "link", small_dcp / "hf"], "inside the source checkpoint"),
            (["import-hf", hf, hf / "dcp"], "inside the source checkpoint"),
            (["inspect", small_dcp, "--layout", "model.w", "--svg", small_dcp / "w.svg"], "inside the source checkpoint")]
    for args, why in runs:
        result = dcptool(*args, check=False)
        [line] = result.stderr.splitlines()
        assert result.returncode == 2 and why in line, (args, line)
        assert line.startswith(f"dcptool: error: {args[2] if args[0] != 'inspect' else args[-1]}: "), line
        assert str(args[1]) in line.split(": ", 2)[2] or why.endswith("itself"), line
        assert source_files() == before and not [p for p in tmp_path.rglob("*dcptool-*")], args
    dcptool("reshard", small_dcp, tmp_path / "beside", "--dp", "2")  # a sibling is fine


def test_debug_shows_traceback(small_dcp):
    (small_dcp / ".metadata").unlink()
    result = dcptool("--debug", "inspect", small_dcp, check=False)
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_pickled_bytes_are_read_but_codecs_is_not_a_way_in():
    """Protocol-2 pickles store bytes as _codecs.encode(str, 'latin1') (torchtitan's dataloader state);
    that one use is allowed, any other encoding is refused."""
    import codecs

    from dcptool import safe_pickle
    from dcptool.errors import CheckpointError

    assert safe_pickle.load_bytes(pickle.dumps(b"\x00\xffstate", protocol=2), "x") == b"\x00\xffstate"

    class OtherCodec:
        def __reduce__(self):
            return (codecs.encode, ("payload", "rot13"))

    with pytest.raises(CheckpointError, match="is not bytes as pickled by torch"):
        safe_pickle.load_bytes(pickle.dumps(OtherCodec(), protocol=2), "x")


def test_unknown_option_is_a_usage_error(tmp_path):
    result = dcptool("inspect", tmp_path, "--no-such-option", check=False)
    assert result.returncode == 2
    assert "No such option: --no-such-option" in result.stderr and "Traceback" not in result.stderr


def test_index_whose_weight_map_holds_numbers(sharded_hf, tmp_path):
    index = json.loads((sharded_hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["b"] = 3
    (sharded_hf / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(sharded_hf, names="model.safetensors.index.json", tmp_path=tmp_path)
    assert "weight_map['b'] is a number, not a file name" in line


def test_safetensors_header_that_is_a_list(sharded_hf, tmp_path):
    shard = sharded_hf / "model-00002-of-00002.safetensors"
    shard.write_bytes(len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]")
    line = refused(sharded_hf, names="model-00002-of-00002.safetensors", tmp_path=tmp_path)
    assert "safetensors header is an array, not an object" in line
