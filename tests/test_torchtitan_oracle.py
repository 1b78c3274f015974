"""dcptool's torchtitan adapter against torchtitan 0.3's own StateDictAdapter, an independent oracle.

For each case a torchtitan 0.3 model is built on the meta device from the model registry's
``debugmodel`` configs (shrunk: fewer layers and experts, so a case takes seconds on CPU), its
state dict (torchtitan's own names, fused qkv already split by its state-dict hook) is filled
with seeded random values and saved as a single-process DCP, then:

* export: ``dcptool export-hf DCP OUT --config-dir CFG`` must write exactly
  ``adapter.to_hf(state_dict)``, bit for bit;
* import: ``adapter.to_hf(...)`` written as an HF folder, ``dcptool import-hf HF DCP2
  --adapter torchtitan`` must hold exactly ``adapter.from_hf(hf_state_dict)``, read back by
  torch's own ``dcp_to_torch_save``.

scripts/test.sh installs torchtitan 0.3.0 (without its training dependencies); the module skips where its
models do not import, and fails under CI (conftest.oracle).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import dcptool, oracle, read_dcp
from safetensors.torch import load_file, save_file

tt_deepseek_v3 = oracle("torchtitan.models.deepseek_v3")
tt_llama3 = oracle("torchtitan.models.llama3")
tt_qwen3 = oracle("torchtitan.models.qwen3")

# ---------------------------------------------------------------------------
# The cases: torchtitan model configs, shrunk
# ---------------------------------------------------------------------------


def _llama3():
    """Registry debugmodel (MHA: n_kv_heads None), 2 of its 6 layers."""
    config = tt_llama3.model_registry("debugmodel").model
    config.layers = config.layers[:2]
    return config


def _llama3_gqa():
    """The debugmodel with 4 kv heads for 16 query heads: wk's RoPE permutation uses the kv head count."""
    config = tt_llama3.model_registry("debugmodel").model
    config.layers = tt_llama3._build_llama3_layers(
        n_layers=2, dim=config.dim, n_heads=16, n_kv_heads=4, hidden_dim=512,
        rope=config.layers[0].attention.rope, attn_backend="flex")
    return config


def _qwen3():
    """Registry debugmodel (tied embeddings, GQA, head_dim 128 != dim / n_heads), 2 of its 8 layers."""
    config = tt_qwen3.model_registry("debugmodel").model
    config.layers = config.layers[:2]
    return config


def _qwen3_moe():
    """debugmodel_moe with 8 experts of width 64 instead of 64 of width 768, 2 layers."""
    config = tt_qwen3.model_registry("debugmodel_moe").model
    config.layers = tt_qwen3._build_qwen3_moe_layers(
        n_layers=2, dim=config.dim, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=64,
        num_experts=8, top_k=2, attn_backend="flex", moe_comm_backend="standard",
        rope=config.layers[0].attention.rope)
    return config


def _deepseek_v3():
    """Registry debugmodel (q_lora_rank 0: a plain wq), its dense layer 0 and MoE layer 1."""
    config = tt_deepseek_v3.model_registry("debugmodel").model
    config.layers = config.layers[:2]
    return config


def _deepseek_v3_q_lora():
    """MLA with a low-rank query (wq_a, q_norm, wq_b) as the full-size DeepSeek-V3 has it."""
    config = tt_deepseek_v3.model_registry("debugmodel").model
    config.layers = tt_deepseek_v3._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=config.dim, n_heads=8, q_lora_rank=64, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mscale=0.7, dense_hidden_dim=512,
        moe_hidden_dim=64, num_experts=8, num_shared_experts=2, router_top_k=3, router_score_func="softmax",
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=config.layers[0].attention.rope)
    return config


def _deepseek_v3_mtp():
    """Registry debugmodel_mtp's model (one multi-token-prediction layer), 2 main layers.

    torchtitan names the MTP block ``mtp_layers.0.*``; HF stores it as the layer after the last
    main one (``model.layers.2.*``, with ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``).
    """
    config = tt_deepseek_v3.model_registry("debugmodel", num_mtp_layers=1).model
    config.layers = config.layers[:2]
    return config


@dataclass(frozen=True)
class Case:
    kind: str  # HF model_type
    make: object  # () -> torchtitan model config
    adapter: type
    dtype: torch.dtype = torch.float32


CASES = {
    "llama3": Case("llama", _llama3, tt_llama3.Llama3StateDictAdapter),
    "llama3_gqa": Case("llama", _llama3_gqa, tt_llama3.Llama3StateDictAdapter),
    "qwen3": Case("qwen3", _qwen3, tt_qwen3.Qwen3StateDictAdapter),
    "qwen3_moe": Case("qwen3_moe", _qwen3_moe, tt_qwen3.Qwen3StateDictAdapter),
    "deepseek_v3": Case("deepseek_v3", _deepseek_v3, tt_deepseek_v3.DeepSeekV3StateDictAdapter, torch.bfloat16),
    "deepseek_v3_q_lora": Case("deepseek_v3", _deepseek_v3_q_lora, tt_deepseek_v3.DeepSeekV3StateDictAdapter),
    "deepseek_v3_mtp": Case("deepseek_v3", _deepseek_v3_mtp, tt_deepseek_v3.DeepSeekV3StateDictAdapter),
}


def hf_config(kind: str, config, state: dict) -> dict:
    """The HF config.json of a torchtitan model config (what export-hf's --config-dir and
    import-hf's folder give dcptool): head counts, expert counts, tied embeddings."""
    attn = config.layers[0].attention
    moe = next((layer.moe for layer in config.layers if getattr(layer, "moe", None) is not None), None)
    out = {
        "model_type": kind,
        "hidden_size": config.dim,
        "num_hidden_layers": len(config.layers),
        "num_attention_heads": attn.n_heads,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(config.enable_weight_tying),
        "torch_dtype": str(state["tok_embeddings.weight"].dtype).removeprefix("torch."),
    }
    if kind in ("llama", "qwen3", "qwen3_moe"):
        n_kv = attn.n_kv_heads if attn.n_kv_heads is not None else attn.n_heads
        head_dim = attn.head_dim or config.dim // attn.n_heads
        out |= {"num_key_value_heads": n_kv, "head_dim": head_dim}
        dense = next((k for k in state if k.endswith("feed_forward.w1.weight")), None)
        if dense:
            out["intermediate_size"] = state[dense].shape[0]
    if kind == "llama":
        out["architectures"] = ["LlamaForCausalLM"]
    if kind == "qwen3":
        out["architectures"] = ["Qwen3ForCausalLM"]
    if kind == "qwen3_moe":
        out |= {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.router.top_k,
                "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim}
    if kind == "deepseek_v3":
        first_moe = next(i for i, layer in enumerate(config.layers) if layer.moe is not None)
        shared = moe.shared_experts
        out |= {
            "architectures": ["DeepseekV3ForCausalLM"],
            "num_key_value_heads": attn.n_heads,
            "q_lora_rank": attn.q_lora_rank or None,
            "kv_lora_rank": attn.kv_lora_rank,
            "qk_nope_head_dim": attn.qk_nope_head_dim,
            "qk_rope_head_dim": attn.qk_rope_head_dim,
            "v_head_dim": attn.v_head_dim,
            "head_dim": attn.qk_rope_head_dim,
            "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.router.top_k,
            "n_shared_experts": shared.w1.out_features // moe.routed_experts.inner_experts.hidden_dim,
            "moe_intermediate_size": moe.routed_experts.inner_experts.hidden_dim,
            "intermediate_size": state["layers.0.feed_forward.w1.weight"].shape[0],
            "first_k_dense_replace": first_moe,
            "num_nextn_predict_layers": len(getattr(config, "mtp_layers", None) or []),
            "rope_interleave": True,
        }
    return out


# ---------------------------------------------------------------------------
# Building, saving, reading
# ---------------------------------------------------------------------------


@dataclass
class Built:
    config: object  # torchtitan model config
    state: dict  # torchtitan names -> tensor (seeded random values)
    hf_config: dict
    config_dir: Path  # holds config.json
    dcp: Path  # the state saved by torch.distributed.checkpoint


def torchtitan_state(config, dtype: torch.dtype, seed: int) -> dict:
    """The model's state dict with its names and shapes (built on meta: no init cost), random values."""
    with torch.device("meta"):
        model = config.build()
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, (shape, meta_dtype) in shapes.items():
        floating = meta_dtype.is_floating_point
        value = torch.randn(shape, generator=gen) if floating else torch.randint(0, 100, shape, generator=gen)
        state[name] = value.to(dtype if floating else meta_dtype)
    if config.enable_weight_tying:  # one parameter under two names, as the tied model's state_dict has it
        state["lm_head.weight"] = state["tok_embeddings.weight"]
    return state


def adapter_for(case: Case, built: Built):
    """A fresh torchtitan adapter (offline conversion: no hf_assets_path)."""
    return case.adapter(built.config, None)


def dropped_by_torchtitan(case: Case, built: Built) -> list[str]:
    """The torchtitan keys that to_hf turns into nothing (its adapters convert key by key)."""
    return [key for key, value in built.state.items() if not adapter_for(case, built).to_hf({key: value})]


def detached(state: dict) -> dict:
    """Contiguous, storage-owning copies (safetensors refuses shared storage, e.g. split expert views)."""
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def read_safetensors(folder: Path) -> dict:
    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors in {folder}"
    out = {}
    for file in files:
        part = load_file(file)
        assert not set(part) & set(out), f"{file.name} repeats keys"
        out |= part
    return out


def differences(actual: dict, expected: dict) -> list[str]:
    """Every way ``actual`` is not ``expected``: missing and extra keys, dtype, shape, values (bitwise)."""
    lines = [f"missing: {k}" for k in sorted(set(expected) - set(actual))]
    lines += [f"extra: {k} {tuple(actual[k].shape)}" for k in sorted(set(actual) - set(expected))]
    for key in sorted(set(actual) & set(expected)):
        a, e = actual[key], expected[key]
        if a.dtype != e.dtype or a.shape != e.shape:
            lines.append(f"{key}: {a.dtype} {tuple(a.shape)}, torchtitan {e.dtype} {tuple(e.shape)}")
        elif not torch.equal(a, e):
            lines.append(f"{key}: values differ ({(a != e).sum().item()} of {e.numel()} elements)")
    return lines


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Lazily made, once per case: the torchtitan state, its config.json folder and its DCP."""
    made = {}

    def get(name: str) -> Built:
        if name not in made:
            case = CASES[name]
            root = tmp_path_factory.mktemp("tt")  # neutral folder names: no kind or family in paths
            config = case.make()
            state = torchtitan_state(config, case.dtype, seed=zlib.crc32(name.encode()))
            cfg = hf_config(case.kind, config, state)
            (root / "cfg").mkdir()
            (root / "cfg" / "config.json").write_text(json.dumps(cfg, indent=2))
            dcp.save(state, checkpoint_id=root / "dcp", no_dist=True)
            made[name] = Built(config, state, cfg, root / "cfg", root / "dcp")
        return made[name]

    return get


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_export_hf_matches_torchtitan_to_hf(built, name, tmp_path):
    case, b = CASES[name], built(name)
    expected = adapter_for(case, b).to_hf(dict(b.state))
    result = dcptool("export-hf", b.dcp, tmp_path / "o", "--config-dir", b.config_dir, check=False)
    assert result.returncode == 0, f"export-hf exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    output = result.stdout + result.stderr
    # --adapter auto found torchtitan 0.3's names and the config's kind.
    assert f"names: torchtitan ({case.kind}), written as hf" in output
    assert differences(read_safetensors(tmp_path / "o"), expected) == []
    # What torchtitan's to_hf leaves out (qwen3_moe's expert_bias_E, a tied lm_head) dcptool leaves
    # out too, above, and says so.
    for key in dropped_by_torchtitan(case, b):
        assert re.search(rf"left out {re.escape(key)}\b", output), f"no note for {key}:\n{output}"


@pytest.mark.parametrize("name", list(CASES))
def test_import_hf_matches_torchtitan_from_hf(built, name, tmp_path):
    case, b = CASES[name], built(name)
    hf_state = detached(adapter_for(case, b).to_hf(dict(b.state)))
    hf = tmp_path / "h"
    hf.mkdir()
    save_file(hf_state, hf / "model.safetensors", metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(b.hf_config, indent=2))
    expected = adapter_for(case, b).from_hf(dict(hf_state))
    result = dcptool("import-hf", hf, tmp_path / "d", "--adapter", "torchtitan", check=False)
    assert result.returncode == 0, f"import-hf exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert differences(read_dcp(tmp_path / "d", tmp_path), expected) == []


@pytest.mark.parametrize("name", list(CASES))
def test_torchtitan_round_trip_is_identity(built, name):
    """The oracle's own sanity: from_hf(to_hf(state)) is the state (so both directions above test
    something), except what torchtitan's HF names have no place for."""
    case, b = CASES[name], built(name)
    back = adapter_for(case, b).from_hf(detached(adapter_for(case, b).to_hf(dict(b.state))))
    dropped = set(dropped_by_torchtitan(case, b))
    if case.kind == "qwen3_moe":  # HF's Qwen3-MoE has no load-balancing bias
        assert dropped == {k for k in b.state if re.fullmatch(r"layers\.\d+\.moe\.expert_bias_E", k)}
    elif b.config.enable_weight_tying:  # HF saves no lm_head; from_hf copies the embedding back
        assert dropped == {"lm_head.weight"}
    else:
        assert dropped == set()
    restored = {"lm_head.weight"} if b.config.enable_weight_tying else set()
    assert differences(back, {k: v for k, v in b.state.items() if k not in dropped - restored}) == []
