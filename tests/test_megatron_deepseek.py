"""DeepSeek-V3 in Megatron-Core's names, against a checkpoint megatron-core 0.19.2 saves itself.

A tiny transformers DeepSeek-V3 (latent attention with q and kv low rank, a dense first layer, routed experts
with a sigmoid router, its score bias and scaling, a shared expert) with one multi-token-prediction layer
(random, in DeepSeek's released names: transformers builds none) becomes Megatron's GPTModel
(``MLATransformerConfig``, the local specs of ``get_gpt_decoder_block_spec`` and ``get_gpt_mtp_block_spec``)
through ``harness.megatron_deepseek`` (a mapping written apart from dcptool's tables), and is saved by Megatron
itself at EP=2 in one gloo job. Oracles: the weights Megatron saves are the mapping's (so the mapping names
every tensor Megatron saves); dcptool's export of the save is the transformers folder, bitwise, and
``from_pretrained`` gives its logits; dcptool's import (made for TP=2) is loaded by Megatron's own
``dist_checkpointing.load`` at TP=2 x EP=2 (the experts split over both) in one job, holding the same weights,
with the ``_extra_state`` objects Megatron's own save has, and Megatron's forward of it gives transformers' logits
(this also checks the mapping: MLA's rope rows, the router's bias and scaling), its prediction layer's those of
transformers' ``MtpModel`` (the MTP layer as transformers loads it from DeepSeek's released names for speculative
decoding). Kimi-K2 (DeepSeek-V3's architecture under a config of its own) is checked on the same save. Needs
megatron-core (skipped without it).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import dcptool, megatron_load
from harness.family_models import load_hf_state, read_config
from harness.megatron_deepseek import (
    checkpoint_weights,
    main_and_mtp_logits,
    save_hf_with_mtp,
)
from harness.megatron_weights import padded_vocab
from harness.runtime import reference_dir

TOKENS = torch.randint(0, 250, (2, 9), generator=torch.Generator().manual_seed(0))
MTP_LAYERS = 1


@pytest.fixture(scope="module")
def deepseek_run(megatron_runs, tmp_path_factory):
    """(transformers folder, Megatron's own EP=2 save of it with one prediction layer, its model.json)."""
    root = tmp_path_factory.mktemp("megatron-deepseek")
    hf = save_hf_with_mtp(root / "hf", seed=7, num_nextn_predict_layers=MTP_LAYERS)
    config = read_config(hf)
    weights = root / "weights.pt"
    torch.save(checkpoint_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 1), MTP_LAYERS),
               weights)
    options = ["--hf-config", hf / "config.json", "--mtp-layers", MTP_LAYERS, "--ep", 2,
               "--num-layers", config["num_hidden_layers"], "--hidden", config["hidden_size"],
               "--heads", config["num_attention_heads"], "--kv-groups", config["num_attention_heads"],
               "--experts", config["n_routed_experts"], "--vocab", config["vocab_size"], "--divisible-by", 128,
               "--weights", weights]
    run = megatron_runs("deepseek-v3-ep2", 2, [str(option) for option in options])
    return hf, run, weights


def expected(hf) -> dict[str, torch.Tensor]:
    config = read_config(hf)
    return checkpoint_weights(load_hf_state(hf), config, padded_vocab(config["vocab_size"], 1), MTP_LAYERS)


def transformers_logits(folder) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(TOKENS).logits


def extra_states(folder) -> set[str]:
    return {key for key in json.loads(dcptool("inspect", folder, "--json").stdout)["objects"]
            if "._extra_state/" in key}


def test_export_of_megatrons_deepseek_save(deepseek_run, tmp_path):
    """Megatron saves what the harness's mapping says (per-layer keys, MLA, shared experts, expert bias, mtp);
    export-hf of it is the transformers folder bitwise, prediction layer included (its embedding and head
    copies from Megatron's shared ones), and gives its logits; verify agrees across the families."""
    hf, run, _ = deepseek_run
    saved = torch.load(reference_dir(run) / "full.pt", weights_only=True)
    mapped = expected(hf)
    assert saved.keys() == mapped.keys()
    for key in mapped:
        assert torch.equal(saved[key], mapped[key]), key

    export = tmp_path / "export"
    result = dcptool("export-hf", run / "iter_0000100", export, "--config-dir", hf)
    out = result.stdout + result.stderr
    assert "names: megatron (deepseek_v3), written as hf" in out
    assert "model.layers.2.shared_head.head.weight from output_layer.weight" in out
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key
    assert torch.equal(transformers_logits(export), transformers_logits(hf))
    assert "compared bitwise" in dcptool("verify", run / "iter_0000100", export).stdout


def test_megatron_loads_dcptools_deepseek_import(deepseek_run, tmp_path):
    """import-hf --adapter megatron of the transformers folder (prediction layer included; HF's copies of the
    embedding and head noted as left out), loaded by Megatron's dist_checkpointing.load at TP=2 x EP=2: the
    weights of Megatron's own save, the same _extra_state objects, and transformers' logits from its forward, its
    prediction layer's those of transformers' MtpModel."""
    hf, run, _ = deepseek_run
    imported = tmp_path / "imported"
    result = dcptool("import-hf", hf, imported, "--adapter", "megatron", "--tp", "2")
    out = result.stdout + result.stderr
    assert "left out model.layers.2.embed_tokens.weight (Megatron's prediction layers use the main" in out
    assert extra_states(imported) == extra_states(run / "iter_0000100")
    tokens = tmp_path / "tokens.pt"
    torch.save(TOKENS, tokens)
    loaded = megatron_load(imported, run / "model.json", tmp_path / "loaded.pt", "--tp", 2, "--ep", 2,
                           "--tokens", tokens)
    mapped = expected(hf)
    assert loaded.keys() - {"__logits__", "__mtp_logits__"} == mapped.keys()
    for key, tensor in mapped.items():
        assert torch.equal(loaded[key], tensor), key
    vocab = read_config(hf)["vocab_size"]
    main, predicted = main_and_mtp_logits(hf, TOKENS)
    torch.testing.assert_close(loaded["__logits__"][..., :vocab], main, rtol=1e-5, atol=1e-5)
    # the prediction layer's last position predicts a token past the input
    torch.testing.assert_close(loaded["__mtp_logits__"][0, :, :-1, :vocab], predicted, rtol=1e-5, atol=1e-5)


def kimi_k2(hf, folder):
    """The DeepSeek-V3 folder under Kimi-K2's config: model_type kimi_k2, architectures DeepseekV3ForCausalLM,
    DeepSeek-V3's fields (as the release ships it; transformers has no class of its own for it)."""
    shutil.copytree(hf, folder)
    config = read_config(folder) | {"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def test_kimi_k2_is_deepseek_v3_under_its_own_config(deepseek_run, tmp_path):
    """A Kimi-K2 config.json: export-hf of Megatron's DeepSeek-V3 save names the kind kimi_k2, writes the same
    tensors bitwise and keeps the config's model_type, and DeepSeek-V3's transformers model of that config gives
    the source's logits (transformers' own loader knows no kimi_k2: it takes the config's fields as DeepSeek-V3's);
    import-hf --adapter megatron writes the tensors and _extra_state objects of Megatron's own save (which its
    load takes, test_megatron_loads_dcptools_deepseek_import). Without the config, names say deepseek_v3."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf, run, _ = deepseek_run
    kimi = kimi_k2(hf, tmp_path / "kimi")
    export = tmp_path / "export"
    result = dcptool("export-hf", run / "iter_0000100", export, "--config-dir", kimi)
    assert "names: megatron (kimi_k2), written as hf" in result.stdout + result.stderr
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[key], exported[key]) for key in source)
    assert read_config(export)["model_type"] == "kimi_k2"
    fields = {key: value for key, value in read_config(export).items() if key != "model_type"}
    model = DeepseekV3ForCausalLM.from_pretrained(export, config=DeepseekV3Config.from_dict(fields),
                                                  attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(TOKENS).logits
    assert torch.equal(logits, transformers_logits(hf))

    imported = tmp_path / "imported"
    result = dcptool("import-hf", kimi, imported, "--adapter", "megatron")
    assert "names: hf (kimi_k2), written as megatron" in result.stdout + result.stderr
    run_state = "^(rng_state|rerun_state_machine_state|common_state)/"  # the run's, not the model's
    assert "compared bitwise" in dcptool("verify", imported, run / "iter_0000100", "--exclude", run_state).stdout
    assert extra_states(imported) == extra_states(run / "iter_0000100")
    # the names alone are DeepSeek-V3's; the config the import keeps says Kimi-K2
    assert "names: megatron (kimi_k2)" in dcptool("inspect", imported).stdout
    (imported / "config.json").unlink()
    assert "names: megatron (deepseek_v3)" in dcptool("inspect", imported).stdout
