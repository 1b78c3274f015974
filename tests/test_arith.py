"""average and diff against torch computing the same from the full state dicts that real gloo jobs gathered.

Sources: the session's FSDP2 dp=2 checkpoint (torchtitan layout, one step), and one job's two more saves of
the same model: after two steps on tp=2 (torchtitan layout), after three on dp=2 (AReaL layout, read as a
torch.save file here). So every average and diff crosses formats, layouts and meshes.
"""

import json
import math
import re

import numpy as np
import pytest
import safetensors.numpy
import torch
from conftest import dcptool as run_cli
from conftest import load_reference, read_dcp
from safetensors.torch import load_file

import dcptool
from dcptool import formats

U = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(scope="module")
def steps(checkpoints, tmp_path_factory):
    """{name: (path, full state dict under torchtitan names)} for step1 (DCP dp=2), step2 (DCP tp=2), step3.pt
    (torch.save of an AReaL-layout DCP of dp=2) and step3 (that DCP); deep1 and deep2: 3 layers, 1 and 2 steps.
    The session's checkpoints (conftest), saved by one job."""
    step1, reference1 = checkpoints("fsdp2_dp2")
    step2, step3, deep1, deep2 = (checkpoints(name)[0] for name in ("step2", "step3", "deep1", "deep2"))
    step3_pt = tmp_path_factory.mktemp("steps") / "step3.pt"
    run_cli("convert", step3, step3_pt, "--to", "torch")

    def titan(full: dict) -> dict:  # AReaL's dcp.model.X / dcp.optim.Y as torchtitan's X / optimizer.Y
        return {re.sub(r"^dcp\.optim\.", "optimizer.", re.sub(r"^dcp\.model\.", "", k)): v for k, v in full.items()}

    def reference(path):
        return load_reference(path.with_name(f"{path.name}.reference"))

    return {"step1": (step1, load_reference(reference1)),
            "step2": (step2, reference(step2)),
            "step3.pt": (step3_pt, titan(reference(step3))),
            "step3": (step3, titan(reference(step3))),
            "deep1": (deep1, reference(deep1)),
            "deep2": (deep2, reference(deep2))}


def model_keys(full: dict) -> list[str]:
    return [k for k in full if not k.startswith("optimizer.")]


def expected_mean(parts: list[torch.Tensor], weights: list[float], dtype: torch.dtype) -> torch.Tensor:
    """What average documents: w0*x0 + w1*x1 + ... in float32, in order, then cast to ``dtype``."""
    total = None
    for x, w in zip(parts, weights):
        term = torch.tensor(w, dtype=torch.float32) * x.float()
        total = term if total is None else total + term
    return total.to(dtype)


def check_float64(out: torch.Tensor, parts: list[torch.Tensor], weights: list[float], ulp: float) -> None:
    """``out`` within float32 summation error (and ``ulp``, the output dtype's rounding) of the float64 mean."""
    terms = [w * x.double() for x, w in zip(parts, weights)]
    reference = sum(terms)
    bound = 4 * U * sum(t.abs() for t in terms) + ulp * reference.abs()
    assert bool(((out.double() - reference).abs() <= bound).all())


def test_average_of_three_formats_and_meshes_is_torch_s(steps, tmp_path):
    (step1, full1), (step2, full2), (step3, full3) = steps["step1"], steps["step2"], steps["step3.pt"]
    out = tmp_path / "soup"
    result = run_cli("average", step1, step2, step3, out, "--weights", "5,3,2")
    optimizer_tensors = len(full1) - len(model_keys(full1))
    assert "with weights 0.5, 0.3, 0.2" in result.stderr and f"left out {optimizer_tensors} optimizer tensors" in result.stderr
    weights = [0.5, 0.3, 0.2]
    written = read_dcp(out, tmp_path)
    keys = model_keys(full1)
    assert sorted(k for k, v in written.items() if isinstance(v, torch.Tensor)) == sorted(keys)
    for key in keys:
        parts = [full1[key], full2[key], full3[key]]
        assert torch.equal(written[key], expected_mean(parts, weights, torch.float32)), key
        check_float64(written[key], parts, weights, 0.0)
    # laid out as the first: its chunks, in the files of the ranks that saved them
    source, average = formats.open_checkpoint(step1), formats.open_checkpoint(out)
    for key in keys:
        assert [(c.offsets, c.sizes, c.rank) for c in average.tensors[key].chunks] == \
            [(c.offsets, c.sizes, c.rank) for c in source.tensors[key].chunks]


def test_average_to_bfloat16_hf_and_to_another_mesh(steps, tmp_path):
    (step1, full1), (step2, full2) = steps["step1"], steps["step2"]
    bf16 = tmp_path / "step1-bf16"
    run_cli("export-hf", step1, bf16, "--dtype", "bfloat16")
    out = tmp_path / "soup-hf"
    run_cli("average", bf16, step2, out)  # the first's format and dtype: HF safetensors of bfloat16
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(model_keys(full1))
    for key, value in written.items():
        parts = [full1[key].to(torch.bfloat16), full2[key]]
        assert value.dtype == torch.bfloat16 and torch.equal(value, expected_mean(parts, [0.5, 0.5], torch.bfloat16)), key
        check_float64(value, parts, [0.5, 0.5], 2.0 ** -8)
    meshed = tmp_path / "soup-dp4"
    run_cli("average", step2, step1, meshed, "--dp", "4", "--weights", "0.25,0.75")
    assert dcptool.inspect(meshed).mesh.describe() == "4 ranks: dp=4"
    written = read_dcp(meshed, tmp_path)
    for key in model_keys(full2):
        assert torch.equal(written[key], expected_mean([full2[key], full1[key]], [0.25, 0.75], torch.float32)), key


def test_average_with_the_optimizer_across_layouts(steps, tmp_path):
    """AReaL's dcp.optim.* paired with torchtitan's optimizer.* as verify pairs them; written in the first's layout."""
    (step1, full1), (step3, full3) = steps["step1"], steps["step3"]
    out = tmp_path / "soup.pt"
    report = dcptool.average([step1, step3], out, to="torch", include_optimizer=True)
    assert report.tensors == len(full1)
    written = torch.load(out, weights_only=True)
    flat = {}

    def walk(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value
    walk(written)
    counters = [key for key in full1 if key.startswith("optimizer.") and key.endswith(".step")]
    assert counters and all(float(full1[key]) == 1 and float(full3[key]) == 3 for key in counters)
    for key, value in full1.items():
        if key in counters:  # counts, not means: the first's own, as README says of the other counters
            assert torch.equal(flat[key], value), key
        else:
            assert torch.equal(flat[key], expected_mean([value, full3[key]], [0.5, 0.5], value.dtype)), key
    assert f"took {len(counters)} optimizer step counters from {step1} as they are" in "\n".join(report.notes)


def test_refusals_exit_2_with_one_line_and_write_nothing(steps, tmp_path):
    step1, step2 = steps["step1"][0], steps["step2"][0]
    hf = tmp_path / "hf-no-norm"
    run_cli("export-hf", step2, hf, "--exclude", r"^model\.norm\.")
    ints_a, ints_b = tmp_path / "ints-a", tmp_path / "ints-b"
    for folder, position in ((ints_a, np.arange(4)), (ints_b, np.arange(4)[::-1].copy())):
        folder.mkdir()
        safetensors.numpy.save_file({"w": np.ones(4, np.float32), "position_ids": position}, f"{folder}/model.safetensors")
    out = tmp_path / "out"
    for args, said in [
            ((step1, step2, out, "--weights", "0.5,0.3,0.2"), "--weights 0.5,0.3,0.2: 3 weights for 2 checkpoints"),
            ((step1, step2, out, "--weights", "1,-1"), "not negative"),
            ((step1, out), "give at least two checkpoints"),
            ((step1, hf, out), f"{hf}: has no model weight model.norm.weight"),
            ((ints_a, ints_b, out), f"{ints_b}: position_ids (int64) differs"),
    ]:
        result = run_cli("average", *args, check=False)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and said in result.stderr and len(lines) == 1, result.stderr
        assert not out.exists()
    hf_full = tmp_path / "hf-full"
    run_cli("export-hf", step2, hf_full)
    result = run_cli("average", step1, hf_full, out, "--include-optimizer", check=False)
    assert result.returncode == 2 and "has no optimizer tensor" in result.stderr and "--include-optimizer" in result.stderr


def test_dry_run_and_json(steps, tmp_path):
    out = tmp_path / "out"
    result = run_cli("average", steps["step1"][0], steps["step2"][0], out, "--dry-run", "--json")
    report = json.loads(result.stdout)
    assert report["dry_run"] and report["planned_files"] and report["format"] == "dcp" and not out.exists()


def torch_changes(a: torch.Tensor, b: torch.Tensor) -> dict:
    """What diff reports of one tensor, computed by torch."""
    same_dtype = a.dtype == b.dtype
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
    identical = int((a.view(bits[a.dtype]) == b.view(bits[b.dtype])).sum()) if same_dtype else 0
    step = (b.double() - a.double())
    norm_a = float(a.double().norm())
    return {"elements": a.numel(), "changed": int((a.double() != b.double()).sum()), "bit_identical": identical,
            "max_abs_change": float(step.abs().max()) if a.numel() else 0.0,
            "relative_l2_change": float(step.norm()) / norm_a if float(step.norm()) else 0.0}


def test_diff_counts_are_torch_s_across_formats_and_layouts(steps, tmp_path):
    (step1, full1), (step3, full3) = steps["step1"], steps["step3.pt"]
    result = run_cli("diff", step1, step3, "--json", "--top", "3")
    report = json.loads(result.stdout)
    by_key = {t["key"]: t for t in report["tensors"]}
    assert sorted(by_key) == sorted(full1)  # optimizer state included: AReaL's dcp.optim.* paired with optimizer.*
    expected = {key: torch_changes(full1[key], full3[key]) for key in full1}
    for key, want in expected.items():
        got = by_key[key]
        assert (got["elements"], got["changed"], got["bit_identical"]) == \
            (want["elements"], want["changed"], want["bit_identical"]), key
        assert math.isclose(got["max_abs_change"], want["max_abs_change"], rel_tol=0, abs_tol=0), key
        assert math.isclose(got["relative_l2_change"], want["relative_l2_change"], rel_tol=1e-9), key
    partly = [k for k, w in expected.items() if 0 < w["bit_identical"] < w["elements"]]
    assert partly  # rows of the embedding no batch touched keep their optimizer moments bit for bit
    numel = sum(w["elements"] for w in expected.values())
    identical = sum(w["bit_identical"] for w in expected.values())
    changed = sum(1 for w in expected.values() if w["changed"])
    assert report["summary"].startswith(f"{100 * identical / numel:.1f}% of {numel:.2g}".replace("e+0", "e")
                                        + f" parameters bit-identical; {changed} of {len(expected)} tensors changed")
    ranked = sorted((k for k in expected if expected[k]["changed"]), key=lambda k: -expected[k]["relative_l2_change"])
    assert report["top"] == ranked[:3]
    text = run_cli("diff", step1, step3, "--top", "3").stdout.splitlines()
    assert text[0] == report["summary"] and any(line.startswith(ranked[0]) for line in text)


def test_diff_of_a_bfloat16_export_counts_values_not_bits(steps, tmp_path):
    (step1, full1), (step2, full2) = steps["step1"], steps["step2"]
    bf16 = tmp_path / "bf16"
    run_cli("export-hf", step2, bf16, "--dtype", "bfloat16")
    report = dcptool.diff(step1, bf16)
    got = {c.key: c for c in report.changes}
    assert sorted(got) == sorted(model_keys(full1))  # the model part: B holds a model only
    assert {k for k in full1 if k.startswith("optimizer.")} <= set(report.left_out)
    assert report.left_out_why == "B holds a model only"
    for key, change in got.items():
        want = torch_changes(full1[key], full2[key].to(torch.bfloat16))
        assert change.dtype == "float32 -> bfloat16" and change.identical == 0
        assert (change.numel, change.changed) == (want["elements"], want["changed"]), key
    same = dcptool.diff(step1, step1)
    assert same.summary() == f"100.0% of {sum(full1[k].numel() for k in full1):.2g} parameters bit-identical; " \
                             f"0 of {len(full1)} tensors changed".replace("e+0", "e")


def strict_json(text: str):
    """``text`` parsed as JSON proper: NaN, Infinity and -Infinity, which python's json accepts, refused."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_diff_json_is_strict_json_and_names_changes_that_are_no_number(steps, tmp_path):
    """A NaN in B makes that tensor's changes inf: null in --json, named in non_finite. 0.0 against -0.0 is
    equal in value, not in bits: counted as elements in the summary, the tensor not changed."""
    step1 = steps["step1"][0]
    a, b = tmp_path / "a", tmp_path / "b"
    run_cli("export-hf", step1, a)
    values = safetensors.numpy.load_file(a / "model.safetensors")
    nan_key, zero_key = sorted(values)[:2]
    values[zero_key].reshape(-1)[0] = 0.0
    safetensors.numpy.save_file(values, a / "model.safetensors", metadata={"format": "pt"})
    values[zero_key].reshape(-1)[0] = -0.0
    values[nan_key].reshape(-1)[0] = np.nan
    b.mkdir()
    safetensors.numpy.save_file(values, b / "model.safetensors", metadata={"format": "pt"})
    report = strict_json(run_cli("diff", a, b, "--json").stdout)
    by_key = {t["key"]: t for t in report["tensors"]}
    nan_change = by_key[nan_key]
    assert nan_change["changed"] == 1 and nan_change["max_abs_change"] is None and nan_change["relative_l2_change"] is None
    assert nan_change["non_finite"] == {"max_abs_change": "inf", "relative_l2_change": "inf"}
    assert report["total"]["max_abs_change"] is None and report["total"]["non_finite"]["max_abs_change"] == "inf"
    assert all(t["non_finite"] == {} and isinstance(t["max_abs_change"], float) for k, t in by_key.items() if k != nan_key)
    assert by_key[zero_key]["changed"] == 0 and by_key[zero_key]["bit_identical"] == by_key[zero_key]["elements"] - 1
    numel = sum(v.size for v in values.values())
    assert report["summary"] == (f"{100 * (numel - 2) / numel:.1f}% of {numel:.2g} parameters bit-identical, ".replace("e+0", "e")
                                 + f"1 more equal in value, not in bits; 1 of {len(values)} tensors changed")
    text = run_cli("diff", a, b).stdout.splitlines()
    assert text[0] == report["summary"] and any(line.startswith(nan_key) and " inf " in line for line in text)


def test_computed_tensors_renamed_and_permuted_by_an_adapter_keep_their_values(steps, checkpoints, tmp_path):
    """An adapter's views (renamed, rows permuted for torchtitan's RoPE layout) of averaged tensors read the
    averages, as the same adapter reads them from the average written out."""
    from conftest import read_tensor

    from dcptool.arithmetic import averaging
    from dcptool.planning import conversion

    (step1, _), (step2, _) = steps["step1"], steps["step2"]
    config = checkpoints("fsdp2_dp2")[1]
    soup, renamed = tmp_path / "soup", tmp_path / "soup-archon"
    run_cli("average", step1, step2, soup)
    run_cli("convert", soup, renamed, "--to", "dcp", "--adapter", "archon", "--config-dir", config)
    stored = formats.open_checkpoint(renamed)
    planned = averaging.plan_average([formats.open_checkpoint(step1), formats.open_checkpoint(step2)], None)
    computed, _, _ = conversion.adapted(planned.conversion.checkpoint, "archon", config_dir=config)
    weights = [k for k, t in computed.tensors.items() if t.transform is not None]
    assert any("wq" in k for k in weights) and len(weights) == planned.averaged
    for key in weights:
        assert torch.equal(read_tensor(computed, key), read_tensor(stored, key)), key


def test_average_across_naming_families(steps, checkpoints, tmp_path):
    """Archon names (grouped attention names, wq/wk with RoPE rows permuted) paired with HF names as verify
    pairs them; the output keeps the first's names. The pairing needs the head counts: from --config-dir, or
    from the config.json the convert to Archon names kept."""
    (step1, full1), (step2, full2) = steps["step1"], steps["step2"]
    archon = tmp_path / "step2-archon"
    run_cli("convert", step2, archon, "--to", "dcp", "--adapter", "archon", "--config-dir", checkpoints("fsdp2_dp2")[1])
    kept = (archon / "config.json").read_bytes()
    (archon / "config.json").unlink()
    out = tmp_path / "soup.pt"
    refused = run_cli("average", step1, archon, out, "--to", "torch", check=False)
    assert refused.returncode == 2 and "--config-dir" in refused.stderr and not out.exists()
    result = run_cli("average", step1, archon, out, "--to", "torch", "--config-dir", checkpoints("fsdp2_dp2")[1])
    assert "across families" in result.stderr
    written = torch.load(out, weights_only=True)
    for key in model_keys(full1):
        assert torch.equal(written[key], expected_mean([full1[key], full2[key]], [0.5, 0.5], torch.float32)), key
    (archon / "config.json").write_bytes(kept)
    run_cli("average", step1, archon, tmp_path / "again.pt", "--to", "torch")
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert all(torch.equal(again[key], written[key]) for key in model_keys(full1))


def test_diff_folds_layers_as_inspect_does_and_all_expands_them(steps):
    (deep1, full1), (deep2, full2) = steps["deep1"], steps["deep2"]
    folded = run_cli("diff", deep1, deep2, "--include", "q_proj").stdout.splitlines()
    keys = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(3)]
    row = next(line for line in folded if line.startswith("model.layers.{0..2}.self_attn.q_proj.weight "))
    changes = [torch_changes(full1[k], full2[k]) for k in keys]
    elements, changed = sum(c["elements"] for c in changes), sum(c["changed"] for c in changes)
    assert f"{elements:,}" in row.split() and f"{changed:,}" in row.split(), row
    everything = run_cli("diff", deep1, deep2, "--include", "q_proj", "--all").stdout.splitlines()
    assert [line.split()[0] for line in everything[2:5]] == keys
    assert not any(line.startswith(keys[0]) for line in folded)


@pytest.mark.parametrize("mesh", [[], ["--dp", "1", "--tp", "2"]], ids=["first-layout", "tp2"])
def test_a_damaged_record_of_another_source_is_refused(steps, checkpoints, tmp_path, mesh):
    """The second source's records are checked as the computation reads them (whole, or in the column blocks
    a tp=2 output cuts: the rest read when the copy finishes), as the first's are."""
    from test_records import copy_with_damaged_data

    step1, step3 = steps["step1"][0], steps["step3"][0]
    damaged = tmp_path / "damaged"
    name = copy_with_damaged_data(step3, damaged, "dcp.model.model.layers.0.self_attn.o_proj.weight")
    out = tmp_path / "out"
    config = ["--config-dir", checkpoints("fsdp2_dp2")[1]] if mesh else []
    result = run_cli("average", step1, damaged, out, *mesh, *config, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "CRC-32" in lines[-1] and name in lines[-1], result.stderr
    assert not out.exists()
