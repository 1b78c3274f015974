"""Tiny transformers models of every adapter kind, and an independent oracle for the naming families.

The oracle (``hf_to_family`` / ``family_to_hf``) is written from the upstream
state-dict adapters' name tables (torchtitan ``models/*/state_dict_adapter.py``,
AReaL ``archon/*/model/state_dict_adapter.py``) with plain torch ops, and never
imports dcptool, so the tests can hold dcptool's adapters against it.

Families:
  hf          transformers' names, as ``save_pretrained`` writes them (experts one by one).
  archon      AReaL Archon = torchtitan's legacy names (``output.weight``, ``moe.experts.w1``).
  torchtitan  torchtitan 0.3 names (``qkv_linear.wq``, ``inner_experts.w1_EFD``, ``lm_head``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
FAMILIES = ("archon", "torchtitan")

_DENSE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    # Not a multiple of 4: FSDP shards of the embedding are uneven at dp=4.
    "vocab_size": 250,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}

# Model name -> (kind, config fields).  "qwen3_tied" is the tied-embeddings variant.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", _DENSE),
    "qwen2": ("qwen2", _DENSE),
    "qwen3": ("qwen3", _DENSE),
    "qwen3_tied": ("qwen3", {**_DENSE, "tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
    "deepseek_v3": ("deepseek_v3", {
        **{k: v for k, v in _DENSE.items() if k != "head_dim"},
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,  # layer 0 dense (feed_forward), layer 1 MoE
        "q_lora_rank": 32, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1,
        # transformers builds no prediction layers: its config's default of one would describe a layer the
        # saved model lacks (save_hf_with_mtp adds them, and sets the count)
        "num_nextn_predict_layers": 0,
    }),
}

# Kinds with no Archon or torchtitan model (HF and Megatron names only): kept out of MODELS, which the
# family tests run through.
HF_ONLY_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe": ("qwen2_moe", {**_DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1,
                                "mlp_only_layers": []}),
    # GLM-4.5's shape: head_dim apart from hidden / heads, RoPE on half of each head, q/k/v biases, q/k norms, a
    # dense first layer, then routed experts (a sigmoid router with its score bias, scaled) beside a shared one
    "glm4_moe": ("glm4_moe", {**_DENSE, "head_dim": 32, "attention_bias": True, "use_qk_norm": True,
                              "partial_rotary_factor": 0.5, "first_k_dense_replace": 1, "n_routed_experts": 4,
                              "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1, "topk_group": 1}),
    # GPT-OSS's shape (its bf16 layout): q/k/v/o biases, a sink per head, sliding windows of 4 tokens every other
    # layer, YaRN RoPE (its default: 32 x 4096 positions), every layer a MoE with a biased router and experts with biases
    "gpt_oss": ("gpt_oss", {**_DENSE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                            "sliding_window": 4, "max_position_embeddings": 4096 * 32}),
}

# Vision-language models (transformers' image-text-to-text classes: a language model and a vision tower), tiny:
# model_type -> config fields.
VL_MODELS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {"text_config": {**_DENSE, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
                   "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
                                     "out_hidden_size": 64, "fullatt_block_indexes": [1]},
                   "tie_word_embeddings": False},
    "qwen3_vl": {"text_config": {**_DENSE, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
                 "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
                                   "out_hidden_size": 64, "deepstack_visual_indexes": [0, 1],
                                   "num_position_embeddings": 64},
                 "tie_word_embeddings": False},
}

# ---------------------------------------------------------------------------
# Name tables: HF name (under model.layers.{i}. for layers) -> family name
# ---------------------------------------------------------------------------

_TOP = {
    "archon": {"model.embed_tokens.weight": "tok_embeddings.weight",
               "model.norm.weight": "norm.weight",
               "lm_head.weight": "output.weight"},
    "torchtitan": {"model.embed_tokens.weight": "tok_embeddings.weight",
                   "model.norm.weight": "norm.weight",
                   "lm_head.weight": "lm_head.weight"},
}

_LAYER_COMMON = {
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.gate.weight": "moe.router.gate.weight",
    "mlp.shared_experts.gate_proj.weight": "moe.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "moe.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "moe.shared_experts.w2.weight",
}

# DeepSeek-V3 multi-head latent attention: the same names in both families.
_MLA = {
    "self_attn.q_a_proj.weight": "attention.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attention.q_norm.weight",
    "self_attn.q_b_proj.weight": "attention.wq_b.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",  # q_lora_rank None
    "self_attn.kv_a_proj_with_mqa.weight": "attention.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attention.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attention.wkv_b.weight",
}

_QKV = {"archon": "attention.w{}", "torchtitan": "attention.qkv_linear.w{}"}

_EXPERT_BIAS = {"archon": "moe.expert_bias", "torchtitan": "moe.expert_bias_E"}

# HF per-expert projection -> stacked family tensor ([E, F, D] for w1/w3, [E, D, F] for w2).
_EXPERTS = {
    "archon": {"gate_proj": "moe.experts.w1", "up_proj": "moe.experts.w3",
               "down_proj": "moe.experts.w2"},
    "torchtitan": {"gate_proj": "moe.routed_experts.inner_experts.w1_EFD",
                   "up_proj": "moe.routed_experts.inner_experts.w3_EFD",
                   "down_proj": "moe.routed_experts.inner_experts.w2_EDF"},
}

_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_FAMILY_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _layer_table(kind: str, family: str) -> dict[str, str]:
    """HF layer suffix -> family layer suffix (plain renames; experts are stacked separately)."""
    table = dict(_LAYER_COMMON)
    if kind == "deepseek_v3":
        table.update(_MLA)
    else:
        for x in "qkv":
            table[f"self_attn.{x}_proj.weight"] = _QKV[family].format(x) + ".weight"
            table[f"self_attn.{x}_proj.bias"] = _QKV[family].format(x) + ".bias"
    if kind == "deepseek_v3":
        table["mlp.gate.e_score_correction_bias"] = _EXPERT_BIAS[family]
    return table


def _as_dict(config) -> dict[str, Any]:
    return config if isinstance(config, dict) else config.to_dict()


def _rope_heads(kind: str, config) -> dict[str, int]:
    """HF layer suffix -> heads of the Llama q/k weights that torchtitan RoPE-permutes (other kinds: none)."""
    if kind != "llama":
        return {}
    config = _as_dict(config)
    heads = config["num_attention_heads"]
    return {"self_attn.q_proj.weight": heads,
            "self_attn.k_proj.weight": config.get("num_key_value_heads") or heads}


def _head_dim(config) -> int:
    config = _as_dict(config)
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def permute_to_titan(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """HF (rotate_half halves) -> torchtitan (interleaved pairs) row order of a q or k weight."""
    return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)


def permute_to_hf(w: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """torchtitan -> HF row order of a q or k weight (the inverse of permute_to_titan)."""
    return w.view(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(heads * head_dim, -1)


def hf_to_family(state: dict[str, torch.Tensor], kind: str, family: str, config) -> dict[str, torch.Tensor]:
    """Rename (and stack, permute) an HF state dict into ``family``'s model state dict.

    Tied embeddings: the HF folder has no ``lm_head.weight``; the family keeps an
    output projection equal to the embedding, as Archon and torchtitan do.
    Raises KeyError on a name the tables do not know.
    """
    layer_table = _layer_table(kind, family)
    rope = _rope_heads(kind, config)
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if m := _HF_EXPERT.fullmatch(name):
            layer, expert, proj = m.groups()
            experts.setdefault((layer, proj), {})[int(expert)] = tensor
        elif m := _HF_LAYER.fullmatch(name):
            layer, suffix = m.groups()
            if suffix in rope:
                tensor = permute_to_titan(tensor, rope[suffix], _head_dim(config))
            out[f"layers.{layer}.{layer_table[suffix]}"] = tensor
        else:
            out[_TOP[family][name]] = tensor
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out[f"layers.{layer}.{_EXPERTS[family][proj]}"] = stacked
    output = _TOP[family]["lm_head.weight"]
    if output not in out and _as_dict(config).get("tie_word_embeddings"):
        out[output] = out["tok_embeddings.weight"].clone()
    return out


def family_to_hf(state: dict[str, torch.Tensor], kind: str, family: str, config) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_family: HF names as ``save_pretrained`` writes them.

    Drops what HF has no place for: the output projection of a tied model, and
    qwen3_moe's load-balancing ``expert_bias`` (DeepSeek-V3 maps it to
    ``e_score_correction_bias``).
    """
    layer_table = {v: k for k, v in _layer_table(kind, family).items()}
    top = {v: k for k, v in _TOP[family].items()}
    experts = {v: k for k, v in _EXPERTS[family].items()}
    rope = _rope_heads(kind, config)
    tied = _as_dict(config).get("tie_word_embeddings")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if m := _FAMILY_LAYER.fullmatch(name):
            layer, suffix = m.groups()
            if suffix in experts:
                for e, weight in enumerate(tensor.unbind(0)):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{experts[suffix]}.weight"] = weight.clone()
                continue
            if suffix == _EXPERT_BIAS[family] and kind == "qwen3_moe":
                continue
            hf_suffix = layer_table[suffix]
            if hf_suffix in rope:
                tensor = permute_to_hf(tensor, rope[hf_suffix], _head_dim(config))
            out[f"model.layers.{layer}.{hf_suffix}"] = tensor
        elif top[name] == "lm_head.weight" and tied:
            continue
        else:
            out[top[name]] = tensor
    return out


def training_extras(state: dict[str, torch.Tensor], kind: str, family: str, seed: int) -> dict[str, torch.Tensor]:
    """Model state a training run holds beside ``state`` (family names) with no HF counterpart:
    qwen3_moe's ``expert_bias`` per MoE layer (float32 [E], a persistent buffer that load
    balancing updates).  Nothing for the other kinds."""
    if kind != "qwen3_moe":
        return {}
    gen = torch.Generator().manual_seed(seed)
    w1 = _EXPERTS[family]["gate_proj"]
    return {name.replace(w1, _EXPERT_BIAS[family]): torch.randn(tensor.shape[0], generator=gen)
            for name, tensor in state.items() if name.endswith(w1)}


# ---------------------------------------------------------------------------
# Checkpoint layouts of the families
# ---------------------------------------------------------------------------

# Non-model entries of a torchtitan checkpoint (model keys sit at the top level).
TORCHTITAN_STATE = ("optimizer.", "train_state.", "lr_scheduler.", "dataloader.")


# Where each family's job keeps model and optimizer on disk: AReaL's save_to_dcp hands dcp.save
# {"dcp": DCPState}, whose state_dict is {"model": ..., "optim": ...}; torchtitan's CheckpointManager
# puts the model's keys at the top level beside "optimizer" (_flattened_model_states_sd).
MODEL_PREFIX = {"archon": "dcp.model.", "torchtitan": ""}
OPTIMIZER_PREFIX = {"archon": "dcp.optim.", "torchtitan": "optimizer."}


def model_part(flat: dict[str, Any], family: str) -> dict[str, Any]:
    """The model entries of a flattened family checkpoint, keyed by model fqn."""
    if family == "archon":
        return {k.removeprefix(MODEL_PREFIX[family]): v for k, v in flat.items() if k.startswith(MODEL_PREFIX[family])}
    return {k: v for k, v in flat.items() if not k.startswith(TORCHTITAN_STATE)}


def layout_keys(model_state: dict[str, Any], family: str) -> dict[str, Any]:
    """Model fqns -> the keys the family's checkpoint stores them under."""
    return {MODEL_PREFIX[family] + k: v for k, v in model_state.items()}


def optimizer_slots(flat: dict[str, Any], family: str) -> dict[str, dict[str, Any]]:
    """The flattened optimizer state of a family checkpoint by slot: ``{"exp_avg": {fqn: tensor}, ...}``."""
    start = OPTIMIZER_PREFIX[family] + "state."
    slots: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith(start):
            fqn, slot = key[len(start):].rsplit(".", 1)
            slots.setdefault(slot, {})[fqn] = value
    return slots


# ---------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------


def hf_config(name: str, **overrides):
    """The transformers config of a model name in MODELS (eager attention, float32), fields overridden."""
    from transformers import AutoConfig

    kind, fields = (MODELS | HF_ONLY_MODELS)[name]
    return AutoConfig.for_model(kind, **(fields | overrides), attn_implementation="eager")


def save_hf(name: str, folder: str | Path, seed: int = 0, **overrides) -> Path:
    """A random tiny model ``name`` (a kind, or a variant in MODELS, its config fields overridden) written
    with save_pretrained.

    Every parameter and persistent buffer is drawn from ``seed`` (norm weights
    around 1, biases and e_score_correction_bias random too), so a misplaced
    tensor cannot hide behind a constant initialisation.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name, **overrides)).float()
    randomize(model, seed)
    model.save_pretrained(folder)
    return Path(folder)


def randomize(model, seed: int) -> None:
    """Every parameter and persistent buffer of ``model`` drawn from ``seed``, norm weights around 1."""
    persistent = set(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor_name not in persistent:
                continue
            values = 0.05 * torch.randn(tensor.shape, generator=gen)
            tensor.copy_(values + 1.0 if tensor_name.endswith("norm.weight") else values)


def save_vl(kind: str, folder: str | Path, seed: int = 0) -> Path:
    """A random tiny vision-language model of VL_MODELS written with save_pretrained (which writes transformers
    v5's checkpoint names: ``visual.*`` and ``model.*`` for Qwen2.5-VL, whose model names them ``model.visual.*``
    and ``model.language_model.*``)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **VL_MODELS[kind])
    model = AutoModelForImageTextToText.from_config(config).float()
    randomize(model, seed)
    model.save_pretrained(folder)
    return Path(folder)


def load_hf_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files, by name."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(file))
    return state


def read_config(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "config.json").read_text())


def write_hf(state: dict[str, torch.Tensor], folder: str | Path, config_dir: str | Path) -> Path:
    """An HF folder from a state dict: one safetensors file plus ``config_dir``'s config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    (folder / "config.json").write_text((Path(config_dir) / "config.json").read_text())
    return folder


SAMPLE_IDS = torch.tensor([[3, 17, 42, 99, 7, 128, 200, 5, 61, 249, 0, 33]])


def logits(folder: str | Path) -> torch.Tensor:
    """transformers' float32 logits of ``from_pretrained(folder)`` on SAMPLE_IDS.

    The weights are first copied to fresh memory: from_pretrained leaves them in
    the safetensors mmap at whatever alignment the file header gives, and CPU
    kernels round differently on unaligned data, which would make equal weights
    give logits differing in the last bit.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
        return model(input_ids=SAMPLE_IDS).logits
