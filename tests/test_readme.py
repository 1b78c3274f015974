"""The recipes of the README and of the pages of docs/ run as written.

Every command line of every ```bash block of README.md and docs/*.md runs, word for word, in a folder laid
out with the paths it names: tiny models of the same kind, saved by real gloo jobs (or by transformers' save_pretrained
for Hugging Face folders), in the layouts the recipe's engine writes. Each line must exit 0. Lines that need
what CI cannot have (the Hub, object storage, several nodes, minutes of benchmark) are listed in SKIPPED
with the test that covers them instead; a new block whose inputs are not declared in INPUTS fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import ACCELERATE_JOBS, FAMILY_JOBS, run_job

from conftest import ROOT, dcptool
from harness.family_models import save_hf

# The pages whose bash blocks run here: the README and every page of docs/ (a block that moves between them
# keeps its entries below, which are keyed by the start of its first line).
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Lines not run here (matched by their start), and where what they do is tested.
SKIPPED = {
    "scripts/demo.sh": "the demo installs into .venv itself; each of its steps is a command tested here",
    "scripts/test.sh": "runs this suite",
    "dcptool export-hf DeepSeek-V3": "needs DeepSeek-V3's float8 weights; tests/test_fp8.py dequantizes a tiny one",
    "dcptool import-hf gpt-oss-20b": "needs GPT-OSS's MXFP4 release; tests/test_mxfp4.py dequantizes a tiny one",
    "dcptool export-hf megatron/iter_0002000 v3-fp8": "needs DeepSeek-V3's FP8 release; tests/test_quantize.py takes a "
                                                      "tiny one through Megatron-Core's names and back, bitwise",
    "dcptool export-hf gpt-oss-run/step-500": "needs a GPT-OSS run; tests/test_quantize.py quantizes a tiny GPT-OSS",
    "dcptool inspect Qwen/": "the Hub is not reachable from CI; tests/test_hub.py serves a local one",
    "dcptool import-hf Qwen/": "the Hub; tests/test_hub.py",
    "dcptool verify my-export Qwen/": "the Hub; tests/test_hub.py",
    "dcptool export-hf step-1000 hf-1000 --config-dir base-model --push-to-hub": "the Hub; tests/test_hub.py",
    "pip install s3fs": "object storage; tests/test_remote.py runs fsspec's memory filesystem",
    "dcptool inspect s3://": "object storage; tests/test_remote.py",
    "dcptool export-hf s3://": "object storage; tests/test_remote.py",
    "dcptool reshard s3://": "object storage; tests/test_remote.py",
    "dcptool checksum gcs://": "object storage; tests/test_remote.py",
    "PYTHONPATH=tests python -m harness.synth_dcp": "1024 ranks of synthetic data: tests/test_scale.py runs it smaller",
    "dcptool inspect /tmp/llama-1024": "the 1024-rank checkpoint above; tests/test_scale.py",
    "python scripts/bench.py": "minutes of benchmark; tests/test_bench.py runs its rows on a small size",
    ".venv/bin/": "benchmark set-up and runs; tests/test_bench.py",
    "torchrun --nnodes 4": "four nodes",
}

# Each block (by the start of its first line) -> the paths it reads, made by the makers below.
INPUTS = {
    "dcptool export-hf outputs/checkpoint/step-2000": ["outputs/checkpoint/step-2000", "Qwen3-8B"],
    "dcptool inspect step-2000": ["step-2000", "base-model"],
    "dcptool checksum step-2000": ["step-2000"],
    "scripts/demo.sh": [],
    "dcptool export-hf DeepSeek-V3": ["run/step-100"],
    "dcptool inspect Qwen/": [],
    "pip install s3fs": [],
    "dcptool convert step-1000": ["step-1000", "global_step_10/actor"],
    "dcptool export-hf checkpoints/recover_checkpoint": ["checkpoints/recover_checkpoint", "Llama-3.1-8B"],
    "dcptool import-hf Qwen3-8B": ["Qwen3-8B", "Qwen3-30B-A3B"],
    "dcptool import-hf Qwen3-30B-A3B mcore-qwen3-moe": ["Qwen3-30B-A3B"],
    "dcptool inspect global_step_10/actor": ["global_step_10/actor"],
    "dcptool inspect titan/step-10": ["titan/step-10", "llama-hf"],
    "dcptool inspect checkpoint-500": ["checkpoint-500"],
    "dcptool inspect step-1000.pt": ["step-1000.pt", "Llama-3.1-8B"],
    "dcptool inspect archon/step-2000": ["archon/step-2000", "Qwen3-30B-A3B"],
    "PYTHONPATH=tests python -m harness.synth_dcp": [],
    "torchrun --nproc-per-node 8": ["step-1000"],
    "dcptool verify step-1000": ["step-1000", "step-1000.pt", "hf-out", "hf-bf16", "titan/step-10", "archon/step-10"],
    "dcptool check step-1000": ["step-1000", "hf-out"],
    ".venv/bin/pip": [],
    "dcptool average step-800": ["step-800", "step-900", "step-1000", "Llama-3.1-8B"],
    "dcptool diff step-900": ["step-900", "step-1000", "hf-bf16"],
    "scripts/test.sh": [],
    "dcptool inspect lora/step-300": ["lora/step-300", "base-llama"],
    "dcptool inspect run/iter_0000100": ["run/iter_0000100"],
    "dcptool export-hf archon/step-2000 qwen3-moe-fp8": ["archon/step-2000", "Qwen3-30B-A3B"],
}


def bash_blocks(text: str) -> list[tuple[int, list[str]]]:
    """``(line number, command lines)`` of every ```bash block; lines ending in ``\\`` joined to the next."""
    blocks, lines, start = [], None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if lines is None:
            if line.strip() == "```bash":
                lines, start = [], number
        elif line.strip() == "```":
            blocks.append((start, lines))
            lines = None
        elif lines and lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        elif line.strip():
            lines.append(line.strip())
    return blocks


BLOCKS = [(page.relative_to(ROOT).as_posix(), start, lines) for page in PAGES
          for start, lines in bash_blocks(page.read_text())]


def skipped(line: str) -> str | None:
    return next((why for start, why in SKIPPED.items() if line.startswith(start)), None)


def inputs_of(page: str, lines: list[str]) -> list[str]:
    declared = [paths for start, paths in INPUTS.items() if lines[0].startswith(start)]
    assert declared, f"{page} block starting {lines[0]!r}: declare the paths it reads in INPUTS (tests/test_readme.py)"
    return declared[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, checkpoints, lora_runs, verl_saves, request):
    """``made(path)``: the path ``path`` a recipe names, made once (a folder or file under a shared root)."""
    root = tmp_path_factory.mktemp("readme-inputs")
    done: dict[str, Path] = {}

    def hf_folder(out: Path, name: str, **fields) -> None:
        save_hf(name, out, seed=3, **fields)

    def family(out: Path, kind: str, family_name: str, hf: str, *mesh: str) -> None:
        run_job(2, "save-family", out, "--kind", kind, "--family", family_name, "--hf", get(hf), *mesh,
                module=FAMILY_JOBS)

    def export(out: Path, *options: str) -> None:
        step, reference = checkpoints("fsdp2_dp2")
        dcptool("export-hf", step, out, "--config-dir", reference, *options)

    def copy(source: Path):
        return lambda out: shutil.copytree(source, out)

    def megatron_legacy(out: Path) -> None:  # Megatron-LM's per-rank files of TP 2 x PP 2 (megatron-core 0.19.2)
        run = request.getfixturevalue("megatron_runs")("legacy_tp2_pp2")  # the session's: skips without megatron-core
        shutil.copytree(run / "iter_0000100", out)

    def trainer_checkpoint(out: Path) -> None:  # HF Trainer's checkpoint-N/ of an FSDP run, by accelerate's own saves
        pytest.importorskip("accelerate")
        run_job(2, "save", out, module=ACCELERATE_JOBS)

    def torch_save(out: Path) -> None:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(get("step-1000"), out)

    makers = {
        "Qwen3-8B": lambda out: hf_folder(out, "qwen3"),
        "Qwen3-30B-A3B": lambda out: hf_folder(out, "qwen3_moe", num_experts=8),
        "outputs/checkpoint/step-2000": lambda out: family(out, "qwen3", "torchtitan", "Qwen3-8B", "--dp", "2"),
        "archon/step-2000": lambda out: family(out, "qwen3_moe", "archon", "Qwen3-30B-A3B", "--dp", "2", "--ep", "2"),
        "step-2000": copy(checkpoints("wide_dp2_tp2")[0]),  # 4 KV heads, vocabulary 256: a recipe splits it over tp=4
        "base-model": copy(checkpoints("wide_dp2_tp2")[1]),  # step-2000's reference: config.json and full.pt
        "step-1000": copy(checkpoints("fsdp2_dp2")[0]),
        # the same model after more steps, saved on other meshes (average and diff recipes)
        "step-800": copy(checkpoints("dp2_step2")[0]),
        "step-900": copy(checkpoints("tp2_step3")[0]),
        "run/step-100": copy(checkpoints("fsdp2_dp2")[0]),
        "step-1000.pt": torch_save,
        "hf-out": export,
        "hf-bf16": lambda out: export(out, "--dtype", "bfloat16"),
        "checkpoints/recover_checkpoint": copy(checkpoints("fsdp2_dp2_tp2")[0]),
        "Llama-3.1-8B": copy(checkpoints("fsdp2_dp2_tp2")[1]),
        "global_step_10/actor": copy(verl_saves / "verl" / "actor"),  # stock verl: flat parameters, DTensor values
        "llama-hf": lambda out: hf_folder(out, "llama"),
        "titan/step-10": lambda out: family(out, "llama", "torchtitan", "llama-hf", "--dp", "2"),
        "lora/step-300": copy(lora_runs / "lora"),
        "base-llama": copy(lora_runs / "lora.reference" / "base"),
        "archon/step-10": lambda out: dcptool("convert", get("titan/step-10"), out, "--to", "dcp",
                                              "--adapter", "archon", "--config-dir", get("llama-hf")),
        "run/iter_0000100": megatron_legacy,
        "checkpoint-500": trainer_checkpoint,
    }

    def get(path: str) -> Path:
        if path not in done:
            out = root / path
            out.parent.mkdir(parents=True, exist_ok=True)
            makers[path](out)
            done[path] = out
        return done[path]

    return get


@pytest.mark.parametrize("page,start,lines", BLOCKS, ids=[f"{page}:{start}" for page, start, _ in BLOCKS])
def test_recipe_runs_as_written(page, start, lines, made, tmp_path):
    run = [line for line in lines if not skipped(line)]
    if not run:
        pytest.skip("; ".join(sorted({skipped(line) for line in lines})))
    for path in inputs_of(page, lines):
        source, place = made(path), tmp_path / path
        place.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if source.is_dir() else shutil.copy)(source, place)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for line in run:
        result = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (f"{page} line {start}: {line}\nexited {result.returncode}\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def test_every_entry_names_a_block():
    """No stale entries: each key of INPUTS starts a block, each key of SKIPPED a line of one."""
    firsts = [lines[0] for _, _, lines in BLOCKS]
    every = [line for _, _, lines in BLOCKS for line in lines]
    assert not [start for start in INPUTS if not any(first.startswith(start) for first in firsts)]
    assert not [start for start in SKIPPED if not any(line.startswith(start) for line in every)]
