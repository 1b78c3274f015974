"""Typed errors: each subclasses the builtin that fits it (as huggingface_hub's do) and carries the path it is
about, with the same message and exit code as before; the except clauses of dcptool that catch ValueError
let a failed read through unchanged, now that CheckpointError is a ValueError too."""

import doctest

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import dcptool
from conftest import dcptool as cli
from dcptool import checksums, dtypes, errors, formats, mesh, selection, torch_archive
from dcptool.errors import (CheckpointError, CheckpointNotFoundError, DcptoolError, MismatchError, OutputExistsError,
                            UnsafePickleError, UsageError)
from dcptool.storage import CheckpointFiles


def test_each_error_is_also_its_builtin():
    for error, builtins in [(CheckpointNotFoundError, (CheckpointError, FileNotFoundError, OSError, ValueError)),
                            (CheckpointError, (ValueError,)), (UnsafePickleError, (CheckpointError, ValueError)),
                            (OutputExistsError, (UsageError, FileExistsError, OSError, ValueError)),
                            (UsageError, (ValueError,)), (MismatchError, ())]:
        assert all(issubclass(error, b) for b in (DcptoolError, *builtins)), error
        assert getattr(dcptool, error.__name__) is error and error.__name__ in dcptool.__all__
    exit_codes = [e.exit_code for e in (CheckpointNotFoundError, OutputExistsError, UsageError, MismatchError)]
    assert exit_codes == [2, 2, 2, 1]
    # What OSError's machinery sets (storage names the file of a failed write) leaves the message as it was.
    missing = CheckpointNotFoundError("step-9: no such file or folder", path="step-9")
    missing.filename = "step-9"
    assert str(missing) == "step-9: no such file or folder" and missing.path == "step-9" and missing.key is None


def test_a_missing_checkpoint_is_a_file_not_found(tmp_path):
    path = tmp_path / "step-100"
    with pytest.raises(FileNotFoundError) as caught:
        dcptool.open(path)
    assert isinstance(caught.value, CheckpointError) and caught.value.path == str(path)
    assert str(caught.value) == f"{path}: no such file or folder"
    with pytest.raises(CheckpointNotFoundError):
        dcptool.convert(path, tmp_path / "out", to="torch")
    result = cli("inspect", path, check=False)
    assert result.returncode == 2 and result.stderr.splitlines() == [f"dcptool: error: {path}: no such file or folder"]
    # A folder that is no checkpoint is there: not a FileNotFoundError
    with pytest.raises(CheckpointError) as caught:
        dcptool.open(tmp_path)
    assert not isinstance(caught.value, FileNotFoundError)


def test_an_existing_output_is_a_file_exists(tmp_path):
    save_file({"w": np.ones((2, 2), np.float32)}, tmp_path / "model.safetensors")
    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"mine")
    with pytest.raises(FileExistsError) as caught:
        dcptool.convert(tmp_path / "model.safetensors", taken, to="torch")
    assert isinstance(caught.value, UsageError) and caught.value.path == str(taken)
    assert str(caught.value) == f"{taken}: already exists (pass --overwrite to replace it)"
    result = cli("convert", tmp_path / "model.safetensors", taken, "--to", "torch", check=False)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == f"dcptool: error: {caught.value}"
    assert taken.read_bytes() == b"mine"


def test_a_tensor_not_there_names_its_key(tmp_path):
    save_file({"w": np.ones((2, 2), np.float32)}, tmp_path / "model.safetensors")
    with dcptool.open(tmp_path) as checkpoint, pytest.raises(ValueError) as caught:
        checkpoint.read("v")
    assert isinstance(caught.value, UsageError) and (caught.value.key, caught.value.path) == ("v", str(tmp_path))


def test_a_failed_read_is_not_relabelled_by_a_value_error_clause(tmp_path, monkeypatch):
    """CheckpointError is a ValueError now: the clauses that turn a parser's ValueError into "not valid
    JSON", "not a torch.save archive" or "a torch file" must not catch it from the read beside the parse."""
    (tmp_path / "config.json").write_text("{}")
    manifest = tmp_path / "dcptool-manifest.json"
    manifest.write_text("{}")
    archive = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(4096)}, archive)
    failure = CheckpointError("the disk went away")

    def failing(*args, **kwargs):
        raise failure

    monkeypatch.setattr(CheckpointFiles, "read_all", failing)
    for read in (lambda: selection.read_config(tmp_path), lambda: checksums.read_manifest(manifest)):
        with pytest.raises(CheckpointError) as caught:
            read()
        assert caught.value is failure
    files = CheckpointFiles(archive)
    reading = CheckpointFiles.read
    monkeypatch.setattr(CheckpointFiles, "read", lambda self, name, offset, size: (
        reading(self, name, offset, size) if offset == 0 else failing()))
    with pytest.raises(CheckpointError) as caught:
        torch_archive.Archive(files, "big.pt")  # its zip directory is past the first bytes read
    assert caught.value is failure
    unnamed = tmp_path / "big"  # no suffix: known by its first bytes
    unnamed.write_bytes(archive.read_bytes())
    monkeypatch.setattr(CheckpointFiles, "read", failing)
    with pytest.raises(CheckpointError) as caught:
        formats.get("torch").detect(CheckpointFiles(unnamed))
    assert caught.value is failure


@pytest.mark.parametrize("module", [errors, dtypes, mesh])
def test_doctests_run(module, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # errors' example opens a path that is not there
    result = doctest.testmod(module)
    assert result.attempted and not result.failed
