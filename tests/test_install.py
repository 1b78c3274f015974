"""The installs users get: the wheel built from this tree, in fresh venvs, with and without torch.

``pip install dcptool`` (no torch) runs every command but ``verify --load-on``; ``pip install 'dcptool[torch]'``
holds the same formats, naming families and model kinds as the editable install the rest of the suite runs.
The wheel is built once per session from a copy of this repository (a real, non-editable install from the
registry's dependencies, so the package list is tested too); commands then work on real gloo and
megatron-core saves, and their outputs are checked with the torch venv's own readers.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_reference, read_dcp
from safetensors.torch import load_file

# What a built checkout holds beside its sources: never part of the package.
NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     "bench-out", "demo-out")

# What an install knows, printed as JSON by its own python.
KNOWN = ("import json, dcptool.families as families, dcptool.formats as formats, dcptool.models as models; "
         "print(json.dumps({'formats': formats.names(), 'families': families.names(), "
         "'model kinds': sorted(models.kinds())}))")


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a copy of this tree (nothing of a build left in the checkout)."""
    root = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, root / "source", ignore=NOT_SOURCES)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                    "--wheel-dir", root, root / "source"], check=True, capture_output=True)
    [built] = root.glob("dcptool-*.whl")
    return built


def fresh_venv(root: Path, *packages) -> Path:
    """The ``bin`` folder of a new venv holding ``packages`` and their dependencies (pip of this venv installs them:
    ensurepip takes longer than the install)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    bin_dir = root / "bin"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", bin_dir / "python", "install", "-q",
                              "--disable-pip-version-check", *map(str, packages)], capture_output=True, text=True)
    assert install.returncode == 0, f"pip install {packages} failed:\n{install.stderr[-3000:]}"
    return bin_dir


@pytest.fixture(scope="session")
def light(wheel, tmp_path_factory):
    """The ``bin`` folder of a venv holding the wheel and its dependencies, without torch."""
    return fresh_venv(tmp_path_factory.mktemp("light") / "venv", wheel)


@pytest.fixture(scope="session")
def with_torch(wheel, tmp_path_factory):
    """The ``bin`` folder of a venv holding the wheel and the torch the suite runs (its CPU build, pinned)."""
    return fresh_venv(tmp_path_factory.mktemp("with-torch") / "venv", wheel, f"torch=={torch.__version__.split('+')[0]}")


def outside(*args, cwd: Path) -> subprocess.CompletedProcess:
    """``args`` (a fresh venv's program and its arguments) run outside the repository, nothing of it on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([*map(str, args)], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("venv", ["light", "with_torch"])
def test_an_installed_wheel_knows_what_the_editable_install_knows(venv, request, megatron_runs, tmp_path):
    bin_dir = request.getfixturevalue(venv)
    installed = outside(bin_dir / "python", "-c", KNOWN, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    editable = subprocess.run([sys.executable, "-c", KNOWN], capture_output=True, text=True, check=True)
    assert json.loads(installed.stdout) == json.loads(editable.stdout)
    assert "megatron" in json.loads(installed.stdout)["formats"]

    shown = outside(bin_dir / "dcptool", "inspect", megatron_runs("tp2") / "iter_0000100", "--json", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["format"] == "megatron"


def run(light: Path, *args, cwd: Path, expect: int = 0) -> subprocess.CompletedProcess:
    """``dcptool ARGS`` of the light venv, run outside the repository."""
    result = outside(light / "dcptool", "--quiet", *args, cwd=cwd)
    assert result.returncode == expect, f"dcptool {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}"
    return result


def test_the_light_venv_has_no_torch_and_no_top_level_converters(light, tmp_path):
    code = ("import importlib.util as u, dcptool, dcptool.converters; "
            "print(u.find_spec('torch'), u.find_spec('converters'), dcptool.__file__)")
    result = subprocess.run([light / "python", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    torch_spec, converters_spec, location = result.stdout.split()
    assert (torch_spec, converters_spec) == ("None", "None")
    assert location.startswith(str(light.parent)), "dcptool imported from outside the light venv"


def test_every_command_runs_without_torch(light, checkpoints, tmp_path):
    path, reference = checkpoints("fsdp2_dp2_tp2")
    full = {k: v for k, v in load_reference(reference).items() if isinstance(v, torch.Tensor)}
    model = {k.removeprefix("dcp.model."): v for k, v in full.items() if k.startswith("dcp.model.")}

    shown = json.loads(run(light, "inspect", path, "--json", cwd=tmp_path).stdout)
    assert shown["format"] == "dcp" and set(shown["tensors"]) == set(full)

    run(light, "convert", path, tmp_path / "whole.pt", "--to", "torch", cwd=tmp_path)
    saved = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert all(torch.equal(saved["dcp"]["model"][k], v) for k, v in model.items())

    run(light, "convert", path, tmp_path / "dcp", "--to", "dcp", cwd=tmp_path)
    run(light, "reshard", path, tmp_path / "tp2", "--dp", "1", "--tp", "2", "--config-dir", reference, cwd=tmp_path)
    for name in ("dcp", "tp2"):
        loaded = read_dcp(tmp_path / name, tmp_path)  # torch's dcp_to_torch_save
        assert all(torch.equal(loaded[k], v) for k, v in full.items()), name

    run(light, "export-hf", path, tmp_path / "hf", cwd=tmp_path)
    # Without transformers the model kind's table says what the model holds: an untied head left out is refused.
    refused = run(light, "export-hf", path, tmp_path / "no-head", "--config-dir", reference, "--exclude", "lm_head",
                  cwd=tmp_path, expect=2)
    assert "the output lacks the lm_head (1 tensor: lm_head.weight) of the model" in refused.stderr, refused.stderr
    assert "(dcptool's llama table)" in refused.stderr and not (tmp_path / "no-head").exists()
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == model.keys() and all(torch.equal(exported[k], v) for k, v in model.items())
    # quantizing rounds to float8 without torch: the same bytes as this suite's (torch) install writes
    quantize = ["export-hf", path, "--quantize", "fp8", "--block-size", "32x32"]
    run(light, *quantize[:2], tmp_path / "fp8-light", *quantize[2:], cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "dcptool", "-q", *quantize[:2], tmp_path / "fp8-torch", *quantize[2:]],
                   check=True, capture_output=True)
    assert (tmp_path / "fp8-light" / "model.safetensors").read_bytes() == \
        (tmp_path / "fp8-torch" / "model.safetensors").read_bytes()
    run(light, "import-hf", tmp_path / "hf", tmp_path / "imported", "--dp", "2", cwd=tmp_path)
    imported = read_dcp(tmp_path / "imported", tmp_path)
    assert imported.keys() == model.keys() and all(torch.equal(imported[k], v) for k, v in model.items())

    # fsdp1 files are torch.save pickles that only a process group unpickles: the light venv's must be the
    # torch venv's, byte for byte (tests/test_fsdp1.py loads those in a real FSDP1 job).
    run(light, "convert", path, tmp_path / "fsdp1-light", "--to", "fsdp1", "--world-size", "2", cwd=tmp_path)
    subprocess.run([sys.executable, "-m", "dcptool", "-q", "convert", path, tmp_path / "fsdp1-torch", "--to", "fsdp1",
                    "--world-size", "2"], check=True, capture_output=True)
    names = sorted(p.name for p in (tmp_path / "fsdp1-torch").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "fsdp1-light").iterdir())
    assert all((tmp_path / "fsdp1-light" / n).read_bytes() == (tmp_path / "fsdp1-torch" / n).read_bytes() for n in names)

    assert run(light, "verify", path, tmp_path / "tp2", cwd=tmp_path).stdout.splitlines()[-1].startswith("equal")
    run(light, "verify", path, tmp_path / "hf", "--prefix-a", "auto", cwd=tmp_path)
    run(light, "checksum", path, "--write", "--manifest", tmp_path / "manifest.json", cwd=tmp_path)
    run(light, "checksum", path, "--check", "--manifest", tmp_path / "manifest.json", cwd=tmp_path)
    run(light, "checksum", path, "--against", tmp_path / "tp2", "--manifest", tmp_path / "manifest.json", cwd=tmp_path)

    refused = run(light, "verify", path, "--load-on", "dp=2", cwd=tmp_path, expect=2)
    assert refused.stderr.strip().splitlines() == ["dcptool: error: --load-on needs torch: pip install 'dcptool[torch]'"]


def test_transformers_plans_come_from_the_snapshot_without_transformers(light, tmp_path):
    """The light venv has no transformers: Qwen3-Next's plan (no dcptool table) is read from the snapshot the
    wheel ships, named as such."""
    code = ("import importlib.util as u, json; from dcptool.planning import plans; "
            "plan = plans.choose('auto', ['model.layers.0.linear_attn.in_proj_qkvz.weight'], "
            "{'model_type': 'qwen3_next'}, tp=2); "
            "rule = plan.rule_for('model.layers.0.linear_attn.in_proj_qkvz.weight'); "
            "print(json.dumps([u.find_spec('transformers') is None, plan.name, plan.description, rule.tp]))")
    result = subprocess.run([light / "python", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    no_transformers, name, description, split = json.loads(result.stdout)
    assert no_transformers and (name, split) == ("transformers", "colwise")
    assert description.startswith("Qwen3NextForCausalLM's tp plan from dcptool's snapshot of transformers ")


def test_the_python_api_runs_without_torch(light, checkpoints, tmp_path):
    path, reference = checkpoints("fsdp2_dp2_tp2")
    key = "dcp.model.model.embed_tokens.weight"
    code = (f"import doctest, sys, dcptool, dcptool.api\n"
            f"assert doctest.testmod(dcptool.api).failed == 0\n"
            f"values = dcptool.open({str(path)!r}).read({key!r}, (slice(3, 7), slice(None, 5)))\n"
            f"print(values.dtype, values.tolist())\n"
            f"try:\n    dcptool.open({str(path)!r}).read({key!r}, as_torch=True)\n"
            f"except dcptool.UsageError as exc:\n    print(exc)\n"
            f"assert 'torch' not in sys.modules\n")
    result = subprocess.run([light / "python", "-c", code], cwd=tmp_path, capture_output=True, text=True, env={
        **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "TMPDIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    first, refused = result.stdout.splitlines()
    expected = load_reference(reference)[key][3:7, :5]
    assert first == f"float32 {expected.tolist()}"
    assert refused == "as_torch=True needs torch: pip install 'dcptool[torch]'"
