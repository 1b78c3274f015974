"""A tiny transformers DeepSeek-V3 as a Megatron-Core GPTModel: its config, its layer specs and its weights
by the keys Megatron's ``dist_checkpointing`` saves.

Written for the tests from megatron-core 0.19's own modules, never importing dcptool, so the tests can hold
dcptool's DeepSeek table against it:

* ``MLATransformerConfig`` and the local layer spec with ``multi_latent_attention=True``
  (``multi_latent_attention.py``): ``linear_q_down_proj`` (HF ``q_a_proj``), ``q_layernorm``
  (``q_a_layernorm``), ``linear_q_up_proj`` (``q_b_proj``: per head nope then rope rows, as HF),
  ``linear_kv_down_proj`` (``kv_a_proj_with_mqa``: kv latent then the shared rope rows, as HF),
  ``kv_layernorm``, ``linear_kv_up_proj`` (``kv_b_proj``: per head k nope then v rows, as HF),
  ``linear_proj`` (``o_proj``). The MLA spec has no ``sharded_state_dict_keys_map``: ``input_layernorm`` and
  ``pre_mlp_layernorm`` are saved by those names. Megatron's MLA RoPE takes the rope dims' even then odd
  elements apart (``rope_utils``, ``multi_latent_attention=True``), as HF's ``rope_interleave`` does: the
  rows are copied as they are.
* ``get_gpt_decoder_block_spec`` with ``moe_layer_freq`` [0] x ``first_k_dense_replace`` + [1] x the rest:
  a list makes the layers non-homogeneous, so ``TransformerBlock`` saves ``decoder.layers.{i}.X`` per layer
  (experts still ``[E, ...]``: ``mlp.experts.experts.linear_fc1.weight``).
* MoE: the sigmoid router with its expert bias (``mlp.router.weight``, ``mlp.router.expert_bias``: HF's
  ``gate.weight``, ``gate.e_score_correction_bias``), top-k probabilities normalised and scaled by
  ``moe_router_topk_scaling_factor`` (HF's ``norm_topk_prob``, ``routed_scaling_factor``), the shared
  expert (``mlp.shared_experts.linear_fc1`` = [gate; up]).
* Multi-token prediction (``multi_token_prediction.py``, ``mtp_num_layers``): layer n of it is saved as
  ``mtp.layers.{n}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` and ``mtp.layers.{n}.transformer_layer.X``
  (its ``mtp_model_layer``, renamed for old checkpoints), the layer the last decoder layer's spec builds.
  It concatenates [enorm(embedding); hnorm(hidden)] before ``eh_proj``, as DeepSeek's own MTP module does,
  so ``eh_proj`` is HF's as it is; ``final_layernorm`` is HF's ``shared_head.norm``. HF's layer also repeats
  the embedding and the head (``embed_tokens``, ``shared_head.head``): Megatron shares its main ones.

transformers does not run DeepSeek's prediction layers: ``mtp_hf_weights`` adds random ones to a saved
model, in DeepSeek's released names (``model.layers.{L+n}.*``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from harness.megatron_weights import (CPU_RUN, SIGMOID_MOE, rope_theta, routed_and_shared, swiglu_rows,
                                     vocab_padded)

MLA = {"linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm", "linear_q_up_proj": "q_b_proj",
       "linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
       "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
# A prediction layer's own modules: Megatron name -> HF name in model.layers.{L+n}.
MTP_OWN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "shared_head.norm"}


def moe_pattern(config: dict) -> list[int]:
    """Megatron's ``moe_layer_freq`` list of an HF config: 0 for the dense first layers, 1 for MoE ones."""
    dense = config.get("first_k_dense_replace", 0)
    return [0 if layer < dense else 1 for layer in range(config["num_hidden_layers"])]


def transformer_config(config: dict, mtp_layers: int = 0, **parallel) -> Any:
    """Megatron's MLATransformerConfig of an HF DeepSeek-V3 config (n_group = topk_group = 1, plain RoPE:
    Megatron's group-limited routing and YaRN are not compared here). ``parallel``:
    tensor/pipeline/expert_model_parallel_size."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    assert config.get("n_group", 1) == 1 and config.get("topk_group", 1) == 1, "group-limited routing"
    assert not (config.get("rope_scaling") or {}).get("type"), "YaRN"
    assert config.get("rope_interleave", True), "Megatron's MLA RoPE is HF's rope_interleave"
    return MLATransformerConfig(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"], ffn_hidden_size=config["intermediate_size"],
        q_lora_rank=config["q_lora_rank"], kv_lora_rank=config["kv_lora_rank"],
        qk_head_dim=config["qk_nope_head_dim"], qk_pos_emb_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"], rope_type="rope", rotary_base=rope_theta(config), qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=config["rms_norm_eps"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        num_moe_experts=config["n_routed_experts"], moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=config["moe_intermediate_size"] * config["n_shared_experts"],
        moe_layer_freq=moe_pattern(config), moe_router_topk=config["num_experts_per_tok"],
        moe_router_topk_scaling_factor=config["routed_scaling_factor"], mtp_num_layers=mtp_layers or None,
        pipeline_dtype=torch.float32, **SIGMOID_MOE, **CPU_RUN, **parallel)


class CoreAttention(torch.nn.Module):
    """Softmax attention over heads of query/key size ``k_channels`` and value size ``v_channels``, as
    Megatron's unfused ``DotProductAttention`` computes it: MLA's core attention on CPU. Megatron's local
    DotProductAttention takes no ``k_channels`` / ``v_channels`` (MLA runs on Transformer Engine's or flash
    attention, neither on CPU); it has no parameters, so the saved keys do not depend on it."""

    def __init__(self, config, softmax_scale: float, **_):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        # [seq, batch, heads, dim] in; [seq, batch, heads x v dim] out; attention_mask True where masked
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
        scores = scores.masked_fill(attention_mask, float("-inf"))
        context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
        return context.reshape(*context.shape[:2], -1)


def gpt_model(config: dict, vocab_rows: int, mtp_layers: int = 0, **parallel) -> Any:
    """The GPTModel of an HF DeepSeek-V3 config (local specs: dense first layers, MoE after, prediction
    layers), its vocabulary ``vocab_rows``; megatron's model-parallel state must be initialised."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    transformer = transformer_config(config, mtp_layers, **parallel)
    block = get_gpt_decoder_block_spec(transformer, use_transformer_engine=False, normalization="RMSNorm")
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    mtp = get_gpt_mtp_block_spec(transformer, block, use_transformer_engine=False) if mtp_layers else None
    return GPTModel(transformer, block, vocab_size=vocab_rows, max_sequence_length=config["max_position_embeddings"],
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
                    position_embedding_type="rope", mtp_block_spec=mtp)


def _layer(hf: dict[str, torch.Tensor], src: str, dst: str, experts: int) -> dict[str, torch.Tensor]:
    """One decoder layer's torch_dist tensors (``dst`` + name) from HF's (``src`` + name)."""
    out = {dst + "input_layernorm.weight": hf[src + "input_layernorm.weight"],
           dst + "pre_mlp_layernorm.weight": hf[src + "post_attention_layernorm.weight"]}
    for megatron, name in MLA.items():
        out[f"{dst}self_attention.{megatron}.weight"] = hf[f"{src}self_attn.{name}.weight"]

    mlp = src + "mlp."
    if mlp + "gate.weight" not in hf:
        out[dst + "mlp.linear_fc1.weight"] = swiglu_rows(hf, mlp)
        out[dst + "mlp.linear_fc2.weight"] = hf[mlp + "down_proj.weight"]
        return out
    return out | routed_and_shared(hf, mlp, dst, experts)


def checkpoint_weights(hf: dict[str, torch.Tensor], config: dict, vocab_rows: int,
                       mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """Every global tensor a torch_dist save of the GPTModel holds, by its key, from an HF state dict (the
    vocabulary rows past ``vocab_size`` zero)."""
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    out = {"embedding.word_embeddings.weight": vocab_padded(hf["model.embed_tokens.weight"], vocab_rows),
           "decoder.final_layernorm.weight": hf["model.norm.weight"],
           "output_layer.weight": vocab_padded(hf["lm_head.weight"], vocab_rows)}
    for layer in range(layers):
        out.update(_layer(hf, f"model.layers.{layer}.", f"decoder.layers.{layer}.", experts))
    for n in range(mtp_layers):
        src, dst = f"model.layers.{layers + n}.", f"mtp.layers.{n}."
        out.update(_layer(hf, src, dst + "transformer_layer.", experts))
        out.update({f"{dst}{megatron}.weight": hf[f"{src}{name}.weight"] for megatron, name in MTP_OWN.items()})
    return out


def mtp_hf_weights(hf: dict[str, torch.Tensor], config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random prediction layers in DeepSeek's released names, after the main layers: a MoE layer's own
    weights (shaped as the last main layer's), enorm, hnorm, eh_proj [hidden, 2 x hidden], shared_head.norm,
    and the copies of the embedding and head HF's layer repeats."""
    gen = torch.Generator().manual_seed(seed)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{layers - 1}."
    out = {}
    for n in range(config.get("num_nextn_predict_layers", 0)):
        dst = f"model.layers.{layers + n}."
        shapes = {name.removeprefix(last): tensor.shape for name, tensor in hf.items() if name.startswith(last)}
        shapes.update({"enorm.weight": (hidden,), "hnorm.weight": (hidden,), "eh_proj.weight": (hidden, 2 * hidden),
                       "shared_head.norm.weight": (hidden,)})
        for name, shape in shapes.items():
            values = 0.05 * torch.randn(shape, generator=gen)
            out[dst + name] = values + 1.0 if name.endswith("norm.weight") else values
        out[dst + "embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
        out[dst + "shared_head.head.weight"] = hf["lm_head.weight"].clone()
    return out


def save_hf_with_mtp(folder: Path, seed: int, kind: str = "deepseek_v3", **overrides) -> Path:
    """harness.family_models' tiny DeepSeek-V3 (``save_hf``; or ``kind``, GLM-4.5's release lays its prediction
    layers out the same), its safetensors file given the prediction layers of ``num_nextn_predict_layers``
    (transformers builds none)."""
    from safetensors.torch import save_file

    from harness.family_models import load_hf_state, read_config, save_hf

    save_hf(kind, folder, seed=seed, **overrides)
    state = load_hf_state(folder)
    state.update(mtp_hf_weights(state, read_config(folder), seed + 1))
    for file in folder.glob("*.safetensors"):
        file.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def main_and_mtp_logits(folder: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of an HF folder's main model and of its first prediction layer for ``tokens``:
    ``MtpModel``, which reads the layer after the main ones in DeepSeek-V3's (and GLM-4.5's) released names for
    speculative decoding. It finds that layer by the released models' layer numbers (61; 46, 92), so it is told
    the tiny model's. Position i of the prediction predicts token i + 2 from token i + 1 and the main model's last
    hidden state i (Megatron's convention too)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    layer = model.config.num_hidden_layers
    with mock.patch.object(MtpModel, "get_mtp_weights_regex", staticmethod(
            lambda main: re.compile(rf"^model\.layers\.{layer}\."))):
        mtp = MtpModel.from_pretrained(model).eval()
    positions = torch.arange(1, tokens.shape[1]).expand(tokens.shape[0], -1)
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state[:, :-1]
        predicted = mtp._project_to_logits(mtp.forward_layer(0, hidden, positions, None, input_ids=tokens[:, 1:]))
        return model(tokens).logits, predicted
