"""Completeness: export-hf, import-hf and convert --adapter hf refuse an output that lacks parts of the model its
config.json describes, or holds tensors that model has no place for (dcptool.planning.completeness).

Checkpoints are real: tiny random transformers models written by save_pretrained (harness.family_models), and a
Qwen2.5-VL trained one AdamW step by a real FSDP2 job on gloo and saved with dcp.save (harness.vl_jobs), under the
names transformers v5 gives the model (``model.visual.*``) rather than its files (``visual.*``). The oracle of what
an output lacks is transformers' own loading: ``from_pretrained(..., output_loading_info=True)``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import dcptool, oracle
from harness.family_models import load_hf_state, read_config, save_hf, save_vl, write_hf
from harness.megatron_deepseek import save_hf_with_mtp
from jobs import run_job

import dcptool as api
from dcptool.errors import IncompleteModelError

VL_JOBS = "harness.vl_jobs"


def one_line(result) -> str:
    """The one error line of a refused command."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def tensors_in(line: str, part: str) -> int:
    """The count a refusal or note gives of the tensors of ``part`` (``the vision tower (30 tensors, e.g. ...)``)."""
    match = re.search(rf"the {re.escape(part)} \((\d+) tensors?", line)
    assert match, line
    return int(match.group(1))


def loading_info(folder: Path) -> dict[str, set]:
    """transformers' own account of loading ``folder`` (missing, unexpected, mismatched keys)."""
    transformers = oracle("transformers")
    config = read_config(folder)
    auto = (transformers.AutoModelForImageTextToText if "vision_config" in config
            else transformers.AutoModelForCausalLM)
    _, info = auto.from_pretrained(folder, output_loading_info=True)
    return {kind: set(info[kind]) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """A tiny Qwen2.5-VL: its save_pretrained folder (``hf``), an FSDP2 job's dcp.save of it after one AdamW
    step (``dcp``, with the gathered state in ``dcp.reference/full.pt``), and that DCP without its vision tower,
    left out by a first convert (``partial``)."""
    root = tmp_path_factory.mktemp("vl")
    hf = save_vl("qwen2_5_vl", root / "hf", seed=3)
    run_job(2, "save-vl", root / "dcp", "--hf", hf, module=VL_JOBS)
    dcptool("convert", root / "dcp", root / "partial", "--to", "dcp", "--exclude", r"\.visual\.")
    return {"hf": hf, "dcp": root / "dcp", "partial": root / "partial", "root": root}


def test_a_complete_vl_export_loads_with_no_missing_key(vl):
    out = vl["root"] / "complete"
    result = dcptool("export-hf", vl["dcp"], out, "--config-dir", vl["hf"])
    assert "completeness" not in result.stderr and "allow" not in result.stderr
    assert loading_info(out) == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set()}
    transformers = oracle("transformers")
    model = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    trained = torch.load(Path(f"{vl['dcp']}.reference") / "full.pt", weights_only=True)
    assert model.state_dict().keys() == trained.keys()
    assert all(torch.equal(value, trained[key]) for key, value in model.state_dict().items())
    assert dcptool("check", out).returncode == 0  # its own config.json, inside it


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_a_vl_folder_exports_whole_under_either_names(kind, tmp_path):
    """save_pretrained's names (``visual.*`` for Qwen2.5-VL) are as complete as the model's own."""
    hf = save_vl(kind, tmp_path / "hf")
    dcptool("export-hf", hf, tmp_path / "out", "--config-dir", hf)
    assert loading_info(tmp_path / "out") == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set()}


def test_a_vl_export_without_its_vision_tower_is_refused(vl):
    out = vl["root"] / "no-vision"
    for dry_run in ([], ["--dry-run"]):
        result = dcptool("export-hf", vl["partial"], out, "--config-dir", vl["hf"], *dry_run, check=False)
        assert result.returncode == 2, result.stderr
        line = one_line(result)
        assert line.startswith(f"dcptool: error: {vl['partial']}: the output lacks the vision tower ("), line
        assert f"of the model {vl['hf'] / 'config.json'} describes (transformers " in line
        assert "Qwen2_5_VLForConditionalGeneration" in line and "from_pretrained would fill it with random weights" in line
        assert line.endswith("accept it with --allow-missing vision"), line
        assert not out.exists()

    accepted = dcptool("export-hf", vl["partial"], out, "--config-dir", vl["hf"], "--allow-missing", "vision")
    note = next(line for line in accepted.stderr.splitlines() if line.startswith("--allow-missing vision"))
    assert "left out the vision tower (" in note and note.endswith("from_pretrained fills it with random weights")
    info = loading_info(out)
    assert info["missing_keys"] and all(key.startswith("model.visual.") for key in info["missing_keys"]), info
    assert tensors_in(line, "vision tower") == tensors_in(note, "vision tower") == len(info["missing_keys"])
    assert not info["unexpected_keys"] and not info["mismatched_keys"]


def test_check_reports_the_missing_vision_tower(vl):
    out = vl["root"] / "no-vision-checked"
    dcptool("export-hf", vl["partial"], out, "--config-dir", vl["hf"], "--allow-missing", "vision")
    (out / "config.json").unlink()  # the config given apart, as --config-dir
    result = dcptool("check", out, "--config-dir", vl["hf"], check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("missing ")]
    assert "the weights lack the vision tower (" in line and "Qwen2_5_VLForConditionalGeneration" in line, line
    report = json.loads(dcptool("check", out, "--config-dir", vl["hf"], "--json", check=False).stdout)
    assert report["counts"] == {"missing": 1} and report["completeness"].startswith("checked against transformers")
    assert dcptool("check", out).returncode == 0  # no config: nothing to hold the weights against


def test_import_hf_and_convert_refuse_the_vision_tower_missing(vl):
    folder = vl["root"] / "import-source"
    dcptool("export-hf", vl["partial"], folder, "--config-dir", vl["hf"], "--allow-missing", "vision")
    for dry_run in ([], ["--dry-run"]):
        refused = dcptool("import-hf", folder, vl["root"] / "imported", *dry_run, check=False)
        assert refused.returncode == 2, refused.stderr
        assert one_line(refused).endswith("accept it with --allow-missing vision"), refused.stderr
        assert "--exclude" not in refused.stderr  # import-hf takes no --exclude
    dcptool("import-hf", folder, vl["root"] / "imported", "--allow-missing", "vision")

    refused = dcptool("convert", vl["partial"], vl["root"] / "renamed", "--to", "dcp", "--adapter", "hf",
                      "--config-dir", vl["hf"], check=False)
    assert refused.returncode == 2 and "the output lacks the vision tower (" in one_line(refused), refused.stderr
    dcptool("convert", vl["dcp"], vl["root"] / "renamed", "--to", "dcp", "--adapter", "hf", "--config-dir", vl["hf"])


def test_deepseek_without_its_prediction_layers_is_refused(tmp_path):
    without = save_hf("deepseek_v3", tmp_path / "without", seed=4, num_nextn_predict_layers=1)
    line = one_line(dcptool("export-hf", without, tmp_path / "out", "--config-dir", without, check=False))
    assert "the output lacks the MTP layers (" in line and "(dcptool's deepseek_v3 table)" in line, line
    assert line.endswith("accept it with --allow-missing mtp"), line
    dcptool("export-hf", without, tmp_path / "out", "--config-dir", without, "--allow-missing", "mtp")

    whole = save_hf_with_mtp(tmp_path / "with", seed=4, num_nextn_predict_layers=1)
    prediction = {name for name in load_hf_state(whole) if name.startswith("model.layers.2.")}  # after 2 main layers
    copies = {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}  # of the main ones
    assert copies < prediction and tensors_in(line, "MTP layers") == len(prediction - copies)
    dcptool("export-hf", whole, tmp_path / "whole", "--config-dir", whole)
    assert prediction <= set(load_hf_state(tmp_path / "whole"))
    # torchtitan's and Megatron-Core's prediction layers share the main embedding and head: an export may leave
    # the copies out
    dcptool("export-hf", whole, tmp_path / "shared", "--exclude", r"layers\.2\.(embed_tokens|shared_head\.head)")
    one_layer = dcptool("export-hf", whole, tmp_path / "never", "--exclude", r"layers\.2\.enorm", check=False)
    assert one_line(one_layer).startswith(f"dcptool: error: {whole}: the output lacks the MTP layers (1 tensor: "
                                          "model.layers.2.enorm.weight)"), one_layer.stderr


def test_an_untied_model_without_its_lm_head_is_refused(tmp_path):
    untied = save_hf("qwen3", tmp_path / "untied")
    line = one_line(dcptool("export-hf", untied, tmp_path / "out", "--exclude", "lm_head", check=False))
    assert "the output lacks the lm_head (1 tensor: lm_head.weight)" in line, line
    assert line.endswith("accept it with --allow-missing lm_head"), line
    tied = save_hf("qwen3_tied", tmp_path / "tied")  # the head is the embedding: nothing lacks
    dcptool("export-hf", tied, tmp_path / "tied-out")
    assert loading_info(tmp_path / "tied-out")["missing_keys"] == set()


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path):
    hf = save_hf("llama", tmp_path / "hf")
    stray = "model.layers.0.mlp.extra_proj.weight"
    source = write_hf({**load_hf_state(hf), stray: torch.ones(4, 64)}, tmp_path / "source", hf)
    line = one_line(dcptool("export-hf", source, tmp_path / "out", check=False))
    assert f"{stray} has no place in the model {source / 'config.json'} describes" in line, line
    assert line.endswith("from_pretrained would drop it; leave it out with --exclude or keep it with "
                         "--allow-unexpected"), line
    kept = dcptool("export-hf", source, tmp_path / "out", "--allow-unexpected")
    assert f"--allow-unexpected: kept {stray}, which the model has no place for (from_pretrained drops it)" in kept.stderr
    assert loading_info(tmp_path / "out")["unexpected_keys"] == {stray}


def test_parts_are_a_list_and_named_choices(vl, tmp_path):
    hf = save_hf("qwen3", tmp_path / "hf")
    for given in (["--allow-missing", "lm_head,norms"], ["--allow-missing", "lm_head", "--allow-missing", "norms"]):
        out = tmp_path / f"out{len(given)}"
        dcptool("export-hf", hf, out, "--exclude", r"lm_head|^model\.norm", *given)
        assert not loading_info(out)["missing_keys"] - {"lm_head.weight", "model.norm.weight"}
    line = one_line(dcptool("export-hf", hf, tmp_path / "never", "--allow-missing", "visoin", check=False))
    assert line.startswith("dcptool: error: --allow-missing visoin: no such part; choose from vision, "), line


def test_a_model_nothing_knows_is_exported_with_a_note(tmp_path):
    hf = save_hf("llama", tmp_path / "hf")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({**read_config(hf), "model_type": "no_such_model"}))
    result = dcptool("export-hf", hf, tmp_path / "out", "--config-dir", unknown)
    transformers = oracle("transformers")
    assert ("completeness not checked: dcptool has no table of model_type 'no_such_model', and transformers "
            f"{transformers.__version__} has no model of model_type 'no_such_model'") in result.stderr


def test_the_api_takes_completeness_as_an_object(vl):
    with pytest.raises(IncompleteModelError) as refused:
        api.export_hf(vl["partial"], vl["root"] / "api", config_dir=vl["hf"])
    assert set(refused.value.missing) == {"vision"} and not refused.value.unexpected
    assert str(refused.value).endswith("accept it with completeness.allow_missing='vision'")
    report = api.export_hf(vl["partial"], vl["root"] / "api", config_dir=vl["hf"],
                           completeness=api.Completeness(allow_missing=["vision"]))
    assert any(note.startswith("completeness.allow_missing='vision': left out the vision tower") for note in report.notes)
