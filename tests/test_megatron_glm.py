"""GLM-4.5 MoE in Megatron-Core's names, against a checkpoint megatron-core 0.19.2 saves itself.

A tiny transformers GLM-4.5 MoE (q/k/v biases, RoPE on half of each head, per-head q/k norms, heads of a size
apart from hidden / heads, a dense first layer, then a sigmoid router with its score bias and scaling, routed
experts and a shared one) with one multi-token-prediction layer (random, in GLM-4.5's released names:
transformers builds none in the main model) becomes Megatron's GPTModel (the local specs of
``get_gpt_decoder_block_spec`` and ``get_gpt_mtp_block_spec``, ``rotary_percent``) through
``harness.megatron_glm`` (a mapping written apart from dcptool's tables), and is saved by Megatron itself at
TP=2 x EP=2 in one gloo job, which first runs its forward. Oracles: Megatron's forward before saving gives
transformers' logits, and its prediction layer's logits are those of transformers' ``MtpModel`` (the MTP layer
as transformers loads it from the released names for speculative decoding); the weights Megatron saves are the
mapping's (so the mapping names every tensor Megatron saves); dcptool's export of the save is the transformers
folder, bitwise, and ``from_pretrained`` gives its logits; dcptool's import is loaded by Megatron's own
``dist_checkpointing.load`` at TP=1 x EP=2 in one job, holding the same weights, with the ``_extra_state`` objects
Megatron's own save has, and Megatron's forward of it gives transformers' logits, the prediction layer's too.
Needs megatron-core (skipped without it).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import dcptool, megatron_load
from harness.family_models import load_hf_state, read_config
from harness.megatron_deepseek import main_and_mtp_logits, save_hf_with_mtp
from harness.megatron_glm import checkpoint_weights
from harness.megatron_weights import padded_vocab
from harness.runtime import reference_dir

TOKENS = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
MTP_LAYERS = 1
ITERATION = "iter_0000100"
# What a GLM-4.5 config.json says that Megatron-LM's args state in their own fields.
GLM_FIELDS = ("attention_bias", "use_qk_norm", "head_dim", "first_k_dense_replace", "n_shared_experts",
              "routed_scaling_factor", "num_nextn_predict_layers", "norm_topk_prob", "n_routed_experts",
              "moe_intermediate_size", "intermediate_size", "num_key_value_heads")


@pytest.fixture(scope="module")
def glm_run(megatron_runs, tmp_path_factory):
    """(transformers folder, Megatron's own TP=2 x EP=2 save of it with one prediction layer, its tokens file)."""
    root = tmp_path_factory.mktemp("megatron-glm")
    hf = save_hf_with_mtp(root / "hf", seed=7, kind="glm4_moe", num_nextn_predict_layers=MTP_LAYERS)
    config = read_config(hf)
    weights, tokens = root / "weights.pt", root / "tokens.pt"
    torch.save(expected(hf), weights)
    torch.save(TOKENS, tokens)
    options = ["--hf-config", hf / "config.json", "--mtp-layers", MTP_LAYERS, "--tp", 2, "--ep", 2,
               "--num-layers", config["num_hidden_layers"], "--hidden", config["hidden_size"],
               "--heads", config["num_attention_heads"], "--kv-groups", config["num_key_value_heads"],
               "--kv-channels", config["head_dim"], "--experts", config["n_routed_experts"],
               "--vocab", config["vocab_size"], "--divisible-by", 128, "--weights", weights, "--tokens", tokens]
    run = megatron_runs("glm4-moe-tp2-ep2", 4, [str(option) for option in options])
    return hf, run, tokens


def expected(hf) -> dict[str, torch.Tensor]:
    config = read_config(hf)
    return checkpoint_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 1), MTP_LAYERS)


def assert_logits(got: dict[str, torch.Tensor], folder) -> None:
    """Megatron's logits (``harness.megatron.logits``) are transformers' (the vocabulary's padding columns cut; the
    prediction layer's last position, whose next token is past the input, left out)."""
    main, predicted = main_and_mtp_logits(folder, TOKENS)
    vocab = main.shape[-1]
    torch.testing.assert_close(got["__logits__"][..., :vocab], main, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["__mtp_logits__"][0, :, :-1, :vocab], predicted, rtol=1e-5, atol=1e-5)


def common_state(folder) -> dict:
    """The common state of a torch_dist folder as Megatron reads it (``dist_checkpointing.load_common_state_dict``)."""
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(folder)


def extra_states(folder) -> set[str]:
    return {key for key in json.loads(dcptool("inspect", folder, "--json").stdout)["objects"]
            if "._extra_state/" in key}


def test_megatrons_glm_forward_and_save(glm_run):
    """Megatron's GPTModel of the mapping's weights (partial RoPE, q/k/v biases and norms, the sigmoid router with
    its bias, shared experts, a prediction layer) computes transformers' logits, prediction included, and saves
    what the mapping says; its names alone say GLM-4.5 (no config)."""
    hf, run, _ = glm_run
    assert_logits(torch.load(reference_dir(run) / "logits.pt", weights_only=True), hf)
    saved = torch.load(reference_dir(run) / "full.pt", weights_only=True)
    mapped = expected(hf)
    assert saved.keys() == mapped.keys()
    for key in mapped:
        assert torch.equal(saved[key], mapped[key]), key
    assert "names: megatron (glm4_moe)" in dcptool("inspect", run / ITERATION).stdout


def test_export_of_megatrons_glm_save(glm_run, tmp_path):
    """export-hf of Megatron's save is the transformers folder bitwise, prediction layer included in GLM-4.5's
    released names (its embedding and head copies from Megatron's shared ones), and gives its logits; so does it
    without --config-dir, with a config.json made from the run's Megatron-LM args (partial RoPE, the dense first
    layer of moe_layer_freq, the sigmoid router, its scaling, the shared expert, the prediction layer)."""
    hf, run, _ = glm_run
    export = tmp_path / "export"
    result = dcptool("export-hf", run / ITERATION, export, "--config-dir", hf)
    out = result.stdout + result.stderr
    assert "names: megatron (glm4_moe), written as hf" in out
    assert "model.layers.2.shared_head.head.weight from output_layer.weight" in out
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key
    assert read_config(export)["model_type"] == "glm4_moe"
    expected_logits = main_and_mtp_logits(hf, TOKENS)
    for ours, theirs in zip(main_and_mtp_logits(export, TOKENS), expected_logits):
        assert torch.equal(ours, theirs)
    assert "compared bitwise" in dcptool("verify", run / ITERATION, export).stdout

    from_args = tmp_path / "from-args"  # no --config-dir: config.json made from the run's Megatron-LM args
    result = dcptool("export-hf", run / ITERATION, from_args)
    assert "config.json made from the Megatron-LM run's args" in result.stdout + result.stderr
    made = read_config(from_args)
    assert {name: made[name] for name in GLM_FIELDS} == {name: read_config(hf)[name] for name in GLM_FIELDS}
    for ours, theirs in zip(main_and_mtp_logits(from_args, TOKENS), expected_logits):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_megatron_loads_dcptools_glm_import(glm_run, tmp_path):
    """import-hf --adapter megatron of the transformers folder (prediction layer included; HF's copies of the
    embedding and head noted as left out), loaded by Megatron's dist_checkpointing.load at TP=1 x EP=2: the weights
    of Megatron's own save, the same _extra_state objects, and transformers' logits from its forward. The
    Megatron-LM args it writes are those of Megatron's own save (but for its parallel layout)."""
    hf, run, tokens = glm_run
    imported = tmp_path / "imported"
    result = dcptool("import-hf", hf, imported, "--adapter", "megatron")
    out = result.stdout + result.stderr
    assert "names: hf (glm4_moe), written as megatron" in out
    assert "left out model.layers.2.embed_tokens.weight (Megatron's prediction layers use the main" in out
    assert extra_states(imported) == extra_states(run / ITERATION)
    written, saved = (vars(common_state(folder)["args"]) for folder in (imported, run / ITERATION))
    both = {name for name in written.keys() & saved.keys() if not name.endswith("parallel_size")}
    assert {"rotary_percent", "moe_layer_freq", "moe_router_score_function", "moe_router_enable_expert_bias",
            "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "mtp_num_layers", "kv_channels",
            "add_qkv_bias", "qk_layernorm", "num_experts", "padded_vocab_size"} <= both
    assert {name: written[name] for name in both} == {name: saved[name] for name in both}
    loaded = megatron_load(imported, run / "model.json", tmp_path / "loaded.pt", "--tp", 1, "--ep", 2,
                           "--tokens", tokens)
    mapped = expected(hf)
    assert loaded.keys() - {"__logits__", "__mtp_logits__"} == mapped.keys()
    for key, tensor in mapped.items():
        assert torch.equal(loaded[key], tensor), key
    assert_logits(loaded, hf)
