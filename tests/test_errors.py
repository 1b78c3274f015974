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
from dcptool import dtypes, errors, formats, mesh, selection, torch_archive
from dcptool.checks import checksums
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
    assert str(caught.value) == f"{taken}: already exists (pass writing.overwrite=True to replace it)"  # the API's option
    result = cli("convert", tmp_path / "model.safetensors", taken, "--to", "torch", check=False)
    assert result.returncode == 2  # the command line's flag
    assert result.stderr.splitlines()[-1] == f"dcptool: error: {taken}: already exists (pass --overwrite to replace it)"
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


def test_messages_name_keyword_arguments_in_the_api_and_flags_on_the_command_line(tmp_path):
    """One refusal (or note), two namings: ``writing.overwrite=True`` raised by the API (an option object's field by
    the keyword the object was passed as), ``--overwrite`` printed by the CLI."""
    source = tmp_path / "model.safetensors"
    save_file({"model.norm.weight": np.ones(4, np.float32)}, source)
    taken = tmp_path / "taken.pt"
    taken.write_bytes(b"mine")
    cases = [  # (API call, command line, what the API says, what the command line says)
        (lambda: dcptool.convert(source, taken, to="torch"), ["convert", source, taken, "--to", "torch"],
         "(pass writing.overwrite=True to replace it)", "(pass --overwrite to replace it)"),
        (lambda: dcptool.convert(source, tmp_path / "o.pt", to="torch", selection=dcptool.Selection(include="^nothing")),
         ["convert", source, tmp_path / "o.pt", "--to", "torch", "--include", "^nothing"],
         "no tensor matches the selection.include/selection.exclude filters",
         "no tensor matches the --include/--exclude filters"),
        (lambda: dcptool.reshard(source, tmp_path / "r", mesh=dcptool.MeshOptions(tp=2, etp=3)),
         ["reshard", source, tmp_path / "r", "--tp", "2", "--etp", "3"],
         "mesh.etp=3: must be 1 or equal to mesh.tp (2)", "--etp 3: must be 1 or equal to --tp (2)"),
        (lambda: dcptool.convert(source, tmp_path / "o.pt", to="torch", reading=dcptool.Reading(max_memory="12XB")),
         ["convert", source, tmp_path / "o.pt", "--to", "torch", "--max-memory", "12XB"],
         "reading.max_memory='12XB': not a size", "--max-memory 12XB: not a size"),
        (lambda: dcptool.convert(source, tmp_path / "o", to="hf",
                                 format_options=dcptool.format_options("fsdp1", world_size=2)),
         ["convert", source, tmp_path / "o", "--to", "hf", "--world-size", "2"],
         "format_options.world_size=2 goes with to='fsdp1'", "--world-size 2 goes with --to fsdp1"),
        (lambda: dcptool.import_hf(source.parent, tmp_path / "r", family="megatron", mesh=dcptool.MeshOptions(dp=2)),
         ["import-hf", source.parent, tmp_path / "r", "--adapter", "megatron", "--dp", "2"],
         "family='megatron' writes one Megatron-Core checkpoint", "--adapter megatron writes one Megatron-Core checkpoint"),
        (lambda: dcptool.verify(source, roundtrip="hf", side_b=dcptool.Side(format="hf")),
         ["verify", source, "--roundtrip", "hf", "--from-b", "hf"],
         "give no B, side_a.prefix, side_b.prefix or side_b.format", "give no B, --prefix-a, --prefix-b or --from-b")]
    for api_call, command, in_api, on_command_line in cases:
        with pytest.raises(UsageError) as refused:
            api_call()
        assert in_api in str(refused.value) and "--" not in str(refused.value), refused.value
        result = cli(*command, check=False)
        [line] = result.stderr.splitlines()
        assert result.returncode == 2 and on_command_line in line, line
    assert taken.read_bytes() == b"mine" and not (tmp_path / "o.pt").exists() and not (tmp_path / "r").exists()

    # Notes too: export-hf without a config folder.
    with pytest.raises(UsageError) as refused:  # an option the command does not take
        dcptool.verify(source, source, reading=dcptool.Reading(dequantize=True))
    assert str(refused.value) == "reading.dequantize=True: verify does not take it"
    notes = dcptool.export_hf(source, tmp_path / "hf").notes
    assert any(note.endswith("give the model's config folder with config_dir") for note in notes), notes
    printed = cli("export-hf", source, tmp_path / "hf-cli")
    assert "give the model's config folder with --config-dir" in printed.stderr, printed.stderr


def test_every_option_a_message_names_is_a_flag_of_the_command_line():
    """The option names that messages give ``errors.option`` (and parse_size / parse_mesh) are keyword arguments
    that the command line takes as flags, each keyword as one flag whichever command takes it."""
    import re
    from pathlib import Path

    from dcptool import cli as command_line

    group = command_line._command()
    flags = command_line.flags(group)
    for command in group.commands.values():
        for param in command.params:
            if param.param_type_name == "option":
                assert flags[param.name] in param.opts, (command.name, param.name)
    package = Path(dcptool.__file__).parent
    sources = [p for p in package.rglob("*.py") if "cli" not in p.parts] + list(package.joinpath("converters").rglob("*.py"))
    named = set()
    for path in sources:
        text = path.read_text()
        named |= set(re.findall(r"""\boption\(\s*['"](\w+)['"]""", text))
        named |= set(re.findall(r"""\bparse_(?:size|mesh)\([^,()]+,\s*['"](\w+)['"]\)""", text))
    assert len(named) > 30 and named <= set(flags), sorted(named - set(flags))
