"""dcptool verify: checkpoints of different formats and layouts compared, with differences named exactly."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dcptool, load_reference
from safetensors.numpy import save_file

from dcptool import formats, verification
from dcptool.errors import CheckpointError
from dcptool.formats import open_checkpoint

UP = "layers.0.mlp.up_proj.weight"  # a TP-colwise weight: FSDP2 + TP saves it as _StridedShard chunks


@pytest.fixture(scope="module")
def exports(checkpoints, tmp_path_factory):
    """The (dp=2, tp=2) AReaL-layout DCP checkpoint, its HF export and its torch export, made with dcptool's CLI."""
    path, reference = checkpoints("fsdp2_dp2_tp2")
    out = tmp_path_factory.mktemp("exports")
    dcptool("export-hf", path, out / "hf")
    dcptool("convert", path, out / "full.pt", "--to", "torch")
    return {"dcp": path, "hf": out / "hf", "torch": out / "full.pt", "reference": reference}


def run_verify(*args):
    """``dcptool verify ARGS --json``: (exit code, report or None, stderr)."""
    result = dcptool("verify", *args, "--json", check=False)
    report = json.loads(result.stdout) if result.stdout.strip() else None
    return result.returncode, report, result.stderr


def key_ending(checkpoint_path, suffix):
    return next(k for k in open_checkpoint(checkpoint_path).tensors if k.endswith(suffix))


def test_dcp_hf_export_and_torch_export_are_all_equal(exports):
    full = load_reference(exports["reference"])
    model_keys = [k for k in full if k.startswith("dcp.model.")]
    pairs = [
        (exports["dcp"], exports["torch"], []),
        (exports["dcp"], exports["hf"], ["--prefix-a", "dcp.model"]),
        (exports["torch"], exports["hf"], ["--prefix-a", "dcp.model"]),
        (exports["hf"], exports["dcp"], ["--prefix-b", "auto"]),
    ]
    for a, b, options in pairs:
        code, report, stderr = run_verify(a, b, *options)
        assert code == 0, (a, b, stderr, report and report["differences"][:5])
        assert report["equal"] and report["differences"] == []
        # Every tensor was compared by value, not skipped: the counts come from torch's own gathered state.
        expected = full if not options else model_keys
        assert report["tensors_compared"] == len(expected), (a, b)
        assert report["bytes_compared"] == sum(full[k].numel() * full[k].element_size() for k in expected)


def test_equal_to_the_state_torch_gathered_itself(exports, tmp_path):
    """The strided (dp, tp) chunks read as one tensor equal what the job's own full_tensor() gave."""
    torch.save(load_reference(exports["reference"]), tmp_path / "gathered.pt")
    code, report, stderr = run_verify(exports["dcp"], tmp_path / "gathered.pt", "--exclude", r"^train_state|param_groups")
    assert code == 0, (stderr, report)
    assert report["tensors_compared"] == len(load_reference(exports["reference"]))


def test_every_difference_is_listed_with_the_first_differing_index(exports, tmp_path):
    full = load_reference(exports["reference"])
    keys = sorted(k for k in full if k.startswith("dcp.model.") and full[k].dim() == 2)
    value_key, second_value_key, dtype_key, shape_key, missing_key = keys[:5]
    changed = dict(full)
    changed[value_key] = full[value_key].clone()
    changed[value_key][3, 5] += 1.0
    changed[value_key][7, 1] -= 1.0
    changed[second_value_key] = full[second_value_key].clone()
    changed[second_value_key][-1, -1] = float("nan")
    changed[dtype_key] = full[dtype_key].to(torch.bfloat16)
    changed[shape_key] = full[shape_key][:-1].clone()
    del changed[missing_key]
    changed["dcp.model.extra.weight"] = torch.ones(2)
    torch.save(changed, tmp_path / "changed.pt")

    code, report, stderr = run_verify(exports["dcp"], tmp_path / "changed.pt", "--exclude", r"^train_state|param_groups")
    assert code == 1, stderr
    assert "differ" in stderr and len(stderr.strip().splitlines()) == 1
    found = {d["key"]: d for d in report["differences"]}
    assert {k: d["kind"] for k, d in found.items()} == {
        value_key: "value", second_value_key: "value", dtype_key: "dtype", shape_key: "shape",
        missing_key: "missing", "dcp.model.extra.weight": "extra",
    }
    assert found[value_key]["first_index"] == [3, 5] and found[value_key]["count"] == 2
    rows, cols = full[second_value_key].shape
    assert found[second_value_key]["first_index"] == [rows - 1, cols - 1]
    assert not report["equal"]


def test_nan_payloads_compare_bitwise(exports, tmp_path):
    full = load_reference(exports["reference"])
    key = next(k for k in full if k.endswith(UP))
    quiet, other = full.copy(), full.copy()
    quiet[key], other[key] = full[key].clone(), full[key].clone()
    quiet[key].view(torch.int32)[0, 0] = 0x7FC00000  # the canonical NaN
    other[key].view(torch.int32)[0, 0] = 0x7FC00001  # a NaN with another payload
    torch.save(quiet, tmp_path / "quiet.pt")
    torch.save(other, tmp_path / "other.pt")
    assert run_verify(tmp_path / "quiet.pt", tmp_path / "quiet.pt")[0] == 0
    code, report, _ = run_verify(tmp_path / "quiet.pt", tmp_path / "other.pt")
    assert code == 1 and [d["key"] for d in report["differences"]] == [key]
    # With tolerances, NaN in both places counts as equal.
    assert run_verify(tmp_path / "quiet.pt", tmp_path / "other.pt", "--atol", "0")[0] == 0


def test_tolerances_report_the_largest_differences(exports, tmp_path):
    full = load_reference(exports["reference"])
    key = next(k for k in full if k.endswith(UP))
    nudged = dict(full)
    nudged[key] = full[key].clone()
    nudged[key][2, 3] += 1e-3
    torch.save(nudged, tmp_path / "nudged.pt")
    original, changed = full[key][2, 3].double().item(), nudged[key][2, 3].double().item()
    expected_abs, expected_rel = abs(changed - original), abs(changed - original) / abs(original)
    options = ["--exclude", r"^train_state|param_groups"]

    code, report, stderr = run_verify(exports["dcp"], tmp_path / "nudged.pt", "--atol", "1e-2", *options)
    assert code == 0, stderr
    assert report["mode"] == "tolerance" and report["atol"] == 1e-2 and report["rtol"] == 0
    assert report["tensors"][key]["max_abs"] == pytest.approx(expected_abs, rel=1e-12)
    assert report["tensors"][key]["max_rel"] == pytest.approx(expected_rel, rel=1e-12)
    assert all(v == {"max_abs": 0.0, "max_rel": 0.0} for k, v in report["tensors"].items() if k != key)

    code, report, _ = run_verify(exports["dcp"], tmp_path / "nudged.pt", "--atol", "1e-5", *options)
    assert code == 1
    assert [(d["key"], d["kind"], d["first_index"]) for d in report["differences"]] == [(key, "value", [2, 3])]


def test_float32_against_its_bfloat16_export_within_tolerance(exports, tmp_path):
    dcptool("export-hf", exports["dcp"], tmp_path / "bf16", "--dtype", "bfloat16")
    code, report, _ = run_verify(exports["dcp"], tmp_path / "bf16", "--prefix-a", "dcp.model")
    assert code == 1 and {d["kind"] for d in report["differences"]} == {"dtype"}
    code, report, stderr = run_verify(exports["dcp"], tmp_path / "bf16", "--prefix-a", "dcp.model", "--rtol", "1e-2")
    assert code == 0, stderr
    worst = max(v["max_rel"] for v in report["tensors"].values())
    assert 0 < worst <= 2**-8  # bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it


def test_human_output_names_each_difference(exports, tmp_path):
    full = load_reference(exports["reference"])
    key = next(k for k in full if k.endswith(UP))
    changed = dict(full)
    changed[key] = full[key].clone()
    changed[key][1, 2] = 7.0
    torch.save(changed, tmp_path / "changed.pt")
    result = dcptool("verify", exports["dcp"], tmp_path / "changed.pt", "--exclude", r"^train_state|param_groups", check=False)
    assert result.returncode == 1
    assert f"value    {key}: 1 of" in result.stdout and "first at [1, 2]" in result.stdout


@pytest.mark.parametrize("source, via", [("dcp", "hf"), ("dcp", "torch"), ("dcp", "fsdp1"), ("dcp", "dcp"),
                                         ("torch", "fsdp1"), ("hf", "dcp"), ("hf", "hf")])
def test_roundtrip_passes(exports, source, via):
    code, report, stderr = run_verify(exports[source], "--roundtrip", via)
    assert code == 0, (stderr, report and report["differences"][:5])
    assert report["roundtrip"] == via and report["tensors_compared"] > 0
    holds_everything = via in ("torch", "dcp") or source == "hf"
    assert bool(report["left_out"]) != holds_everything
    if via in ("hf", "fsdp1") and source != "hf":
        assert all(k.startswith(("dcp.optim.", "train_state")) for k in report["left_out"])


def test_roundtrip_catches_a_converter_that_corrupts_a_tensor(exports, monkeypatch):
    """A round trip through a torch writer that flips one byte of one tensor is reported, naming it."""
    writer = type(formats.get("torch").writer(Path(os.devnull) / "any.pt"))  # the torch format's writer class
    finish_files = writer.finish_files

    def corrupting(self, objects, files, crcs):
        records = finish_files(self, objects, files, crcs)
        piece = next(p for p in crcs if p.tensor.key.endswith(UP))
        name, offset = self.place(piece)
        with open(self.out.folder / name, "r+b") as file:
            file.seek(offset)
            first = file.read(1)[0]
            file.seek(offset)
            file.write(bytes([first ^ 0x01]))
        return records

    monkeypatch.setattr(writer, "finish_files", corrupting)
    # the byte changed after its record's CRC-32 was computed: reading the round trip back refuses the record
    with pytest.raises(CheckpointError, match=f"holds {re.escape(key_ending(exports['dcp'], UP))}.*CRC-32"):
        verification.roundtrip(exports["dcp"], "torch")
    with formats.records_checked(False):  # unchecked, the values differ where the byte was flipped
        report = verification.roundtrip(exports["dcp"], "torch")
    assert [(d.key, d.kind, d.first_index) for d in report.differences] == [(key_ending(exports["dcp"], UP), "value", [0, 0])]


def test_bad_input_exits_2_naming_the_file(exports, tmp_path):
    result = dcptool("verify", exports["dcp"], tmp_path / "nothing-here", check=False)
    assert result.returncode == 2 and "nothing-here" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = dcptool("verify", exports["dcp"], "--roundtrip", "onnx", check=False)
    assert result.returncode == 2 and "onnx" in result.stderr
    result = dcptool("verify", exports["dcp"], check=False)
    assert result.returncode == 2 and "--roundtrip" in result.stderr


def test_verify_and_checksum_never_import_torch(exports, tmp_path):
    script = (
        "import sys\n"
        "from dcptool.cli import main\n"
        "for argv in sys.argv[1:]:\n"
        "    try:\n"
        "        main(argv.split('|'))\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, (argv, exit.code)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    copy = tmp_path / "copy.pt"
    copy.write_bytes(exports["torch"].read_bytes())
    commands = [f"verify|{exports['dcp']}|{exports['hf']}|--prefix-a|dcp.model", f"verify|{exports['dcp']}|--roundtrip|hf",
                f"checksum|{copy}|--write", f"checksum|{copy}|--check", f"checksum|{copy}|--against|{exports['dcp']}"]
    result = subprocess.run([sys.executable, "-c", script, *commands], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# Memory: comparing two checkpoints streams both within the budget.

BUDGET_MB = 16


def peak_rss_mb(*args) -> float:
    """Peak resident memory of one dcptool run, measured in a fresh parent so no earlier child counts."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    result = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "dcptool", "--quiet", *map(str, args)],
                            capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    return int(result.stdout.strip().splitlines()[-1]) / 1024


@pytest.fixture(scope="module")
def big_pair(tmp_path_factory):
    """~200 MB of random float32 weights as HF safetensors, and the DCP checkpoint import-hf makes of it."""
    out = tmp_path_factory.mktemp("big")
    rng = np.random.default_rng(0)
    (out / "hf").mkdir()
    save_file({f"layers.{i}.weight": rng.standard_normal((2048, 3072), dtype=np.float32) for i in range(8)},
              str(out / "hf" / "model.safetensors"))
    dcptool("import-hf", out / "hf", out / "dcp")
    return out / "hf", out / "dcp"


def test_verify_streams_within_the_memory_budget(big_pair):
    hf, dcp = big_pair
    model_mb = (hf / "model.safetensors").stat().st_size / 2**20
    assert model_mb > 10 * BUDGET_MB
    baseline = peak_rss_mb("inspect", dcp, "--json")  # start-up and metadata, no data moved
    peak = peak_rss_mb("verify", hf, dcp, "--max-memory", f"{BUDGET_MB}MiB")
    assert peak - baseline < BUDGET_MB + 24, (peak, baseline, model_mb)
