"""Shared fixtures: checkpoints saved by real multi-process gloo jobs (harness.gloo_jobs), made once per session."""

import atexit
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from jobs import ForkServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SESSION_ENV, SESSION_CWD = dict(os.environ), os.getcwd()
_cli: ForkServer | None = None


def under_ci() -> bool:
    """Whether the suite runs as CI (env CI=1 or true, as .ci/run and CI services set it)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes", "on")


def import_error(module: str) -> Exception | None:
    """What stops ``module`` importing, or None once it is imported. Any exception counts: an optional stack fails
    in many ways (a missing triton, an incompatible torch)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001
        return error
    return None


def oracle(module: str):
    """Import ``module``, a library the tests check dcptool against or run jobs of (megatron.core, torchtitan's
    models, accelerate, ...), and return it. Where it does not import, the calling test (or module) is skipped,
    naming the error; under CI, where scripts/test.sh installs every one, it fails instead, so that a broken
    install cannot skip the cases it serves. A fixture that adds an oracle's cases only where it imports asks
    ``import_error(module) is None``; the test of such a case calls ``oracle`` itself."""
    error = import_error(module)
    if error is not None:
        why = f"{module} does not import: {error!r}"
        if under_ci():
            pytest.fail(f"{why} (CI: scripts/test.sh installs it)", pytrace=False)
        pytest.skip(why, allow_module_level=True)
    return sys.modules[module]


def dcptool(*args, check=True):
    """Run the real command line; returns the CompletedProcess (text output).

    Forked from a server that has dcptool imported (tests/jobs.py) while the environment and working
    directory are the session's; a new ``python -m dcptool`` process when a test has changed them."""
    global _cli
    if _cli is None:
        work = Path(tempfile.mkdtemp(prefix="dcptool-cli-"))
        _cli = ForkServer(work, env=SESSION_ENV, cwd=SESSION_CWD)
        atexit.register(shutil.rmtree, work, ignore_errors=True)
        atexit.register(_cli.close)
    argv = [*map(str, args)]
    if _cli.serves_here():
        [result] = _cli.run([argv])
    else:
        result = subprocess.run([sys.executable, "-m", "dcptool", *argv], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"dcptool {' '.join(map(str, args))} exited {result.returncode}:\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Lazily made DCP checkpoints, keyed by name; each is (path, reference folder). The first request of one
    makes every one of its number of ranks, as the steps of one job (torch starts once for all)."""
    root = tmp_path_factory.mktemp("ckpt")
    made = {}
    specs = {
        # torchtitan layout: model keys at the top level, optimizer.*, train_state, lr_scheduler
        "fsdp2_dp2": (2, ["--dp", "2", "--layout", "torchtitan"]),
        # AReaL layout {"dcp": {"model", "optim"}} with FSDP2 + TP (colwise weights get _StridedShard)
        "fsdp2_dp2_tp2": (4, ["--dp", "2", "--tp", "2", "--layout", "areal"]),
        # a small MoE (torchtitan names) with FSDP2 + EP, its experts split by ep=2 over dp=4
        "moe_dp4_ep2": (4, ["--model", "moe", "--dp", "4", "--ep", "2", "--layout", "torchtitan"]),
        # 4 KV heads and a vocabulary of 256: splits over tp=4 (README recipes)
        "wide_dp2_tp2": (4, ["--dp", "2", "--tp", "2",
                             "--model-config", '{"num_key_value_heads": 4, "vocab_size": 256}']),
        # the model of fsdp2_dp2 trained further, on other meshes and layouts (tests/test_arith.py, README recipes)
        "step2": (2, ["--dp", "1", "--tp", "2", "--steps", "2"]),
        "step3": (2, ["--dp", "2", "--steps", "3", "--layout", "areal"]),
        "dp2_step2": (2, ["--dp", "2", "--steps", "2"]),
        "tp2_step3": (2, ["--dp", "1", "--tp", "2", "--steps", "3"]),
        # layers enough to fold (diff folds runs of 3 or more as inspect does)
        "deep1": (2, ["--dp", "2", "--model-config", '{"num_hidden_layers": 3}']),
        "deep2": (2, ["--dp", "2", "--model-config", '{"num_hidden_layers": 3}', "--steps", "2"]),
        # ~90 MB of float32 weights (plus twice that in Adam state): several times a memory budget (test_memory.py)
        "big": (2, ["--dp", "2", "--model-config", json.dumps(
            {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
             "intermediate_size": 1536, "vocab_size": 8000, "tie_word_embeddings": False})]),
    }

    def get(name):
        if name not in made:
            from jobs import joined, run_job

            ranks = specs[name][0]
            alike = [other for other, (nproc, _) in specs.items() if nproc == ranks]
            run_job(ranks, *joined([["save-dcp", root / other, *specs[other][1]] for other in alike]))
            made.update({other: (root / other, root / f"{other}.reference") for other in alike})
        return made[name]

    return get


# verl's folders of 2 ranks (harness.verl_jobs): kind -> the save job's command line.
VERL_SAVES = {
    "verl": ("save", "--dtensor", "--flat-params"),  # stock verl: use_orig_params=False, a device mesh
    "fsdp1": ("save",),  # use_orig_params=True, no device mesh
    "fsdp2": ("save-fsdp2",),
}


@pytest.fixture(scope="session")
def verl_saves(tmp_path_factory):
    """One folder of each kind of VERL_SAVES, saved by one real 2-rank job: ``root/<kind>/actor``, and
    ``root/<kind>/actor.full.pt`` beside it (the state gathered in full, for a reference run)."""
    from jobs import VERL_JOBS, joined, run_job

    root = tmp_path_factory.mktemp("verl")
    run_job(2, *joined([[job, root / kind / "actor", *flags] for kind, (job, *flags) in VERL_SAVES.items()]),
            module=VERL_JOBS)
    return root


# Checkpoints of torch's other storage layers (harness.storage_jobs): name -> the save's command line.
STORAGE_SAVES = {
    "sharded-only": ["save-hf"],  # HuggingFaceStorageWriter, each rank's shard files
    "consolidated": ["save-hf", "--consolidate"],  # and consolidated into HF safetensors
    "zstd": ["save-zstd"],  # FileSystemWriter with the ZStandard extension
    "zstd-large": ["save-zstd", "--large"],  # and a tensor whose records decompress to 128 KiB
}


@pytest.fixture(scope="session")
def storage_saves(tmp_path_factory):
    """``get(name)``: the checkpoint of STORAGE_SAVES ``name``, with ``PATH.reference.pt`` beside it (the full
    state dict). The first call saves every one, as the steps of one 2-rank job (torch starts once for all)."""
    from jobs import STORAGE_JOBS, run_steps

    root = tmp_path_factory.mktemp("storage")
    steps = {}

    def get(name):
        if not steps:
            steps.update(run_steps(2, {other: [command, root / other, *options]
                                       for other, (command, *options) in STORAGE_SAVES.items()}, module=STORAGE_JOBS))
        assert steps[name].returncode == 0, steps[name].stdout
        return root / name

    return get


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory):
    """LoRA checkpoints of a peft-wrapped Llama (and Qwen3-MoE) trained with FSDP2 on 2 gloo ranks
    (harness.lora_jobs), one job for all variants: ``root/<variant>`` and ``root/<variant>.reference``; and
    ``root/lora-fsdp1``: the "lora" variant trained under FSDP1 and saved as verl's files. ``root/big`` (no
    reference) is several times a memory budget (tests/test_memory.py)."""
    from jobs import LORA_JOBS, run_job

    root = tmp_path_factory.mktemp("lora")
    run_job(2, "save-lora", root, "--variants", "lora,rslora_tied,dora,qwen3_moe,big", "--fsdp1", "lora",
            module=LORA_JOBS)
    return root


def load_reference(reference: Path) -> dict:
    import torch

    return torch.load(reference / "full.pt", weights_only=True)


def placements(reference: Path) -> dict:
    return json.loads((reference / "reference.json").read_text())["placements"]


def read_tensor(checkpoint, key):
    """A whole tensor read through dcptool's region reader, as a torch tensor of its dtype."""
    import numpy as np
    import torch

    from dcptool import dtypes

    tensor = checkpoint.tensors[key]
    itemsize = dtypes.dtype(tensor.dtype).itemsize
    out = np.empty(tensor.shape, dtype=dtypes.raw_view_type(itemsize))
    checkpoint.read_region(tensor, (0,) * len(tensor.shape), tensor.shape, out, memoryview(bytearray(4096)))
    return torch.from_numpy(out).view(getattr(torch, tensor.dtype))


def read_dcp(path: Path, scratch: Path) -> dict:
    """Every entry of a DCP checkpoint, flattened with '.', as torch itself reads it (``dcp_to_torch_save``)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def flat(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flat(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    whole = scratch / "whole.pt"
    dcp_to_torch_save(path, whole)
    return dict(flat(torch.load(whole, weights_only=True)))


# Megatron-LM runs saved by megatron-core itself (tests/harness/megatron.py): name -> (ranks, save options).
MEGATRON_RUNS = {
    "tp2": (2, ["--tp", "2", "--optimizer"]),
    # legacy per-rank files, and the same model (same seed and layout) saved as torch_dist: TP and PP with tied
    # embeddings (the last stage's copy of the output layer); a Qwen3-MoE-like model at TP 2 x EP 2 (experts split
    # along TP too: expert tensor parallelism is TP by default); MoE layers over 2 pipeline stages of 2 virtual
    # stages each (the experts' layers renumbered by their stage's offset)
    "legacy_tp2_pp2": (4, ["--format", "torch", "--tp", "2", "--pp", "2", "--num-layers", "4", "--tied"]),
    "legacy_tp2_pp2_dist": (4, ["--tp", "2", "--pp", "2", "--num-layers", "4", "--tied"]),
    "legacy_moe_tp2_ep2": (4, ["--format", "torch", "--tp", "2", "--ep", "2", "--experts", "4", "--qk-layernorm"]),
    "legacy_moe_tp2_ep2_dist": (4, ["--tp", "2", "--ep", "2", "--experts", "4", "--qk-layernorm"]),
    "legacy_pp2_vpp2": (2, ["--format", "torch", "--pp", "2", "--vpp", "2", "--num-layers", "4", "--experts", "4"]),
    "legacy_pp2_vpp2_dist": (2, ["--pp", "2", "--vpp", "2", "--num-layers", "4", "--experts", "4"]),
}


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory):
    """Lazily saved Megatron-LM run folders, by name: ``get(name)`` for one of ``MEGATRON_RUNS``, or
    ``get(name, ranks, options)`` for another (made once per session under that name). Each run folder holds
    ``iter_0000100/``, ``latest_checkpointed_iteration.txt`` and ``model.json``; ``RUN.reference/full.pt`` beside it
    holds every weight, whole.
    Skips where megatron-core does not import, fails under CI (``oracle``; scripts/test.sh installs 0.19.2)."""
    oracle("megatron.core")
    root = tmp_path_factory.mktemp("megatron-runs")
    made = {}

    def get(name, ranks=None, options=None):
        if name not in made:
            from jobs import MEGATRON_JOBS, run_job

            ranks, options = (ranks, options) if ranks else MEGATRON_RUNS[name]
            run_job(ranks, "save", root / name, *options, module=MEGATRON_JOBS, timeout=600)
            made[name] = root / name
        return made[name]

    return get


def megatron_load(checkpoint: Path, model: Path, out: Path, *options) -> dict:
    """Megatron's own ``dist_checkpointing.load`` of a torch_dist folder into the GPTModel of ``model`` (a run's
    model.json) at the layout of ``options`` (``"--tp", 2, "--ep", 2``, each 1 unless given; ``"--tokens", FILE``
    adds logits): every
    weight, whole, by torch_dist key (and ``__logits__``, ``__mtp_logits__`` for a model with prediction layers)."""
    import torch

    from jobs import MEGATRON_JOBS, run_job

    given = dict(zip(options[::2], options[1::2]))
    tp, pp, ep = (int(given.pop(flag, 1)) for flag in ("--tp", "--pp", "--ep"))  # 1 unless given
    ranks = tp * pp * ep  # experts borrow data-parallel ranks: ep x expert TP (= tp) x pp of them
    run_job(ranks, "load", checkpoint, "--model", model, "--out", out, "--tp", tp, "--pp", pp, "--ep", ep,
            *(str(item) for pair in given.items() for item in pair), module=MEGATRON_JOBS, timeout=600)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="session")
def bases(tmp_path_factory):
    """The fuzz tests' small checkpoint of each format (tests/fuzzing.py), made once per session."""
    from fuzzing import make_bases

    return make_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.fixture(scope="session")
def forked_runs(bases, tmp_path_factory):
    """The server the fuzz tests' runs fork from, with their limits (tests/fuzzing.py)."""
    from fuzzing import fork_server

    runs = fork_server(bases, tmp_path_factory.mktemp("warmup"), tmp_path_factory.mktemp("fork-server"))
    yield runs
    runs.close()
