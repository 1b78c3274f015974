"""The Python API (dcptool.api, re-exported by dcptool): its doctests, and reads, conversions, reshards,
verifies and checksums of a real gloo DCP save checked against the job's own tensors and torch's readers."""

import doctest
import importlib
import json
import pkgutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from conftest import load_reference, read_dcp
from safetensors.torch import save_file

import dcptool
import dcptool.api as api
from dcptool.errors import CheckpointError, UsageError


def test_doctests_run(tmp_path, monkeypatch):
    """Every example in the package's docstrings runs (the API's Args/Returns/Example ones first among them)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the examples' folders go here
    attempted = {}
    for module_info in pkgutil.walk_packages(dcptool.__path__, "dcptool."):  # dcptool/converters links the formats
        module = importlib.import_module(module_info.name)
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module_info.name
        attempted[module_info.name] = result.attempted
    assert attempted["dcptool.api"] >= 20 and attempted["dcptool.reader"] >= 5
    assert sum(attempted.values()) >= 80 and any(name.startswith("dcptool.converters.") for name in attempted)


def test_the_commands_are_functions_of_the_package():
    for name in ("open", "convert", "export_hf", "import_hf", "reshard", "verify", "checksum", "check"):
        function = getattr(dcptool, name)
        assert callable(function) and function is getattr(api, name) and function.__doc__, name


def test_import_is_cheap_and_never_imports_torch():
    code = ("import sys, dcptool; assert 'dcptool.api' not in sys.modules and 'numpy' not in sys.modules; "
            "names = [getattr(dcptool, n) for n in dcptool.__all__]; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_dir_and_star_import_list_every_entry_point_before_it_is_loaded():
    """``dir(dcptool)`` and ``from dcptool import *`` name every function of dcptool.api and every error,
    in a process where none of them has been loaded yet."""
    code = ("import json, sys, dcptool; listed = dir(dcptool); loaded = 'dcptool.api' in sys.modules; "
            "names = {}; exec('from dcptool import *', names); "
            "print(json.dumps([listed, loaded, sorted(n for n in names if n != '__builtins__'), dcptool.__all__]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, loaded, star, exported = json.loads(result.stdout)
    errors = [name for name, value in vars(dcptool.errors).items()
              if isinstance(value, type) and issubclass(value, dcptool.DcptoolError)]
    assert not loaded
    assert {"open", "verify"} <= set(api.__all__) and set(api.__all__) | {"api"} | set(errors) == set(exported)
    assert set(exported) <= set(listed) and sorted(exported) == star
    assert all(getattr(dcptool, name) is getattr(api, name) for name in api.__all__)


def test_open_and_read_regions_of_a_gloo_save(checkpoints):
    path, reference = checkpoints("fsdp2_dp2_tp2")  # FSDP2 + TP: strided shards over 4 rank files
    full = load_reference(reference)
    with dcptool.open(path) as ckpt:
        assert ckpt.format == "dcp" and ckpt.objects
        assert set(ckpt) == {k for k, v in full.items() if isinstance(v, torch.Tensor)}
        for key in ckpt:
            expected = full[key]
            assert ckpt[key].shape == tuple(expected.shape) and ckpt[key].dtype == str(expected.dtype)[6:]
            assert torch.equal(ckpt.read(key, as_torch=True), expected), key
            if expected.dim() == 2:
                rows, cols = expected.shape
                region = (slice(rows // 3, rows - 1), slice(1, None))
                assert np.array_equal(ckpt.read(key, region), expected[region].numpy()), key
                box = ((1, cols // 2), (rows - 2, cols - cols // 2))
                assert np.array_equal(ckpt.read(key, box), expected[1:rows - 1, cols // 2:].numpy()), key
                assert np.array_equal(ckpt.read(key, -1), expected[-1].numpy()), key


def test_bfloat16_reads_as_numpy_through_ml_dtypes_and_as_torch(tmp_path):
    values = torch.randn(5, 4).to(torch.bfloat16)
    save_file({"w": values}, tmp_path / "model.safetensors")
    ckpt = dcptool.open(tmp_path)
    assert torch.equal(ckpt.read("w", as_torch=True), values)
    assert np.array_equal(ckpt.read("w", (slice(1, 3),)).astype(np.float32), values[1:3].float().numpy())


def test_bad_keys_and_regions_are_usage_errors_naming_the_checkpoint(tmp_path, checkpoints):
    path, _ = checkpoints("fsdp2_dp2_tp2")
    ckpt = dcptool.open(path)
    key = next(k for k in ckpt if len(ckpt[k].shape) == 2)
    refused = {
        "nope": lambda: ckpt.read("nope"),
        "a non-tensor entry": lambda: ckpt.read(ckpt.objects[0]),
        "steps other than 1": lambda: ckpt.read(key, (slice(0, 4, 2),)),
        "out of range": lambda: ckpt.read(key, (ckpt[key].shape[0],)),
        "do not fit": lambda: ckpt.read(key, ((0, 0), (1, ckpt[key].shape[1] + 1))),
        "3 entries": lambda: ckpt.read(key, (0, 0, 0)),
    }
    for message, call in refused.items():
        with pytest.raises(UsageError, match=message) as error:
            call()
        assert str(path) in str(error.value)
    with pytest.raises(CheckpointError, match="no such file"):
        dcptool.open(tmp_path / "missing")
    with pytest.raises(UsageError, match="give the checkpoint B"):
        dcptool.verify(path)
    with pytest.raises(UsageError, match="dtype='int8'"):
        dcptool.convert(path, tmp_path / "x.pt", to="torch", dtype="int8")
    assert not (tmp_path / "x.pt").exists()


def test_convert_reshard_verify_checksum_of_a_gloo_save(checkpoints, tmp_path):
    path, reference = checkpoints("fsdp2_dp2_tp2")
    full = load_reference(reference)
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}

    report = dcptool.convert(path, tmp_path / "whole.pt", to="torch", reading=dcptool.Reading(max_memory="64KiB"))
    assert report.tensors == len(tensors)
    saved = torch.load(tmp_path / "whole.pt", weights_only=True)
    flat = {}

    def flatten(tree, prefix=""):
        for name, value in tree.items():
            flatten(value, f"{prefix}{name}.") if isinstance(value, dict) else flat.__setitem__(prefix + name, value)

    flatten(saved)
    assert all(torch.equal(flat[k], v) for k, v in tensors.items())

    resharded = dcptool.reshard(path, tmp_path / "tp2", mesh=dcptool.MeshOptions(dp=1, tp=2), config_dir=reference)
    assert (resharded.mesh.dp, resharded.mesh.tp) == (1, 2)
    loaded = read_dcp(tmp_path / "tp2", tmp_path)  # torch's own reader
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())

    assert dcptool.verify(path, tmp_path / "whole.pt").equal
    assert dcptool.verify(path, tmp_path / "tp2").equal
    assert dcptool.verify(path, roundtrip="hf").equal

    assert dcptool.checksum(path, manifest=tmp_path / "m.json", write=True).ok
    assert dcptool.checksum(path, manifest=tmp_path / "m.json", against=tmp_path / "tp2").ok
    exported = dcptool.export_hf(path, tmp_path / "hf", dtype="bfloat16")
    assert exported.tensors and (tmp_path / "hf").is_dir()
    differs = dcptool.verify(path, tmp_path / "hf", side_a=dcptool.Side(prefix="auto"))
    assert not differs.equal and {d.kind for d in differs.differences} == {"dtype"}
