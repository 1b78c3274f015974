"""dcptool verify: checkpoints of different formats and layouts compared, with differences named exactly."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dcptool, load_reference, read_dcp
from safetensors.numpy import save_file
from safetensors.torch import save_file as save_torch_file

from dcptool import formats
from dcptool.checks import verification
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


def dcptool_api():
    import dcptool

    return dcptool


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


def test_rtol_measures_against_a_and_fails_just_over_it(exports, tmp_path):
    """``--rtol`` passes where ``|a - b| <= rtol * |a|`` (docs/integrity.md, dcptool/checks/verification.py): a value just under that bound
    passes, one just over it fails, and one that is within ``rtol * |b|`` but not ``rtol * |a|`` fails as A B and
    passes as B A. torch.isclose(b, a) (which measures against its second argument) is the oracle of each."""
    full = load_reference(exports["reference"])
    key = next(k for k in full if k.endswith(UP))
    rtol = 1e-2
    options = ["--rtol", str(rtol), "--exclude", r"^train_state|param_groups"]
    a = full[key].double()

    def near(index, factor, side):
        """The float32 next to ``a * (1 + factor * rtol)`` on ``side`` (+1 above, -1 below) of it, in magnitude."""
        target = np.float32(a[index].item() * (1 + factor * rtol))
        return float(np.nextafter(target, np.float32(side * np.sign(target) * np.inf)))

    under, over, between = (2, 3), (4, 5), (6, 7)
    values = {under: near(under, 1, -1), over: near(over, 1, +1), between: near(between, 1 + rtol / 2, +1)}

    def isclose(x, y) -> bool:
        return bool(torch.isclose(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                  rtol=rtol, atol=0))

    assert all(a[index].item() != 0 for index in values)
    assert isclose(values[under], a[under].item()) and not isclose(values[over], a[over].item())
    # within rtol of |b| (the swapped order), not of |a|
    assert not isclose(values[between], a[between].item()) and isclose(a[between].item(), values[between])

    def saved(name, *indexes):
        changed = dict(full)
        changed[key] = full[key].clone()
        for index in indexes:
            changed[key][index] = values[index]
        torch.save(changed, tmp_path / name)
        return tmp_path / name

    code, report, stderr = run_verify(exports["dcp"], saved("under.pt", under), *options)
    assert code == 0 and report["equal"], (stderr, report)
    code, report, stderr = run_verify(exports["dcp"], saved("over.pt", under, over), *options)
    assert code == 1, stderr
    assert [(d["key"], d["first_index"], d["count"]) for d in report["differences"]] == [(key, list(over), 1)]
    between_file = saved("between.pt", between)
    code, report, _ = run_verify(exports["dcp"], between_file, *options)
    assert code == 1 and [d["first_index"] for d in report["differences"]] == [list(between)]
    code, report, stderr = run_verify(between_file, exports["dcp"], *options)
    assert code == 0 and report["equal"], (stderr, report)


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
    # fsdp1 carries what verl's files have no place for (train_state) in its extra-state files
    holds_everything = via in ("torch", "dcp", "fsdp1") or source == "hf"
    assert bool(report["left_out"]) != holds_everything
    if via == "hf" and source != "hf":
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


# A training state against its own export, dtypes, long lists, layouts and the fsdp1 round trip.


@pytest.fixture(scope="module")
def titan(checkpoints, tmp_path_factory):
    """The torchtitan-layout (dp=2) DCP checkpoint (model at the top level, optimizer.*, lr_scheduler.*) and its HF export."""
    path, reference = checkpoints("fsdp2_dp2")
    out = tmp_path_factory.mktemp("titan")
    dcptool("export-hf", path, out / "hf")
    return {"dcp": path, "hf": out / "hf", "reference": reference}


def nested_state(path: Path, scratch: Path) -> dict:
    """A DCP checkpoint as torch itself reads it, nested as it was saved (``dcp_to_torch_save``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, scratch / "nested.pt")
    return torch.load(scratch / "nested.pt", weights_only=True)


@pytest.mark.parametrize("layout", ["titan", "areal"])
def test_a_training_state_against_its_hf_export_needs_no_flags(titan, exports, layout, tmp_path):
    setup = titan if layout == "titan" else exports
    from safetensors.torch import load_file

    exported = load_file(setup["hf"] / "model.safetensors")
    model_prefix = "" if layout == "titan" else "dcp.model."  # where torch's own reading puts the model
    every_tensor = {k for k, v in read_dcp(setup["dcp"], tmp_path).items() if isinstance(v, torch.Tensor)}
    assert {model_prefix + k for k in exported} <= every_tensor
    outside = (every_tensor - {model_prefix + k for k in exported}) | set(open_checkpoint(setup["dcp"]).objects)
    for a, b, holder in ((setup["dcp"], setup["hf"], "B"), (setup["hf"], setup["dcp"], "A")):
        code, report, stderr = run_verify(a, b)
        assert code == 0, (stderr, report["differences"][:5])
        assert report["differences"] == [] and report["layout"] is None
        assert report["tensors_compared"] == len(exported)
        assert report["bytes_compared"] == sum(t.numel() * t.element_size() for t in exported.values())
        assert set(report["left_out"]) == outside and report["left_out_why"] == f"{holder} holds a model only"
    text = dcptool("verify", setup["dcp"], setup["hf"]).stdout
    assert "missing" not in text and len(text.splitlines()) == 4  # A, B, one grouped left-out line, the summary
    assert text.splitlines()[2].startswith(f"left out (B holds a model only): {len(outside)} entries: ")

    # The model part is compared, not skipped: one changed element of the export is found.
    changed = tmp_path / "changed"
    shutil.copytree(setup["hf"], changed)
    key = next(k for k in exported if k.endswith(UP))
    exported[key][4, 2] += 1.0
    save_torch_file(exported, changed / "model.safetensors")
    code, report, _ = run_verify(setup["dcp"], changed)
    assert code == 1 and [(d["key"], d["kind"], d["first_index"]) for d in report["differences"]] == [(key, "value", [4, 2])]


def test_float32_against_bfloat16_with_dtype_as_b(exports, tmp_path):
    from safetensors.torch import load_file

    dcptool("export-hf", exports["dcp"], tmp_path / "bf16", "--dtype", "bfloat16")
    full = load_reference(exports["reference"])
    exported = load_file(tmp_path / "bf16" / "model.safetensors")
    for key, value in exported.items():  # the export is torch's own cast of the saved values
        assert torch.equal(value, full["dcp.model." + key].to(torch.bfloat16)), key

    result = dcptool("verify", exports["dcp"], tmp_path / "bf16", check=False)
    assert result.returncode == 1
    hint = [line for line in result.stdout.splitlines() if "--dtype-as B" in line and line.startswith("every difference")]
    assert len(hint) == 1
    code, report, _ = run_verify(exports["dcp"], tmp_path / "bf16")
    assert code == 1 and len(report["differences"]) == len(exported)
    assert {(d["kind"], d["cast_to"]) for d in report["differences"]} == {("dtype", "b")}

    code, report, stderr = run_verify(exports["dcp"], tmp_path / "bf16", "--dtype-as", "B")
    assert code == 0, (stderr, report["differences"][:3])
    assert report["dtype_as"] == "b" and report["tensors_compared"] == len(exported)
    assert "after casting A to B's dtypes" in dcptool("verify", exports["dcp"], tmp_path / "bf16", "--dtype-as", "B").stdout
    assert dcptool_api().verify(exports["dcp"], tmp_path / "bf16", tolerance=dcptool_api().Tolerance(dtype_as="b")).equal
    # The other way round the hint names A: the narrower side is the one to cast to.
    result = dcptool("verify", tmp_path / "bf16", exports["dcp"], check=False)
    assert result.returncode == 1 and "every difference is a dtype difference: --dtype-as A" in result.stdout
    assert run_verify(tmp_path / "bf16", exports["dcp"], "--dtype-as", "A")[0] == 0

    # One bfloat16 element one step off is a difference after the cast, at its index.
    key = next(k for k in exported if k.endswith(UP))
    exported[key].view(torch.int16)[1, 3] += 1
    (tmp_path / "off").mkdir()
    save_torch_file(exported, tmp_path / "off" / "model.safetensors")
    code, report, _ = run_verify(exports["dcp"], tmp_path / "off", "--dtype-as", "B")
    assert code == 1 and [(d["key"], d["kind"], d["first_index"], d["count"]) for d in report["differences"]] == [
        (key, "value", [1, 3], 1)]

    result = dcptool("verify", exports["dcp"], tmp_path / "bf16", "--dtype-as", "C", check=False)
    assert result.returncode == 2 and "--dtype-as" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_dtype_as_rounds_as_torch_does(tmp_path):
    """Ties to even, NaN, infinities, subnormals and overflow: A's values cast as torch's .to(bfloat16) casts them."""
    one = 1.0
    values = torch.tensor([one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), 2.5, float("nan"), float("inf"), -float("inf"),
                           -0.0, 1e-40, -3e-39, 3.4028235e38, 65504.0, 1e-3, 3.3e38], dtype=torch.float32)
    source = {"w": values.reshape(2, 7).contiguous()}
    cast = {"w": source["w"].to(torch.bfloat16)}
    # Truncation keeps the top 16 bits: what a cast that ignores rounding would give.
    truncated = {"w": (source["w"].view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)}
    for name, tensors in (("a", source), ("cast", cast), ("truncated", truncated)):
        (tmp_path / name).mkdir()
        save_torch_file(tensors, tmp_path / name / "model.safetensors")
    code, report, stderr = run_verify(tmp_path / "a", tmp_path / "cast", "--dtype-as", "B")
    assert code == 0, (stderr, report)
    differing = int((truncated["w"].view(torch.int16) != cast["w"].view(torch.int16)).sum())
    assert differing >= 3  # the rounding cases above
    code, report, _ = run_verify(tmp_path / "a", tmp_path / "truncated", "--dtype-as", "B")
    assert code == 1 and report["differences"][0]["count"] == differing
    # --dtype-as A casts B to A's dtypes: float32 B rounded to A's bfloat16 passes; bfloat16 B widened exactly
    # to A's float32 differs wherever the cast rounded (NaN compares by its bits: torch keeps a quiet NaN's top bits).
    assert run_verify(tmp_path / "cast", tmp_path / "a", "--dtype-as", "A")[0] == 0
    code, report, _ = run_verify(tmp_path / "a", tmp_path / "cast", "--dtype-as", "A")
    expected = int((cast["w"].float().view(torch.int32) != source["w"].view(torch.int32)).sum())
    assert code == 1 and report["differences"][0]["count"] == expected > 0


def test_long_difference_lists_are_grouped(exports, tmp_path):
    nested = nested_state(exports["dcp"], tmp_path)
    removed = []

    def without_optimizer_moments(tree, prefix):
        kept = {}
        for key, value in tree.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                inside = without_optimizer_moments(value, f"{name}.")
                if inside or not value:  # a parameter's state with its moments gone goes too
                    kept[key] = inside
            elif isinstance(value, torch.Tensor) and name.startswith("dcp.optim.state."):
                removed.append(name)
            else:
                kept[key] = value
        return kept

    torch.save(without_optimizer_moments(nested, ""), tmp_path / "no-moments.pt")
    assert len(removed) > 20
    result = dcptool("verify", exports["dcp"], tmp_path / "no-moments.pt", check=False)
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert f"missing  dcp.optim.state.* ({len(removed)} missing): tensor only in A" in lines
    assert len(lines) < 8 and "--all" in result.stdout

    listed = dcptool("verify", exports["dcp"], tmp_path / "no-moments.pt", "--all", check=False).stdout.splitlines()
    assert sorted(line.split()[1].rstrip(":") for line in listed if line.startswith("missing ")) == sorted(removed)
    code, report, _ = run_verify(exports["dcp"], tmp_path / "no-moments.pt")
    assert code == 1 and sorted(d["key"] for d in report["differences"]) == sorted(removed)


def test_layouts_that_differ_are_reported_even_with_equal_values(titan, tmp_path):
    """torchtitan keeps the model at the top level; a training state with the same values under `model.`
    (Archon's nesting) is another layout: exit 1 unless --values-only."""
    nested = nested_state(titan["dcp"], tmp_path)
    model = {k: v for k, v in nested.items() if isinstance(v, torch.Tensor)}
    archon_like = {"model": model, **{k: v for k, v in nested.items() if k not in model}}
    torch.save(archon_like, tmp_path / "nested.pt")

    code, report, stderr = run_verify(titan["dcp"], tmp_path / "nested.pt")
    assert code == 1 and report["differences"] == [] and not report["equal"]
    assert report["layout"] == "A has model at top level, B at `model.`"
    assert "values equal; layout differs: A has model at top level, B at `model.`" in stderr
    every = open_checkpoint(titan["dcp"])
    assert report["tensors_compared"] == len(every.tensors)  # the optimizer state too, entry for entry
    assert report["objects_compared"] > 0 and report["left_out"] == []
    code, report, _ = run_verify(titan["dcp"], tmp_path / "nested.pt", "--values-only")
    assert code == 0 and report["equal"] and report["layout"]
    # Prefixes given by hand compare what they select, as before.
    code, report, _ = run_verify(titan["dcp"], tmp_path / "nested.pt", "--prefix-a", "auto", "--prefix-b", "model")
    assert code == 0 and report["layout"] is None and report["tensors_compared"] == len(model)

    # A value that differs is named under the names both layouts share, beside the layout line.
    moment = next(k for k in nested["optimizer"] if k.endswith("exp_avg"))
    nested["optimizer"][moment] = nested["optimizer"][moment].clone()
    nested["optimizer"][moment].view(-1)[0] += 1.0
    torch.save({"model": model, **{k: v for k, v in nested.items() if k not in model}}, tmp_path / "changed.pt")
    code, report, stderr = run_verify(titan["dcp"], tmp_path / "changed.pt")
    assert code == 1 and [(d["key"], d["kind"]) for d in report["differences"]] == [(f"optimizer.{moment}", "value")]
    assert "layout differs" in stderr


def test_a_model_only_dcp_with_the_model_elsewhere_is_another_layout(exports, titan, tmp_path):
    """Two DCP checkpoints a job loads: AReaL's training state keeps the model under `dcp.model.`, import-hf's
    model-only checkpoint at the top level. An export (another format) is no layout difference."""
    dcptool("import-hf", exports["hf"], tmp_path / "imported")
    code, report, stderr = run_verify(exports["dcp"], tmp_path / "imported")
    assert code == 1 and report["differences"] == [] and report["layout"] == "A has model at `dcp.model.`, B at top level"
    assert report["left_out_why"] == "B holds a model only"
    model_tensors = len(open_checkpoint(tmp_path / "imported").tensors)
    assert report["tensors_compared"] == model_tensors
    assert run_verify(exports["dcp"], tmp_path / "imported", "--values-only")[0] == 0
    # A model saved nested ({"model": state_dict}) against the HF export: another format, an export, no layout.
    from safetensors.torch import load_file

    torch.save({"model": load_file(exports["hf"] / "model.safetensors")}, tmp_path / "model.pt")
    code, report, stderr = run_verify(tmp_path / "model.pt", exports["hf"])
    assert code == 0 and report["layout"] is None and report["tensors_compared"] == model_tensors, stderr
    # torchtitan keeps its model at the top level too: the same layout.
    dcptool("import-hf", titan["hf"], tmp_path / "titan-imported")
    code, report, stderr = run_verify(titan["dcp"], tmp_path / "titan-imported")
    assert code == 0 and report["layout"] is None, stderr


def test_dcp_to_fsdp1_and_back_restores_the_non_tensor_entries(titan, tmp_path):
    """torchtitan's param_groups (flattened per parameter), lr_scheduler, train_state and per-rank dataloader
    state come back as they were, read by torch."""
    dcptool("convert", titan["dcp"], tmp_path / "f1", "--to", "fsdp1", "--world-size", "2")
    dcptool("convert", tmp_path / "f1", tmp_path / "back", "--to", "dcp")
    # verl's files are as before (tests/test_fsdp1.py loads them in FSDP); its config records what to give back.
    config = json.loads((tmp_path / "f1" / "fsdp_config.json").read_text())
    assert config == {"FSDP_version": 1, "world_size": 2, "dcptool_source_layout": {
        "state": "per_parameter", "param_groups": "per_parameter", "lr_scheduler": "lr_scheduler"}}
    # What verl has no place for rides in the extra-state files as plain data: each data-parallel rank's
    # dataloader state with its rank (the source saved 2, as many as the folder's ranks), the rest in rank 0's.
    nested_source = nested_state(titan["dcp"], tmp_path)
    extra = [torch.load(tmp_path / "f1" / f"extra_state_world_size_2_rank_{r}.pt", weights_only=True) for r in (0, 1)]
    assert extra[0]["dcptool_carried"] == {"train_state": nested_source["train_state"],
                                           "dataloader": {"dp_rank_0": nested_source["dataloader"]["dp_rank_0"]}}
    assert extra[1]["dcptool_carried"] == {"dataloader": {"dp_rank_1": nested_source["dataloader"]["dp_rank_1"]}}
    assert [e["lr_scheduler"] for e in extra] == [nested_source["lr_scheduler"]] * 2

    source, back = read_dcp(titan["dcp"], tmp_path), read_dcp(tmp_path / "back", tmp_path)
    assert any(k.startswith(("train_state.", "dataloader.dp_rank_1")) for k in source) and set(back) == set(source)
    assert any(k.startswith("optimizer.param_groups.") for k in back) and "lr_scheduler.last_epoch" in back
    for key, value in back.items():
        assert torch.equal(value, source[key]) if isinstance(value, torch.Tensor) else value == source[key], key
    # Nested as it was saved, too: torch unflattens both into the same state dict.
    nested_back = nested_state(tmp_path / "back", tmp_path)
    assert nested_back.keys() == nested_source.keys()
    assert nested_back["optimizer"].keys() == nested_source["optimizer"].keys()
    for root in ("lr_scheduler", "train_state", "dataloader"):
        assert nested_back[root] == nested_source[root], root

    code, report, stderr = run_verify(titan["dcp"], tmp_path / "back")
    assert code == 0, (stderr, report["differences"][:5])
    assert report["objects_compared"] == sum(not isinstance(v, torch.Tensor) for v in back.values())
    code, report, stderr = run_verify(titan["dcp"], "--roundtrip", "fsdp1")
    assert code == 0, (stderr, report["differences"][:5])
    assert report["left_out"] == []
    assert report["objects_compared"] == sum(not isinstance(v, torch.Tensor) for v in back.values())
    # On another number of ranks the data-parallel ranks' states go whole into rank 0's file, and come back.
    dcptool("convert", titan["dcp"], tmp_path / "f3", "--to", "fsdp1", "--world-size", "3")
    carried = torch.load(tmp_path / "f3" / "extra_state_world_size_3_rank_0.pt", weights_only=True)["dcptool_carried"]
    assert carried == {"train_state": nested_source["train_state"], "dataloader": nested_source["dataloader"]}
    assert all("dcptool_carried" not in torch.load(tmp_path / "f3" / f"extra_state_world_size_3_rank_{r}.pt",
                                                   weights_only=True) for r in (1, 2))
    dcptool("convert", tmp_path / "f3", tmp_path / "back3", "--to", "dcp")
    assert run_verify(titan["dcp"], tmp_path / "back3")[0] == 0
