"""GPT-OSS in Megatron-Core's names, against a checkpoint megatron-core 0.19.2 saves itself.

A tiny transformers GPT-OSS (its bf16 layout: q/k/v/o biases, a sink per head, sliding windows every other layer,
YaRN RoPE, every layer a MoE with a biased router and clamped SwiGLU experts with biases, gate and up columns
alternating in ``gate_up_proj`` ``[E, H, 2F]``, ``down_proj`` ``[E, F, H]``) becomes Megatron's GPTModel (the
local spec: learnable softmax offset, window_size with window_attn_skip_freq, position_embedding_type yarn,
quick_gelu with clamp and offset, add_bias_linear) through ``harness.megatron_gpt_oss`` (a mapping written apart
from dcptool's tables), and is saved by Megatron itself at TP=2 x EP=2 (experts without TP: Megatron's MoE has biases only so) in one
gloo job, which first runs its
forward. Oracles: Megatron's forward before saving gives transformers' logits; the weights Megatron saves are the
mapping's (so the mapping names every tensor Megatron saves); dcptool's export of the save is the transformers
folder, bitwise, and ``from_pretrained`` gives its logits; dcptool's import is loaded by Megatron's own
``dist_checkpointing.load`` at TP=1 x EP=2 in one job, holding the same weights, with the ``_extra_state`` objects
Megatron's own save has, and Megatron's forward of it gives transformers' logits. Needs megatron-core (skipped
without it). And the release's MXFP4 experts into Megatron's names in one step, held against the mapping of
transformers' own dequantization.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import dcptool, megatron_load
from harness.family_models import load_hf_state, read_config, save_hf
from harness.megatron_gpt_oss import checkpoint_weights
from harness.megatron_weights import padded_vocab
from harness.runtime import reference_dir
from test_megatron_names import load_global
from test_mxfp4 import gpt_oss as mxfp4_release  # noqa: F401 (a fixture: the release and transformers' dequantization)
from test_mxfp4 import reference_state

TOKENS = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
ITERATION = "iter_0000100"


@pytest.fixture(scope="module")
def gpt_oss_run(megatron_runs, tmp_path_factory):
    """(transformers folder, Megatron's own TP=2 x EP=2 save of it with an optimizer state in fully_reshardable
    form, its tokens file)."""
    root = tmp_path_factory.mktemp("megatron-gpt-oss")
    hf = save_hf("gpt_oss", root / "hf", seed=7)
    config = read_config(hf)
    weights, tokens = root / "weights.pt", root / "tokens.pt"
    torch.save(expected(hf), weights)
    torch.save(TOKENS, tokens)
    # Megatron's MoE has biases only without expert tensor parallelism (transformer_config.py): ETP 1
    options = ["--hf-config", hf / "config.json", "--tp", 2, "--ep", 2, "--etp", 1,
               "--num-layers", config["num_hidden_layers"], "--hidden", config["hidden_size"],
               "--heads", config["num_attention_heads"], "--kv-groups", config["num_key_value_heads"],
               "--kv-channels", config["head_dim"], "--experts", config["num_local_experts"],
               "--vocab", config["vocab_size"], "--divisible-by", 128, "--weights", weights, "--tokens", tokens,
               "--optimizer"]
    run = megatron_runs("gpt-oss-tp2-ep2", 4, [str(option) for option in options])
    return hf, run, tokens


def expected(hf) -> dict[str, torch.Tensor]:
    config = read_config(hf)
    return checkpoint_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 1))


def hf_logits(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(TOKENS).logits


def assert_logits(got: dict[str, torch.Tensor], folder) -> None:
    """Megatron's logits (``harness.megatron.logits``) are transformers' (the vocabulary's padding columns cut)."""
    theirs = hf_logits(folder)
    torch.testing.assert_close(got["__logits__"][..., :theirs.shape[-1]], theirs, rtol=1e-5, atol=1e-5)


def extra_states(folder) -> set[str]:
    return {key for key in json.loads(dcptool("inspect", folder, "--json").stdout)["objects"]
            if "._extra_state/" in key}


def test_megatrons_gpt_oss_forward_and_save(gpt_oss_run):
    """Megatron's GPTModel of the mapping's weights (sinks, biases, sliding windows, YaRN, clamped experts with
    biases) computes transformers' logits and saves what the mapping says; its names alone say GPT-OSS."""
    hf, run, _ = gpt_oss_run
    config = read_config(hf)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert_logits(torch.load(reference_dir(run) / "logits.pt", weights_only=True), hf)
    saved = torch.load(reference_dir(run) / "full.pt", weights_only=True)
    mapped = expected(hf)
    assert saved.keys() == mapped.keys()
    for key in mapped:
        assert torch.equal(saved[key], mapped[key]), key
    assert "names: megatron (gpt_oss)" in dcptool("inspect", run / ITERATION).stdout


def test_export_of_megatrons_gpt_oss_save(gpt_oss_run, tmp_path):
    """export-hf of Megatron's save is the transformers folder bitwise (the experts' gate and up columns
    interleaved again, down_proj transposed back) and gives its logits."""
    hf, run, _ = gpt_oss_run
    export = tmp_path / "export"
    result = dcptool("export-hf", run / ITERATION, export, "--config-dir", hf)
    assert "names: megatron (gpt_oss), written as hf" in result.stdout + result.stderr
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key
    assert torch.equal(hf_logits(export), hf_logits(hf))
    assert "compared bitwise" in dcptool("verify", run / ITERATION, export).stdout


def test_optimizer_state_follows_its_parameter_into_hf_names(gpt_oss_run, tmp_path):
    """convert to an HF-named DCP: the fully_reshardable optimizer state of each weight taken apart as the weight is
    (the experts' gate and up columns interleaved, down_proj transposed), so each slot keeps its relation to its
    weight (harness.megatron's optimizer: param = the weight, exp_avg = 0.1 x, exp_avg_sq = its square, made in
    Megatron's layout), and the weights are the transformers model's."""
    import torch.distributed.checkpoint as dcp

    hf, run, _ = gpt_oss_run
    out = tmp_path / "hf-dcp"
    dcptool("convert", run / ITERATION, out, "--to", "dcp", "--adapter", "hf", "--config-dir", hf)
    names = json.loads(dcptool("inspect", out, "--json").stdout)["tensors"]
    source = load_hf_state(hf)
    for weight in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_bias",
                   "model.layers.1.mlp.experts.down_proj", "model.layers.0.self_attn.sinks"):
        slots = {slot: f"optimizer.state.{weight}.{slot}" for slot in ("param", "exp_avg", "exp_avg_sq")}
        state = {key: torch.empty(names[key]["shape"]) for key in (weight, *slots.values())}
        dcp.load(state, storage_reader=dcp.FileSystemReader(out), no_dist=True)
        assert torch.equal(state[weight], source[weight]), weight
        assert torch.equal(state[slots["param"]], source[weight]), weight
        assert torch.equal(state[slots["exp_avg"]], source[weight] * 0.1), weight
        assert torch.equal(state[slots["exp_avg_sq"]], source[weight] ** 2), weight


def test_megatron_loads_dcptools_gpt_oss_import(gpt_oss_run, tmp_path):
    """import-hf --adapter megatron of the transformers folder, loaded by Megatron's dist_checkpointing.load at
    TP=1 x EP=2: the weights of Megatron's own save, the same _extra_state objects, and transformers' logits from
    its forward."""
    hf, run, tokens = gpt_oss_run
    imported = tmp_path / "imported"
    result = dcptool("import-hf", hf, imported, "--adapter", "megatron")
    assert "names: hf (gpt_oss), written as megatron" in result.stdout + result.stderr
    assert extra_states(imported) == extra_states(run / ITERATION)
    loaded = megatron_load(imported, run / "model.json", tmp_path / "loaded.pt", "--tp", 1, "--ep", 2,
                           "--tokens", tokens)
    mapped = expected(hf)
    assert loaded.keys() - {"__logits__"} == mapped.keys()
    for key, tensor in mapped.items():
        assert torch.equal(loaded[key], tensor), key
    assert_logits(loaded, hf)


def test_release_with_mxfp4_experts_into_megatron(mxfp4_release, tmp_path):  # noqa: F811 (the fixture above)
    """GPT-OSS as released (MXFP4 experts, ``X_blocks`` + ``X_scales``) into Megatron's names in one step,
    ``import-hf --adapter megatron --dequantize``: the experts dequantized and taken apart as they are read, within
    a small --max-memory; torch's dcp.load of the output holds the mapping's Megatron tensors of the model
    transformers dequantizes from the release, bitwise."""
    release, reference = mxfp4_release
    out = tmp_path / "mcore"
    result = dcptool("import-hf", release, out, "--adapter", "megatron", "--dequantize", "--max-memory", "64KiB")
    assert "dequantized 4 MXFP4 tensors to bfloat16" in result.stderr
    config = reference.config.to_dict()
    mapped = checkpoint_weights(reference_state(reference), config, padded_vocab(config["vocab_size"], 1))
    described = json.loads(dcptool("inspect", out, "--json").stdout)["tensors"]
    assert set(described) == set(mapped) and {t["dtype"] for t in described.values()} == {"bfloat16"}
    read = load_global(out, {key: tensor.shape for key, tensor in mapped.items()})  # float32: bf16 exactly
    for key, tensor in mapped.items():
        assert torch.equal(read[key], tensor.float()), key
