"""Peak memory of a conversion stays within the --max-memory budget on a model several times larger."""

import subprocess
import sys

import pytest

BUDGET_MB = 16


def peak_rss_mb(*args) -> float:
    """Peak resident memory of one dcptool run, measured in a fresh parent so no earlier child counts."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")
    result = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "dcptool", "--quiet", *map(str, args)],
                            capture_output=True, text=True, check=True)
    return int(result.stdout.strip().splitlines()[-1]) / 1024


@pytest.fixture(scope="module")
def big_checkpoint(checkpoints):
    """~90 MB of float32 weights (plus twice that in Adam state), saved by a real FSDP2 job (conftest)."""
    return checkpoints("big")[0]


@pytest.fixture(scope="module")
def baseline_mb(big_checkpoint):
    """Peak memory of start-up and metadata, no data moved."""
    return peak_rss_mb("inspect", big_checkpoint, "--json")


@pytest.mark.parametrize("command", [["export-hf"], ["convert", "--to", "torch"]])
def test_peak_memory_within_budget(big_checkpoint, baseline_mb, tmp_path, command):
    verb, *options = command
    peak = peak_rss_mb(verb, big_checkpoint, tmp_path / "out", *options, "--max-memory", f"{BUDGET_MB}MiB")
    model_mb = sum(f.stat().st_size for f in big_checkpoint.glob("*.distcp")) / 2**20
    assert model_mb > 10 * BUDGET_MB
    # Data buffers are the budget; allow some slack for the allocator and per-file metadata.
    assert peak - baseline_mb < BUDGET_MB + 24, (peak, baseline_mb, model_mb)


def test_average_peak_memory_within_budget(big_checkpoint, baseline_mb, tmp_path):
    """Computed tensors (a mean of two sources, optimizer state included) stream within the budget too."""
    peak = peak_rss_mb("average", big_checkpoint, big_checkpoint, tmp_path / "out", "--include-optimizer",
                       "--max-memory", f"{BUDGET_MB}MiB")
    assert peak - baseline_mb < BUDGET_MB + 24, (peak, baseline_mb)


def test_lora_merge_within_budget(lora_runs, tmp_path):
    """export-hf --lora merge computes every merged weight in float32 blocks no larger than the scratch buffer:
    within the budget too (a LoRA run's checkpoint saved by a real FSDP2 job, harness.lora_jobs)."""
    checkpoint = lora_runs / "big"
    baseline = peak_rss_mb("inspect", checkpoint, "--json")
    # float32 weights merged and rounded to bfloat16: the most temporaries per element
    peak = peak_rss_mb("export-hf", checkpoint, tmp_path / "out", "--lora", "merge", "--lora-alpha", "32",
                       "--dtype", "bfloat16", "--max-memory", f"{BUDGET_MB}MiB")
    model_mb = sum(f.stat().st_size for f in checkpoint.glob("*.distcp")) / 2**20
    assert model_mb > 10 * BUDGET_MB
    assert peak - baseline < BUDGET_MB + 24, (peak, baseline, model_mb)
