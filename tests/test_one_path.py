"""One path per command: the command line only parses and calls the API, so for every option both write
the same bytes; and --dry-run writes nothing, for every writing command and every writable format."""

import dataclasses
import json
from pathlib import Path

import pytest

import dcptool
from conftest import dcptool as run_cli
from dcptool import (Completeness, Lora, MeshOptions, Quantize, Reading, Selection, Side, Writing, format_options,
                     formats)

CONFIG = "<the source's config folder>"  # replaced by the reference folder of the saving job

# (command, its command-line options, the API's arguments for the same: the option objects the command line
# builds): each option of the writing commands appears in at least one case.
CASES = [
    ("convert", ["--to", "torch"], {"to": "torch"}),
    ("convert", ["--to", "dcp", "--dtype", "bfloat16", "--exclude", r"^optimizer\."],
     {"to": "dcp", "dtype": "bfloat16", "selection": Selection(exclude=r"^optimizer\.")}),
    ("convert", ["--to", "dcp", "--compress", "zstd", "--include", "layers"],
     {"to": "dcp", "format_options": format_options("dcp", compress="zstd"), "selection": Selection(include="layers")}),
    ("convert", ["--to", "hf", "--max-shard-size", "20KB"], {"to": "hf", "format_options": format_options("hf", max_shard_size="20KB")}),
    ("convert", ["--to", "hf-dcp"], {"to": "hf-dcp"}),
    ("convert", ["--to", "dcp", "--adapter", "hf"], {"to": "dcp", "family": "hf"}),
    ("convert", ["--to", "fsdp1", "--world-size", "2", "--optim-form", "flat", "--model-values", "dtensor:cpu"],
     {"to": "fsdp1", "format_options": format_options("fsdp1", world_size=2, optim_form="flat", model_values="dtensor:cpu")}),
    ("convert", ["--to", "fsdp1", "--world-size", "3", "--keep-rank-state"],
     {"to": "fsdp1", "format_options": format_options("fsdp1", world_size=3, keep_rank_state=True)}),
    ("convert", ["--to", "torch", "--from", "dcp", "--max-memory", "1MiB", "--no-verify-records", "--no-fsync"],
     {"to": "torch", "reading": Reading(format="dcp", max_memory="1MiB", verify_records=False),
      "writing": Writing(fsync=False)}),
    ("export-hf", ["--dtype", "bfloat16", "--max-shard-size", "30KB"],
     {"dtype": "bfloat16", "format_options": format_options("hf", max_shard_size="30KB")}),
    ("export-hf", ["--include", "norm", "--hf-experts", "fused", "--adapter", "hf"],
     {"selection": Selection(include="norm"), "family_options": dcptool.family_options("hf", hf_experts="fused"), "family": "hf"}),
    ("export-hf", ["--config-dir", CONFIG, "--exclude", "xyz"], {"config_dir": CONFIG, "selection": Selection(exclude="xyz")}),
    ("export-hf", ["--config-dir", CONFIG, "--exclude", "lm_head|norm", "--allow-missing", "lm_head", "--allow-missing", "norms"],
     {"config_dir": CONFIG, "selection": Selection(exclude="lm_head|norm"),
      "completeness": Completeness(allow_missing=("lm_head", "norms"))}),
    ("convert", ["--to", "dcp", "--adapter", "hf", "--config-dir", CONFIG, "--exclude", "lm_head", "--allow-missing", "lm_head"],
     {"to": "dcp", "family": "hf", "config_dir": CONFIG, "selection": Selection(exclude="lm_head"),
      "completeness": Completeness(allow_missing="lm_head")}),
    ("export-hf", ["--config-dir", CONFIG, "--quantize", "fp8", "--block-size", "32x64", "--scale-format", "ue8m0"],
     {"config_dir": CONFIG, "quantize": Quantize("fp8", block_size="32x64", scale_format="ue8m0")}),
    ("export-hf", ["--quantize", "fp8", "--quant-format", "compressed-tensors"],
     {"quantize": Quantize("fp8", layout="compressed-tensors")}),
    ("reshard", ["--dp", "4", "--tp", "1"], {"mesh": MeshOptions(dp=4, tp=1)}),
    ("reshard", ["--dp", "1", "--tp", "2", "--dtype", "bfloat16", "--keep-rank-state", "--config-dir", CONFIG],
     {"mesh": MeshOptions(dp=1, tp=2), "dtype": "bfloat16", "keep_rank_state": True, "config_dir": CONFIG}),
    ("reshard", ["--dp", "2", "--compress", "zstd", "--adapter", "archon", "--config-dir", CONFIG],
     {"mesh": MeshOptions(dp=2), "format_options": format_options("dcp", compress="zstd"), "family": "archon",
      "config_dir": CONFIG}),
    ("reshard", ["--to", "fsdp1", "--world-size", "2", "--optim-form", "orig"],
     {"to": "fsdp1", "mesh": MeshOptions(world_size=2), "format_options": format_options("fsdp1", optim_form="orig")}),
    ("reshard", ["--dp-replicate", "2", "--cp", "1", "--plan", "fsdp", "--max-memory", "1MiB"],
     {"mesh": MeshOptions(dp_replicate=2, cp=1, plan="fsdp"), "reading": Reading(max_memory="1MiB")}),
    ("import-hf", ["--dp", "2", "--tp", "2", "--adapter", "torchtitan"],
     {"mesh": MeshOptions(dp=2, tp=2), "family": "torchtitan"}),
    ("import-hf", ["--world-size", "2", "--dtype", "bfloat16"], {"mesh": MeshOptions(world_size=2), "dtype": "bfloat16"}),
    ("import-hf", ["--dp", "2", "--allow-unexpected", "--allow-missing", "vision"],
     {"mesh": MeshOptions(dp=2), "completeness": Completeness(allow_unexpected=True, allow_missing="vision")}),
]
API = {"convert": dcptool.convert, "export-hf": dcptool.export_hf, "reshard": dcptool.reshard,
       "import-hf": dcptool.import_hf}


@pytest.fixture(scope="module")
def sources(checkpoints, tmp_path_factory):
    """A torchtitan-layout DCP saved by a real FSDP2 job (dp=2), its HF config, and its Hugging Face export."""
    dcp_path, reference = checkpoints("fsdp2_dp2")
    hf_path = tmp_path_factory.mktemp("one-path") / "hf"
    dcptool.export_hf(dcp_path, hf_path, config_dir=reference)
    return {"dcp": dcp_path, "hf": hf_path, "config": str(reference)}


def files_of(path: Path) -> dict[str, bytes]:
    """Every file of an output (a folder or one file) with its bytes."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def source_for(command: str, sources: dict) -> Path:
    return sources["hf" if command == "import-hf" else "dcp"]


@pytest.mark.parametrize("command, cli_options, api_options", CASES,
                         ids=[f"{c}{''.join(o)}" for c, o, _ in CASES])
def test_command_line_and_api_write_the_same_bytes(sources, tmp_path, command, cli_options, api_options):
    source = source_for(command, sources)
    cli_options = [sources["config"] if option == CONFIG else option for option in cli_options]
    api_options = {key: sources["config"] if value == CONFIG else value for key, value in api_options.items()}
    name = "out.pt" if api_options.get("to") == "torch" else "out"  # a torch.save archive holds its file's name
    (tmp_path / "cli").mkdir()
    (tmp_path / "api").mkdir()
    by_cli, by_api = tmp_path / "cli" / name, tmp_path / "api" / name
    run_cli(command, source, by_cli, *cli_options)
    API[command](source, by_api, **api_options)
    cli_files, api_files = files_of(by_cli), files_of(by_api)
    assert cli_files, f"{command} wrote nothing"
    assert sorted(cli_files) == sorted(api_files)
    assert [name for name in cli_files if cli_files[name] != api_files[name]] == []


# The LoRA options, on a peft model's checkpoint (conftest.lora_runs); LORA is replaced by its folder.
LORA = "<the LoRA runs' folder>"
LORA_CASES = [
    ("export-hf", ["--lora", "merge", "--lora-alpha", "12", "--dtype", "bfloat16"],
     {"lora": Lora("merge", alpha=12), "dtype": "bfloat16"}),
    ("export-hf", ["--lora", "adapter", "--lora-config", f"{LORA}/lora/huggingface/adapter_config.json"],
     {"lora": Lora("adapter", config=f"{LORA}/lora/huggingface/adapter_config.json")}),
    ("import-hf", ["--dp", "2", "--lora-adapter", f"{LORA}/lora.reference/adapter"],
     {"mesh": MeshOptions(dp=2), "lora_folder": f"{LORA}/lora.reference/adapter"}),
]


@pytest.mark.parametrize("command, cli_options, api_options", LORA_CASES,
                         ids=[f"{c}{''.join(o[:2])}" for c, o, _ in LORA_CASES])
def test_lora_options_write_the_same_bytes(lora_runs, tmp_path, command, cli_options, api_options):
    source = lora_runs / ("lora.reference/base" if command == "import-hf" else "lora")
    cli_options = [option.replace(LORA, str(lora_runs)) for option in cli_options]
    def placed(value):  # LORA in a path, or in a path of a Lora
        if isinstance(value, Lora) and value.config:
            return dataclasses.replace(value, config=value.config.replace(LORA, str(lora_runs)))
        return value.replace(LORA, str(lora_runs)) if isinstance(value, str) else value

    api_options = {key: placed(value) for key, value in api_options.items()}
    run_cli(command, source, tmp_path / "cli", *cli_options)
    API[command](source, tmp_path / "api", **api_options)
    cli_files, api_files = files_of(tmp_path / "cli"), files_of(tmp_path / "api")
    assert cli_files and sorted(cli_files) == sorted(api_files)
    assert [name for name in cli_files if cli_files[name] != api_files[name]] == []


# Every writing command with every format it can write; reshard's --to takes the formats laid out over ranks.
DRY_RUNS = ([("convert", ["--to", name]) for name in formats.writable()] + [("export-hf", [])]
            + [("reshard", ["--to", name, "--world-size", "2"]) for name in formats.writable()
               if formats.get(name).sharding.value != "none"]
            + [("import-hf", ["--dp", "2"])])


@pytest.mark.parametrize("command, options", DRY_RUNS, ids=[f"{c}{''.join(o)}" for c, o in DRY_RUNS])
def test_dry_run_writes_nothing(sources, tmp_path, command, options):
    destination = tmp_path / "out"
    before = sorted(tmp_path.rglob("*"))
    result = run_cli(command, source_for(command, sources), destination, *options, "--dry-run")
    assert not destination.exists() and sorted(tmp_path.rglob("*")) == before
    assert "would write" in result.stdout or "no problems" in result.stdout, result.stdout
    api_command = API[command]
    api_options = {"to": options[1]} if command == "convert" else {}
    report = api_command(source_for(command, sources), destination, **api_options, writing=Writing(dry_run=True))
    assert report.dry_run and report.planned_files and not destination.exists()


def test_reshard_to_fsdp1_dry_run_lists_its_files_and_writes_nothing(sources, tmp_path):
    """The bug issue 20 names: reshard --to fsdp1 --dry-run wrote its output and ignored --plan."""
    destination = tmp_path / "fsdp1"
    result = run_cli("reshard", sources["dcp"], destination, "--to", "fsdp1", "--world-size", "2", "--dry-run")
    assert not destination.exists()
    assert "model_world_size_2_rank_1.pt" in result.stdout
    refused = run_cli("reshard", sources["dcp"], destination, "--to", "fsdp1", "--tp", "2", "--dry-run", check=False)
    assert refused.returncode == 2 and "data-parallel" in refused.stderr and not destination.exists()


def test_options_a_format_does_not_take_are_refused_by_both(sources, tmp_path):
    """The same refusal, naming the command line's flags there and the API's option fields here."""
    for cli_options, api_options, said, expected in [
            (["--to", "torch", "--compress", "zstd"], {"to": "torch", "format_options": format_options("dcp", compress="zstd")},
             "--compress zstd goes with --to dcp", "format_options.compress='zstd' goes with to='dcp'"),
            (["--to", "dcp", "--optim-form", "flat"], {"to": "dcp", "format_options": format_options("fsdp1", optim_form="flat")},
             "--optim-form flat goes with --to fsdp1", "format_options.optim_form='flat' goes with to='fsdp1'"),
            (["--to", "hf", "--world-size", "4"], {"to": "hf", "format_options": format_options("fsdp1", world_size=4)},
             "--world-size 4 goes with --to fsdp1", "format_options.world_size=4 goes with to='fsdp1'")]:
        result = run_cli("convert", sources["dcp"], tmp_path / "out", *cli_options, check=False)
        assert result.returncode == 2 and said in result.stderr, result.stderr
        with pytest.raises(dcptool.UsageError) as refused:
            dcptool.convert(sources["dcp"], tmp_path / "out", **api_options)
        assert str(refused.value) == expected
        assert not (tmp_path / "out").exists()
    with pytest.raises(dcptool.UsageError) as refused:  # the registry refuses them as they are made
        format_options("torch", compress="zstd")
    assert str(refused.value) == "compress='zstd' goes with to='dcp'"


def test_reports_of_inspect_and_verify_are_the_api_s(sources, tmp_path):
    """The commands that only read print, as JSON, the report their API function returns."""
    printed = json.loads(run_cli("inspect", sources["dcp"], "--json", "--include", "layers", "--stats").stdout)
    returned = json.loads(json.dumps(dcptool.inspect(sources["dcp"], selection=Selection(include="layers"),
                                                     stats=True).to_json()))
    for report in (printed, returned):
        del report["stats"]["seconds"]  # how long the reading took
    assert printed == returned
    printed = json.loads(run_cli("verify", sources["dcp"], sources["hf"], "--json", "--prefix-a", "auto").stdout)
    returned = dcptool.verify(sources["dcp"], sources["hf"], side_a=Side(prefix="auto"))
    assert printed == json.loads(json.dumps(returned.to_json()))
    picture = json.loads(run_cli("inspect", sources["dcp"], "--layout", "model.norm.weight", "--mesh", "dp=2",
                                 "--json").stdout)
    assert picture == json.loads(json.dumps(dcptool.tensor_layout(sources["dcp"], "model.norm.weight",
                                                                  mesh=MeshOptions(dp=2)).to_json()))


@pytest.mark.parametrize("cli_options, api_options", [
    (["--weights", "1,3", "--to", "torch"], {"weights": "1,3", "to": "torch"}),
    (["--dp", "1", "--tp", "2", "--config-dir", CONFIG, "--include-optimizer", "--max-memory", "1MiB"],
     {"mesh": MeshOptions(dp=1, tp=2), "config_dir": CONFIG, "include_optimizer": True,
      "reading": Reading(max_memory="1MiB")}),
], ids=["weights-torch", "tp2-optimizer"])
def test_average_by_command_line_and_api_writes_the_same_bytes(sources, tmp_path, cli_options, api_options):
    cli_options = [sources["config"] if option == CONFIG else option for option in cli_options]
    api_options = {key: sources["config"] if value == CONFIG else value for key, value in api_options.items()}
    name = "out.pt" if api_options.get("to") == "torch" else "out"
    (tmp_path / "cli").mkdir()
    (tmp_path / "api").mkdir()
    run_cli("average", sources["dcp"], sources["dcp"], tmp_path / "cli" / name, *cli_options)
    dcptool.average([sources["dcp"], sources["dcp"]], tmp_path / "api" / name, **api_options)
    cli_files, api_files = files_of(tmp_path / "cli" / name), files_of(tmp_path / "api" / name)
    assert cli_files and sorted(cli_files) == sorted(api_files)
    assert [name for name in cli_files if cli_files[name] != api_files[name]] == []


def test_average_dry_run_writes_nothing_and_diff_prints_the_api_s_report(sources, tmp_path):
    destination = tmp_path / "out"
    result = run_cli("average", sources["dcp"], sources["hf"], destination, "--dry-run")
    assert "would write" in result.stdout and not destination.exists()
    assert dcptool.average([sources["dcp"], sources["hf"]], destination, writing=Writing(dry_run=True)).planned_files
    assert not destination.exists()
    printed = json.loads(run_cli("diff", sources["dcp"], sources["hf"], "--json", "--top", "2").stdout)
    assert printed == json.loads(json.dumps(dcptool.diff(sources["dcp"], sources["hf"]).to_json(2)))
