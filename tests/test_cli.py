"""The command line's habits: global options anywhere, --version, -h, choices in help, wrong-path
errors that say what to pass, one line of what an output left out, verify's automatic prefix, and
export-hf checking the config it writes (transformers' from_pretrained as the oracle)."""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import dcptool
from harness.family_models import MODELS, save_hf

from dcptool import cli, formats


def one_line(result) -> str:
    """The refusal of a bad input: exit 2, a single stderr line, no traceback."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A DCP checkpoint saved by torch in this process: a model, its optimizer state, a step counter."""
    path = tmp_path_factory.mktemp("small") / "step-7"
    state = {"model": {"a.weight": torch.randn(4, 3), "b.weight": torch.randn(3)},
             "optim": {"state": {"a.weight": {"exp_avg": torch.zeros(4, 3), "step": torch.tensor(1.0)}},
                       "param_groups": [{"lr": 0.1}]},
             "train_state": {"step": 7}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=path)
    return path


def test_version_help_and_choices():
    assert dcptool("--version").stdout.strip() == f"dcptool {version('dcptool')}"
    assert "Usage: dcptool inspect" in dcptool("inspect", "-h").stdout
    env = {**os.environ, "COLUMNS": "200"}  # wide enough that no choice list wraps
    shown = subprocess.run([sys.executable, "-m", "dcptool", "convert", "--help"], capture_output=True, text=True,
                           env=env, check=True).stdout
    assert f"Choices: {', '.join(formats.writable())}." in shown and "Choices: bfloat16, float16, float32." in shown, shown
    assert re.search(r"--to +FORMAT", shown) and re.search(r"--dtype +DTYPE", shown)
    assert "<bool>" not in shown, shown
    line = one_line(dcptool("reshard", "a", "b", "--to", "torch", check=False))
    assert "'torch' is not one of 'dcp', 'fsdp1'" in line and "dcptool reshard -h" in line


def test_top_level_help_lists_every_format_of_the_registry():
    """``dcptool --help`` names every format module of converters/ (found here by its source), with what it is."""
    from pathlib import Path

    converters = Path(__file__).resolve().parents[1] / "converters"
    modules = [p for p in [*converters.glob("*.py"), *converters.glob("*/__init__.py")] if "\nFORMAT = " in p.read_text()]
    assert len(modules) == len(formats.names()) >= 7
    shown = " ".join(dcptool("--help").stdout.replace("│", " ").split())
    for name in formats.names():
        fmt = formats.get(name)
        assert f"{name} ({fmt.title}{'' if fmt.writable else '; read only'})" in shown, (name, shown)


def test_help_at_80_columns_shows_every_description_whole():
    """Each command's help, at 80 columns: no description cut with an ellipsis, every word of every
    option's and argument's description shown whole, every option of choices naming them."""
    from rich.text import Text

    group = cli._command()
    env = {**os.environ, "COLUMNS": "80"}
    for name, command in [(None, group), *group.commands.items()]:
        shown = subprocess.run([sys.executable, "-m", "dcptool", *([name] if name else []), "--help"],
                               capture_output=True, text=True, env=env, check=True).stdout
        assert "…" not in shown and max(map(len, shown.splitlines())) <= 80, shown
        words = set(shown.replace("│", " ").split())
        for param in command.params:
            described = Text.from_markup(param.help or "").plain
            assert not [word for word in described.split() if word not in words], (name, param.name, shown)
            for choice in getattr(param.type, "choices", None) or ():
                assert choice in described, (name, param.name, choice)


def test_global_options_after_the_command(small):
    assert "(dcp)" in dcptool("inspect", small, "--debug", "-q").stdout
    assert json.loads(dcptool("--json", "inspect", small).stdout)["format"] == "dcp"
    missing = dcptool("inspect", small / "nothing-here", "--debug", check=False)
    assert missing.returncode == 2 and "Traceback" in missing.stderr  # --debug after the command took effect
    # A value that looks like a global flag stays the value of its option; nothing after -- moves.
    group = cli._command()
    assert cli._arranged(group, ["inspect", "x", "--include", "-q", "--debug"]) == \
        ["--debug", "inspect", "x", "--include", "-q"]
    assert cli._arranged(group, ["verify", "--", "-q", "x"]) == ["verify", "--", "-q", "x"]


def test_plural_forms(small):
    assert "4 tensors, 112 bytes of tensor data; 1 data file," in dcptool("inspect", small).stdout


def test_wrong_paths_say_what_to_pass(small, tmp_path):
    data_file = next(small.glob("*.distcp"))
    for part in (data_file, small / ".metadata"):
        line = one_line(dcptool("inspect", part, check=False))
        assert f"pass its folder {small}" in line, line

    fsdp1 = tmp_path / "actor"
    dcptool("convert", small, fsdp1, "--to", "fsdp1", "--world-size", "2")
    line = one_line(dcptool("inspect", fsdp1 / "model_world_size_2_rank_1.pt", check=False))
    assert "one rank's file of an FSDP1" in line and f"pass its folder {fsdp1}" in line, line

    run = tmp_path / "run"
    for step in (100, 1000, 200, 300, 400, 500):
        shutil.copytree(small, run / f"step-{step}")
    line = one_line(dcptool("convert", run, tmp_path / "out.pt", "--to", "torch", check=False))
    assert "a folder holding 6 checkpoints" in line, line
    assert line.endswith("step-1000, step-500, step-400, step-300, step-200 and 1 more"), line
    assert not (tmp_path / "out.pt").exists()

    # Names without a step number: newest by modification time.
    named = tmp_path / "named"
    for age, name in enumerate(["latest", "older", "oldest"]):
        shutil.copytree(small, named / name)
        os.utime(named / name, (1e9 - age * 1000, 1e9 - age * 1000))
    assert one_line(dcptool("inspect", named, check=False)).endswith("latest, older, oldest")

    line = one_line(dcptool("inspect", "no-such-org/no-such-model", check=False))
    assert "no-such-org/no-such-model" in line and "hub" in line, line


def test_every_command_says_what_it_left_out(small, tmp_path):
    result = dcptool("export-hf", small, tmp_path / "hf")
    left = [line for line in result.stdout.splitlines() if line.startswith("left out")]
    assert left == ["left out: 2 optimizer tensors, 2 non-tensor entries (export-hf writes model weights only): "
                    "optim.state.a.weight.exp_avg, optim.state.a.weight.step, optim.param_groups.0.lr, train_state.step"]
    assert "no config.json written" in result.stderr and "--config-dir" in result.stderr

    result = dcptool("convert", small, tmp_path / "all-hf", "--to", "hf")
    assert "left out: 2 non-tensor entries (hf cannot hold them)" in result.stdout, result.stdout

    result = dcptool("convert", small, tmp_path / "model.pt", "--to", "torch", "--exclude", "^optim")
    assert "left out: 2 optimizer tensors, 1 non-tensor entry (not selected by --include/--exclude)" in result.stdout

    assert "left out" not in dcptool("convert", small, tmp_path / "all.pt", "--to", "torch").stdout

    result = dcptool("convert", small, tmp_path / "model-hf", "--to", "hf", "--exclude", "^optim")
    assert ("left out: 2 optimizer tensors, 1 non-tensor entry (not selected by --include/--exclude); "
            "1 non-tensor entry (hf cannot hold them)") in result.stdout, result.stdout


def test_verify_against_an_export_finds_the_model_part(small, tmp_path):
    dcptool("export-hf", small, tmp_path / "hf")
    result = dcptool("verify", small, tmp_path / "hf")
    assert result.stdout.splitlines()[2].startswith("left out (B holds a model only): "), result.stdout
    assert "equal: 2 tensors" in result.stdout
    # Given by hand, the prefix is used as given and nothing is said.
    result = dcptool("verify", small, tmp_path / "hf", "--prefix-a", "model")
    assert "prefix-a auto" not in result.stdout + result.stderr


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3_tied", "qwen3_moe", "deepseek_v3"])
def test_export_loads_with_from_pretrained(name, tmp_path):
    from transformers import AutoModelForCausalLM

    source = save_hf(name, tmp_path / "model")
    out = tmp_path / "export"
    dcptool("export-hf", source, out, "--config-dir", source, "--dtype", "bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    original = AutoModelForCausalLM.from_pretrained(source).state_dict()
    for key, value in model.state_dict().items():  # bfloat16 values (a few buffers transformers keeps in float32)
        assert torch.equal(value, original[key].to(torch.bfloat16).to(value.dtype)), key


def test_a_config_that_does_not_fit_is_refused(tmp_path):
    source = save_hf("qwen3_moe", tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    inner = MODELS["qwen3_moe"][1]["moe_intermediate_size"]
    for change, expected in (
        ({"moe_intermediate_size": inner + 8}, "model.layers.0.mlp.experts.0.down_proj.weight: the config gives shape [64, 40], the tensors [64, 32]"),
        ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight: the config gives shape [64, 64], the tensors [32, 64]"),
        ({"model_type": None}, "no model_type"),
    ):
        wrong = tmp_path / f"wrong-{next(iter(change))}"
        wrong.mkdir()
        (wrong / "config.json").write_text(json.dumps({**config, **change}))
        out = tmp_path / "never"
        line = one_line(dcptool("export-hf", source, out, "--config-dir", wrong, check=False))
        assert f"{wrong / 'config.json'} does not fit the tensors" in line and expected in line, line
        assert not out.exists()
    # A layer the config counts and the tensors lack is a part of the model they lack (tests/test_completeness.py).
    deeper = tmp_path / "deeper"
    deeper.mkdir()
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    line = one_line(dcptool("export-hf", source, tmp_path / "never", "--config-dir", deeper, check=False))
    assert re.search(r"the output lacks the decoder layers \(\d+ tensors, e.g. model\.layers\.2\.", line), line
    assert f"the model {deeper / 'config.json'} describes" in line and line.endswith("--allow-missing layers"), line
    assert not (tmp_path / "never").exists()
