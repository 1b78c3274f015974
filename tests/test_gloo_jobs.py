"""Smoke tests for tests/harness/gloo_jobs.py: real gloo jobs, no mocks.

The jobs run as the steps of two torchrun launches, one of 2 ranks and one of 4 (``run_steps`` of
tests/jobs.py): torch starts twice in all rather than once per job, and each test checks its own step.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import placements
from jobs import run_steps


@pytest.fixture(scope="module")
def dcp_dp2(checkpoints):
    """FSDP2 dp=2 checkpoint (torchtitan layout): the session's, saved once for every test file."""
    out, _ = checkpoints("fsdp2_dp2")
    return out


@pytest.fixture(scope="module")
def dcp_dp2_tp2(checkpoints):
    """FSDP2 dp=2 x TP tp=2 checkpoint (AReaL layout): the session's, saved once for every test file."""
    out, ref = checkpoints("fsdp2_dp2_tp2")
    assert any("_StridedShard" in placement for placement in placements(ref).values())
    return out


@pytest.fixture(scope="module")
def moe_dp2_ep2(two_ranks):
    """The tiny MoE on FSDP2 dp=2 with the experts split by ep=2 (torchtitan layout): a step of the 2-rank job."""
    root, steps = two_ranks
    save = steps["save-moe"]
    assert save.returncode == 0, save.stdout
    # EP puts 2 experts on each rank; FSDP2 then shards dim 0 again over the
    # 1-rank efsdp mesh, which torch records as a _StridedShard.
    assert ("placements layers.1.moe.experts.w1: (_StridedShard(dim=0, sf=2), Shard(dim=0)) "
            "on mesh ('efsdp', 'ep') (1, 2)") in save.stdout
    return root / "moe_dp2ep2"


def reference(out):
    return out.with_name(out.name + ".reference")


def chunk_layout(checkpoint):
    """{key: set of (offsets, sizes)} of every tensor in a DCP checkpoint's .metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: {(tuple(c.offsets), tuple(c.sizes)) for c in value.chunks}
            for key, value in metadata.items() if isinstance(value, TensorStorageMetadata)}


def changed_reference(out, key, index, folder):
    """``out``'s full.pt with one element of ``key`` changed, saved in ``folder``: a checker must refuse it."""
    full = torch.load(reference(out) / "full.pt", weights_only=True)
    full[key][index] += 1.0
    bad = folder / "full.pt"
    torch.save(full, bad)
    return bad


DENSE_CHANGED = "model.layers.1.mlp.down_proj.weight"
MOE_CHANGED = "optimizer.state.layers.1.moe.experts.w2.exp_avg"
FSDP1_VALUES = ["sharded_tensor", "dtensor"]


@pytest.fixture(scope="module")
def two_ranks(dcp_dp2, tmp_path_factory):
    """The 2-rank steps: the MoE's save (moe_dp2_ep2), FSDP1 saves and loads of both kinds of values, and a
    load that must fail."""
    root = tmp_path_factory.mktemp("two-ranks")
    steps = {"save-moe": ["save-dcp", root / "moe_dp2ep2", "--model", "moe", "--dp", "2", "--ep", "2"]}
    steps |= {f"save-fsdp1-{values}": ["save-fsdp1", root / f"fsdp1_{values}", "--world-size", "2",
                                      "--values", values] for values in FSDP1_VALUES}
    steps |= {f"load-fsdp1-{values}": ["load-fsdp1", root / f"fsdp1_{values}", "--world-size", "2",
                                       "--expect", reference(root / f"fsdp1_{values}") / "full.pt"]
              for values in FSDP1_VALUES}
    bad = changed_reference(dcp_dp2, DENSE_CHANGED, (-1, -1), root)
    steps["dense-mismatch"] = ["load-dcp", dcp_dp2, "--dp", "2", "--expect", bad,
                               "--model-config", reference(dcp_dp2) / "config.json"]
    return root, run_steps(2, steps)


@pytest.fixture(scope="module")
def four_ranks(dcp_dp2, dcp_dp2_tp2, moe_dp2_ep2, tmp_path_factory):
    """The 4-rank steps: loads on other meshes (some saving that mesh's own layout first), and one that must fail."""
    root = tmp_path_factory.mktemp("four-ranks")
    bad = changed_reference(moe_dp2_ep2, MOE_CHANGED, (-1, -1, -1), root)
    steps = {
        "dp2-to-dp4": ["load-dcp", dcp_dp2, "--dp", "4", "--expect", reference(dcp_dp2) / "full.pt"],
        "dp2-tp2-same-mesh": ["load-dcp", dcp_dp2_tp2, "--dp", "2", "--tp", "2", "--layout", "areal",
                              "--expect", reference(dcp_dp2_tp2) / "full.pt"],
        "dp2-tp2-to-dp4": ["load-dcp", dcp_dp2_tp2, "--dp", "4", "--layout", "areal",
                           "--expect", reference(dcp_dp2_tp2) / "full.pt"],
        # Load on (dp=2, tp=2, ep=2, etp=tp) and save that mesh's own layout first.
        "moe-tp2-ep2-etp2": ["load-dcp", moe_dp2_ep2, "--dp", "2", "--tp", "2", "--ep", "2",
                             "--expect", reference(moe_dp2_ep2) / "full.pt", "--save-layout", root / "moe-own"],
        "moe-mismatch": ["load-dcp", moe_dp2_ep2, "--model", "moe", "--dp", "4", "--expect", bad,
                         "--model-config", reference(moe_dp2_ep2) / "config.json"],
        "dp2-to-hsdp": ["load-dcp", dcp_dp2, "--dp-replicate", "2", "--dp", "2",
                        "--expect", reference(dcp_dp2) / "full.pt", "--save-layout", root / "hsdp-own"],
    }
    return root, run_steps(4, steps)


def test_save_dcp_writes_reference(dcp_dp2):
    ref = reference(dcp_dp2)
    assert (dcp_dp2 / ".metadata").is_file()
    assert {"config.json", "full.pt", "objects.pt", "reference.json"} <= {p.name for p in ref.iterdir()}
    info = json.loads((ref / "reference.json").read_text())
    assert (info["world_size"], info["dp"], info["tp"]) == (2, 2, 1)
    full = torch.load(ref / "full.pt", weights_only=True)
    assert full["model.embed_tokens.weight"].shape == (250, 64)
    assert "optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg" in full


def test_dcp_dp2_to_dp4(four_ranks):
    _, steps = four_ranks
    step = steps["dp2-to-dp4"]
    assert step.returncode == 0, step.stdout
    assert "OK:" in step.stdout
    assert "train_state.step=7" in step.stdout


def test_dcp_load_detects_mismatch(two_ranks):
    """The checker must fail on a one-element difference (not a no-op)."""
    _, steps = two_ranks
    step = steps["dense-mismatch"]
    assert step.returncode == 1, step.stdout
    assert "MISMATCH" in step.stdout and DENSE_CHANGED in step.stdout


def test_dcp_dp2_tp2_same_mesh(four_ranks):
    _, steps = four_ranks
    step = steps["dp2-tp2-same-mesh"]
    assert step.returncode == 0, step.stdout


def test_dcp_dp2_tp2_to_dp4(four_ranks):
    _, steps = four_ranks
    step = steps["dp2-tp2-to-dp4"]
    assert step.returncode == 0, step.stdout


@pytest.mark.parametrize("values", FSDP1_VALUES)
def test_fsdp1_round_trip(two_ranks, values):
    root, steps = two_ranks
    saved, loaded = steps[f"save-fsdp1-{values}"], steps[f"load-fsdp1-{values}"]
    assert saved.returncode == 0, saved.stdout
    expected_type = "ShardedTensor" if values == "sharded_tensor" else "DTensor"
    assert expected_type in saved.stdout
    out = root / f"fsdp1_{values}"
    for r in range(2):
        for kind in ("model", "optim", "extra_state"):
            assert (out / f"{kind}_world_size_2_rank_{r}.pt").is_file()
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 2}
    assert (out / "huggingface" / "config.json").is_file()
    assert loaded.returncode == 0, loaded.stdout
    assert f"values: {values}" in loaded.stdout


def test_moe_save_dcp_reference(moe_dp2_ep2):
    ref = reference(moe_dp2_ep2)
    info = json.loads((ref / "reference.json").read_text())
    assert {k: info[k] for k in ("model", "dp_replicate", "dp", "tp", "ep", "etp", "world_size")} == {
        "model": "moe", "dp_replicate": 1, "dp": 2, "tp": 1, "ep": 2, "etp": 1, "world_size": 2}
    assert info["placements"]["layers.1.moe.expert_bias"] == "plain tensor"
    assert json.loads((ref / "config.json").read_text())["model"] == "moe"
    full = torch.load(ref / "full.pt", weights_only=True)
    assert full["layers.1.moe.experts.w2"].shape == (4, 64, 32)
    assert full["layers.1.moe.expert_bias"].dtype == torch.float32
    assert "optimizer.state.layers.1.moe.experts.w1.exp_avg" in full
    # The experts are split on dim 0 by ep: two experts per chunk.
    layout = chunk_layout(moe_dp2_ep2)
    assert layout["layers.1.moe.experts.w1"] == {((0, 0, 0), (2, 32, 64)), ((2, 0, 0), (2, 32, 64))}


def test_moe_ep2_to_tp2_ep2_etp2_with_own_layout(moe_dp2_ep2, four_ranks):
    """Load on (dp=2, tp=2, ep=2, etp=tp) and save that mesh's own layout first."""
    root, steps = four_ranks
    step = steps["moe-tp2-ep2-etp2"]
    assert step.returncode == 0, step.stdout
    every_tensor = len(torch.load(reference(moe_dp2_ep2) / "full.pt", weights_only=True))
    assert f"OK: {every_tensor} tensors" in step.stdout
    assert ("placements layers.1.moe.experts.w2: (_StridedShard(dim=0, sf=2), Shard(dim=0), "
            "Shard(dim=2)) on mesh ('efsdp', 'ep', 'etp') (1, 2, 2)") in step.stdout
    assert ("placements layers.0.attention.wq.weight: (_StridedShard(dim=0, sf=2), Shard(dim=0)) "
            "on mesh ('dp_shard', 'tp') (2, 2)") in step.stdout
    layout = chunk_layout(root / "moe-own")
    # ep splits the experts (dim 0), etp their hidden dim: dim 1 of w1/w3, dim 2 of w2.
    w1 = {((2 * e, 16 * t, 0), (2, 16, 64)) for e in range(2) for t in range(2)}
    w2 = {((2 * e, 0, 16 * t), (2, 64, 16)) for e in range(2) for t in range(2)}
    assert layout["layers.1.moe.experts.w1"] == layout["layers.1.moe.experts.w3"] == w1
    assert layout["layers.1.moe.experts.w2"] == w2
    assert layout["optimizer.state.layers.1.moe.experts.w2.exp_avg"] == w2
    assert layout["layers.1.moe.expert_bias"] == {((0,), (4,))}
    assert set(layout) == set(chunk_layout(moe_dp2_ep2))


def test_moe_load_detects_mismatch(four_ranks):
    """A one-element change in an expert's optimizer state must fail the moe check too."""
    _, steps = four_ranks
    step = steps["moe-mismatch"]
    assert step.returncode == 1, step.stdout
    assert "MISMATCH" in step.stdout and MOE_CHANGED in step.stdout


def test_dcp_dp2_to_hsdp(dcp_dp2, four_ranks):
    """HSDP (2 replicas x dp_shard 2) saves exactly the chunks of a dp=2 job."""
    root, steps = four_ranks
    step = steps["dp2-to-hsdp"]
    assert step.returncode == 0, step.stdout
    assert "OK:" in step.stdout
    assert ("placements model.embed_tokens.weight: (Replicate(), Shard(dim=0)) "
            "on mesh ('dp_replicate', 'dp_shard') (2, 2)") in step.stdout
    assert chunk_layout(root / "hsdp-own") == chunk_layout(dcp_dp2)


def test_export_hf_removes_the_wrappers_torch_puts_on_names(two_ranks, tmp_path):
    """The model's weights keyed as torch's wrappers name them: FSDP1's ``_fsdp_wrapped_module.`` (the job's
    named_parameters), torch.compile's ``_orig_mod.``, DataParallel's (and DDP's) ``module.``, also around a
    compiled model, and activation checkpointing's ``_checkpoint_wrapped_module.``. export-hf writes the names
    transformers gives the model, each weight the one FSDP1 gathered; ``--prefix`` strips a wrapper of one's own."""
    import copy

    import transformers
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from conftest import dcptool

    root, steps = two_ranks
    assert steps["save-fsdp1-sharded_tensor"].returncode == 0, steps["save-fsdp1-sharded_tensor"].stdout
    ref = reference(root / "fsdp1_sharded_tensor")
    full = torch.load(ref / "full.pt", weights_only=True)
    config = transformers.AutoConfig.from_pretrained(ref)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(full)
    checkpointed = copy.deepcopy(model)
    for index, layer in enumerate(checkpointed.model.layers):
        checkpointed.model.layers[index] = checkpoint_wrapper(layer)
    wrapped = {
        "fsdp1": torch.load(ref / "fsdp1_named_parameters.pt", weights_only=True),
        "compiled": torch.compile(model).state_dict(),
        "data-parallel": torch.nn.DataParallel(model).state_dict(),
        "data-parallel-compiled": torch.nn.DataParallel(torch.compile(model)).state_dict(),
        "checkpointed": dict(checkpointed.named_parameters()),
        "own": {"actor": {"weights": model.state_dict()}},
    }
    assert all(any(part in key for key in wrapped[name]) for name, part in (
        ("fsdp1", "._fsdp_wrapped_module."), ("compiled", "_orig_mod."), ("data-parallel", "module."),
        ("data-parallel-compiled", "module._orig_mod."), ("checkpointed", "._checkpoint_wrapped_module.")))
    model_names = set(full) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, state in wrapped.items():
        torch.save(state, tmp_path / f"{name}.pt")
        prefix = ["--prefix", "actor.weights"] if name == "own" else []
        dcptool("export-hf", tmp_path / f"{name}.pt", tmp_path / name, "--config-dir", ref, *prefix)
        exported = load_file(tmp_path / name / "model.safetensors")
        assert set(exported) == model_names, (name, sorted(set(exported) ^ model_names)[:5])
        assert all(torch.equal(tensor, full[key]) for key, tensor in exported.items()), name
