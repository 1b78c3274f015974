"""Transformer Engine's layer spec in Megatron-Core's names: ``import-hf --adapter megatron --megatron-spec te``.

A Megatron-LM run built with Transformer Engine (``--transformer-impl transformer_engine``, its default on GPUs)
builds its layers with ``get_gpt_layer_with_transformer_engine_spec``, one with the local spec
(``--transformer-impl local``) with ``get_gpt_layer_local_spec``; the two save some norms under other names. TE
needs CUDA, so no TE model saves a checkpoint here: as the issue allows, the TE spec's names are checked by renaming
what the local spec saves, with a renaming the test reads off megatron-core 0.19.2's own spec functions (not off
dcptool's tables):

* ``get_gpt_decoder_layer_specs`` of the model's TransformerConfig, with and without Transformer Engine, gives each
  decoder layer's submodules (dense or MoE, MLA or not), and ``get_mtp_layer_spec_for_backend`` a prediction
  layer's (the last decoder layer's spec). Without TE installed, megatron-core leaves ``TESpecProvider`` out of
  ``gpt_layer_specs`` (None) and keeps placeholders for TE's classes; the test puts megatron-core's provider
  back for the call, so the spec function picks the modules it picks on a GPU (nothing is built).
* Each norm of a layer (``NORMS``: its place in the spec and the linear layer that reads its output, the
  architecture's order, written here) is saved where the spec puts it: as its own module's ``weight``, or, where the
  spec leaves an ``IdentityOp`` and makes that linear layer a LayerNorm-linear
  (``column_parallel_layer_norm_linear``), as the linear's ``layer_norm_weight``; then under the layer spec's
  ``sharded_state_dict_keys_map`` (the local spec's renames its norms to the fused names).
* The local names of each norm, to the TE names of the same norm, rename the local save's keys: the keys Megatron's
  local GPTModel saves (the harness's mappings, ``megatron_weights`` / ``megatron_deepseek`` /
  ``megatron_gpt_oss``, checked against Megatron's own saves in test_megatron_jobs.py, test_megatron_deepseek.py
  and test_megatron_gpt_oss.py).

Checked for every kind with Megatron names: the TE import holds exactly the renamed keys, with the local
mapping's values (and the local import's); the ``_extra_state`` objects of the norms TE keeps as modules of their
own (TE's RMSNorm has extra state since TE 2.0), keyed by megatron-core's own ``make_sharded_object_for_checkpoint``;
``args`` naming the ``transformer_impl``; and ``export-hf`` of the TE import is the source model, bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import dcptool, oracle
from harness.family_models import load_hf_state, read_config, save_hf
from harness.megatron_deepseek import checkpoint_weights, save_hf_with_mtp
from harness.megatron_weights import checkpoint_keys, megatron_weights, padded_vocab
from test_megatron_names import common_state, load_global

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss")
MTP_LAYERS = 1  # DeepSeek-V3's prediction layers

# Each norm of a decoder layer, by its place in the layer's submodules, and the linear layer that reads its output
# (attention.py, multi_latent_attention.py, mlp.py), which a spec may fuse it into.
NORMS = {"input_layernorm": "self_attention.linear_qkv",
         "self_attention.q_layernorm": "self_attention.linear_q_up_proj",  # MLA's: after linear_q_down_proj
         "self_attention.k_layernorm": None,
         "self_attention.kv_layernorm": "self_attention.linear_kv_up_proj",
         "pre_mlp_layernorm": "mlp.linear_fc1"}


def module_at(layer, place: str):
    """The module a layer's submodules put at ``place`` (``self_attention.linear_qkv``); None where there is none."""
    from functools import partial

    from megatron.core.transformer.spec_utils import ModuleSpec

    node = layer
    for part in place.split("."):
        if isinstance(node, ModuleSpec):
            node = node.submodules
        elif isinstance(node, partial):  # an MLP builder: partial(MLP.as_mlp_submodule, submodules=...)
            node = node.keywords.get("submodules")
        node = getattr(node, part, None)
    return node.module if isinstance(node, ModuleSpec) else node


def norm_names(layer) -> dict[str, str]:
    """Where a layer spec's submodules save each norm of ``NORMS`` it has: its module's weight, or the
    ``layer_norm_weight`` of the LayerNorm-linear it is fused into; then the spec's sharded_state_dict_keys_map."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.identity_op import IdentityOp

    providers = (LocalSpecProvider(), TESpecProvider())
    fused_linears = [provider.column_parallel_layer_norm_linear() for provider in providers]
    names = {}
    for norm, reader in NORMS.items():
        module = module_at(layer, norm)
        if module is not None and module is not IdentityOp:
            name = f"{norm}.weight"
        elif reader is not None and any(module_at(layer, reader) is linear for linear in fused_linears if linear):
            name = f"{reader}.layer_norm_weight"
        else:
            continue
        for old, new in layer.sharded_state_dict_keys_map.items():  # as TransformerLayer.sharded_state_dict maps
            if name.startswith(old):
                name = new + name[len(old):]
        names[norm] = name
    return names


def layer_specs(hf_config: dict, transformer_engine: bool) -> tuple[list, object]:
    """megatron-core's submodules of each decoder layer of the model and of its prediction layers, for the local
    spec or Transformer Engine's."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_spec_for_backend

    if hf_config["model_type"] == "deepseek_v3":
        from harness.megatron_deepseek import transformer_config

        config = transformer_config(hf_config, MTP_LAYERS)
    elif hf_config["model_type"] == "gpt_oss":
        from harness.megatron_gpt_oss import transformer_config

        config = transformer_config(hf_config)
    else:
        from harness.megatron_weights import transformer_config

        config = transformer_config(hf_config)
    with pytest.MonkeyPatch.context() as patch:  # the provider megatron-core sets only where TE imports
        patch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider)
        specs = gpt_layer_specs.get_gpt_decoder_layer_specs(config, transformer_engine, normalization="RMSNorm")
    backend = TESpecProvider() if transformer_engine else LocalSpecProvider()
    mtp = get_mtp_layer_spec_for_backend(specs[-1], backend).submodules.mtp_model_layer
    return [spec.submodules for spec in specs], mtp.submodules


def spec_renaming(hf_config: dict):
    """``rename(key)``: a key the local spec saves, as Transformer Engine's spec saves it; and the modules of the
    norms TE's spec keeps apart, in each decoder layer and in the prediction layers' decoder layer."""
    local, local_mtp = layer_specs(hf_config, transformer_engine=False)
    te, te_mtp = layer_specs(hf_config, transformer_engine=True)

    def renaming(local_layer, te_layer) -> dict[str, str]:
        before, after = norm_names(local_layer), norm_names(te_layer)
        assert before.keys() == after.keys(), (before, after)
        return {before[norm]: after[norm] for norm in before}

    per_layer = [renaming(a, b) for a, b in zip(local, te)]
    mtp = renaming(local_mtp, te_mtp)
    apart = [{name.removesuffix(".weight") for name in norm_names(layer).values() if name.endswith("norm.weight")}
             for layer in te]
    mtp_apart = {name.removesuffix(".weight") for name in norm_names(te_mtp).values() if name.endswith("norm.weight")}

    def rename(key: str) -> str:
        parts = key.split(".")
        if key.startswith("decoder.layers.") and parts[2].isdigit():
            prefix, rest, table = ".".join(parts[:3]) + ".", ".".join(parts[3:]), per_layer[int(parts[2])]
        elif key.startswith("decoder.layers."):  # stacked: every layer the same
            assert all(table == per_layer[0] for table in per_layer)
            prefix, rest, table = "decoder.layers.", key.removeprefix("decoder.layers."), per_layer[0]
        elif key.startswith("mtp.layers.") and parts[3] == "transformer_layer":
            prefix, rest, table = ".".join(parts[:4]) + ".", ".".join(parts[4:]), mtp
        else:
            return key
        return prefix + table.get(rest, rest)

    return rename, apart, mtp_apart


def te_norm_objects(te_keys, hf_config: dict, apart: list[set[str]], mtp_apart: set[str]) -> set[str]:
    """The ``_extra_state`` ShardedObject keys, by megatron-core's own helper, of every norm TE's spec keeps as a
    module of its own (TENorm): the decoder layers' (``apart``), the final norm, the prediction layers' own norms
    and their decoder layer's; one per layer of a stacked module."""
    from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

    def key(module: str, offsets=()) -> str:
        return make_sharded_object_for_checkpoint(None, f"{module}._extra_state", offsets, replica_id=0).unique_key

    layers = hf_config["num_hidden_layers"]
    keys = {key("decoder.final_layernorm")}
    stacked = all(not name.split(".")[2].isdigit() for name in te_keys if name.startswith("decoder.layers."))
    for layer in range(layers):
        for module in apart[layer]:
            keys.add(key(f"decoder.layers.{module}", ((0, layer, layers),)) if stacked
                     else key(f"decoder.layers.{layer}.{module}"))
    for n in range(MTP_LAYERS if hf_config["model_type"] == "deepseek_v3" else 0):
        keys |= {key(f"mtp.layers.{n}.{own}") for own in ("enorm", "hnorm", "final_layernorm")}
        keys |= {key(f"mtp.layers.{n}.transformer_layer.{module}") for module in mtp_apart}
    return keys


def local_weights(hf: Path) -> dict[str, torch.Tensor]:
    """What Megatron's local-spec GPTModel of the folder's model saves, by key (the harness's mappings)."""
    config = read_config(hf)
    rows = padded_vocab(config["vocab_size"], 1)
    if config["model_type"] == "deepseek_v3":
        return checkpoint_weights(load_hf_state(hf), config, rows, MTP_LAYERS)
    if config["model_type"] == "gpt_oss":
        from harness import megatron_gpt_oss

        return megatron_gpt_oss.checkpoint_weights(load_hf_state(hf), config, rows)
    return checkpoint_keys(megatron_weights(load_hf_state(hf), config, rows), config)


def described(folder: Path) -> dict:
    return json.loads(dcptool("inspect", folder, "--json").stdout)


def extra_states(folder: Path) -> set[str]:
    return {key for key in described(folder)["objects"] if "._extra_state/" in key}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """``hf_models(kind)``: a random tiny transformers model of that kind (DeepSeek-V3 with a prediction layer)."""
    root = tmp_path_factory.mktemp("megatron-te-hf")
    made = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = (save_hf_with_mtp(root / kind, seed=7, num_nextn_predict_layers=MTP_LAYERS)
                          if kind == "deepseek_v3" else save_hf(kind, root / kind, seed=5))
        return made[kind]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_import_for_transformer_engines_spec(kind, hf_models, tmp_path):
    """import-hf --megatron-spec te: exactly the keys of the local spec's save renamed as megatron-core's specs
    say, with its values (the harness's mapping's and dcptool's local import's); the _extra_state objects of the
    local import plus those of the norms TE keeps apart; args with transformer_impl; export-hf of it is the source
    model bitwise."""
    oracle("megatron.core")
    hf = hf_models(kind)
    config = read_config(hf)
    rename, apart, mtp_apart = spec_renaming(config)
    local_out, te_out = tmp_path / "local", tmp_path / "te"
    dcptool("import-hf", hf, local_out, "--adapter", "megatron")
    dcptool("import-hf", hf, te_out, "--adapter", "megatron", "--megatron-spec", "te")

    expected = {rename(key): tensor for key, tensor in local_weights(hf).items()}
    assert set(described(te_out)["tensors"]) == set(expected)
    te = load_global(te_out, {key: tensor.shape for key, tensor in expected.items()})
    local = load_global(local_out, {key: tensor.shape for key, tensor in local_weights(hf).items()})
    for key, tensor in local.items():
        assert torch.equal(te[rename(key)], tensor), key
        assert torch.equal(te[rename(key)], expected[rename(key)]), key

    assert extra_states(te_out) == extra_states(local_out) | te_norm_objects(expected, config, apart, mtp_apart)
    if kind in ("llama", "qwen2", "qwen3", "qwen3_moe"):  # the kinds dcptool writes args for
        assert vars(common_state(te_out)["args"])["transformer_impl"] == "transformer_engine"
        assert vars(common_state(local_out)["args"])["transformer_impl"] == "local"

    export = tmp_path / "export"
    dcptool("export-hf", te_out, export, "--config-dir", hf)
    source, exported = load_hf_state(hf), load_hf_state(export)
    assert source.keys() == exported.keys()
    for key in source:
        assert torch.equal(source[key], exported[key]), key


def test_the_specs_differ_where_megatron_core_says():
    """What the renaming above rests on, said in names: the TE spec keeps a MoE layer's pre_mlp_layernorm and MLA's
    input_layernorm apart and fuses MLA's q/kv norms into the up projections; the local spec names a MoE layer's
    norm before the MLP as fused (its keys map) and keeps MLA's norms apart."""
    oracle("megatron.core")
    from harness.family_models import hf_config

    qwen3_moe = hf_config("qwen3_moe").to_dict()
    local, _ = layer_specs(qwen3_moe, transformer_engine=False)
    te, _ = layer_specs(qwen3_moe, transformer_engine=True)
    assert norm_names(local[0])["pre_mlp_layernorm"] == "mlp.linear_fc1.layer_norm_weight"
    assert norm_names(te[0])["pre_mlp_layernorm"] == "pre_mlp_layernorm.weight"
    deepseek = hf_config("deepseek_v3").to_dict()
    local, _ = layer_specs(deepseek, transformer_engine=False)
    te, _ = layer_specs(deepseek, transformer_engine=True)
    assert set(norm_names(te[0]).values()) == {"input_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
                                               "self_attention.linear_q_up_proj.layer_norm_weight",
                                               "self_attention.linear_kv_up_proj.layer_norm_weight"}
    assert norm_names(te[1])["pre_mlp_layernorm"] == "pre_mlp_layernorm.weight"
    assert set(norm_names(local[0]).values()) == set(norm_names(local[1]).values()) == {
        "input_layernorm.weight", "pre_mlp_layernorm.weight", "self_attention.q_layernorm.weight",
        "self_attention.kv_layernorm.weight"}


def test_megatron_spec_goes_with_the_megatron_adapter(hf_models, tmp_path):
    """--megatron-spec with another adapter, or another spec name, is refused with exit 2."""
    hf = hf_models("qwen3")
    refused = dcptool("import-hf", hf, tmp_path / "out", "--megatron-spec", "te", check=False)
    assert refused.returncode == 2 and "megatron_spec" in refused.stderr.replace("-", "_"), refused.stderr
    refused = dcptool("import-hf", hf, tmp_path / "out", "--adapter", "megatron", "--megatron-spec", "fused",
                      check=False)
    assert refused.returncode == 2, refused.stderr
    assert not (tmp_path / "out").exists()
