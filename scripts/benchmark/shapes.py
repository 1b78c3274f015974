"""The checkpoints' models as sizes and names, without torch: a Llama-like dense model (Hugging Face names)
and a Qwen3-MoE-like one (AReaL Archon / torchtitan names) sized to a target, their config dicts for the
test harness's model builders, and the size arithmetic of the bench's options."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


def parse_size(text: str) -> int:
    """``2GB`` (10**9), ``512MB``, ``1GiB`` (2**30) or a number of bytes: dcptool's own size rule."""
    from dcptool.errors import UsageError
    from dcptool.sizes import parse_size as parse_bytes

    try:
        return parse_bytes(text, "size")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def human(n: float) -> str:
    """A size in the bench's names: ``2GB``, ``512MB``, ``40KB``, ``7B`` (powers of 10)."""
    for unit, div in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{int(n)}B"


HIDDEN_LADDER = (64, 128, 256, 512, 1024, 2048, 4096)


def round_up(x: float, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return int(math.ceil(x / m) * m)


@dataclass
class Shape:
    """A Llama-like (dense, HF names) or Qwen3-MoE-like (moe, AReaL Archon / torchtitan names) transformer;
    every TP-split dim divisible by 4.

    moe: the first ``dense_layers`` layers have a dense FFN (``feed_forward.w1/w2/w3``); the others a
    router (``moe.router.gate``), routed experts grouped as ``[experts, out, in]`` (``moe.experts.w1/w2/w3``)
    and the load-balancing ``moe.expert_bias`` buffer (f32), and no shared expert: Qwen3-MoE has none,
    so ``dcptool export-hf`` maps every name to Hugging Face's (``expert_bias`` is left out with a note).
    """

    model: str
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    heads: int
    kv_heads: int
    experts: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 1  # moe: the first layers have a dense FFN

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(key, shape, dtype) of every state-dict entry, in the names the saving job uses."""
        H, V, I, kv = self.hidden, self.vocab, self.intermediate, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...], str]] = []
        if self.model == "dense":
            out.append(("model.embed_tokens.weight", (V, H), "bf16"))
            for i in range(self.layers):
                p = f"model.layers.{i}."
                out += [(p + "self_attn.q_proj.weight", (H, H), "bf16"),
                        (p + "self_attn.k_proj.weight", (kv, H), "bf16"),
                        (p + "self_attn.v_proj.weight", (kv, H), "bf16"),
                        (p + "self_attn.o_proj.weight", (H, H), "bf16"),
                        (p + "mlp.gate_proj.weight", (I, H), "bf16"),
                        (p + "mlp.up_proj.weight", (I, H), "bf16"),
                        (p + "mlp.down_proj.weight", (H, I), "bf16"),
                        (p + "input_layernorm.weight", (H,), "bf16"),
                        (p + "post_attention_layernorm.weight", (H,), "bf16")]
            out += [("model.norm.weight", (H,), "bf16"), ("lm_head.weight", (V, H), "bf16")]
            return out
        E, M = self.experts, self.moe_intermediate
        out.append(("tok_embeddings.weight", (V, H), "bf16"))
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "attention.wq.weight", (H, H), "bf16"),
                    (p + "attention.wk.weight", (kv, H), "bf16"),
                    (p + "attention.wv.weight", (kv, H), "bf16"),
                    (p + "attention.wo.weight", (H, H), "bf16"),
                    (p + "attention_norm.weight", (H,), "bf16"),
                    (p + "ffn_norm.weight", (H,), "bf16")]
            if i < self.dense_layers:
                out += [(p + "feed_forward.w1.weight", (I, H), "bf16"),
                        (p + "feed_forward.w2.weight", (H, I), "bf16"),
                        (p + "feed_forward.w3.weight", (I, H), "bf16")]
            else:
                out += [(p + "moe.router.gate.weight", (E, H), "bf16"),
                        (p + "moe.experts.w1", (E, M, H), "bf16"),
                        (p + "moe.experts.w2", (E, H, M), "bf16"),
                        (p + "moe.experts.w3", (E, M, H), "bf16"),
                        (p + "moe.expert_bias", (E,), "f32")]
        out += [("norm.weight", (H,), "bf16"), ("output.weight", (V, H), "bf16")]
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor."""
        return sum(math.prod(s) * (4 if d == "f32" else 2) for _, s, d in self.tensors())

    def describe(self) -> str:
        """One line for the report: the sizes, the tensor count and the bytes."""
        text = (f"{self.model}: {self.layers} layers, hidden {self.hidden}, intermediate "
                f"{self.intermediate}, vocab {self.vocab}, heads {self.heads}/{self.kv_heads} kv")
        if self.model == "moe":
            text += (f", {self.experts} experts of {self.moe_intermediate} (no shared expert), "
                     f"{self.dense_layers} dense layer")
        return text + f"; {len(self.tensors())} tensors, {human(self.nbytes())} bf16"


def make_shape(model: str, hidden: int, layers: int) -> Shape:
    """The model of ``hidden`` and ``layers``, the other sizes in the proportions of Llama-like models."""
    heads = max(4, hidden // 64)
    return Shape(model=model, hidden=hidden, layers=layers,
                 vocab=round_up(min(32000, 16 * hidden), 64),
                 intermediate=round_up(8 * hidden / 3, 64), heads=heads,
                 kv_heads=max(4, heads // 4),
                 experts=8 if model == "moe" else 0,
                 moe_intermediate=round_up(4 * hidden / 3, 64) if model == "moe" else 0)


def choose_shape(model: str, target: int, max_hidden: int = 2048) -> Shape:
    """The widest model (hidden <= max_hidden) with at least 2 layers near ``target`` bytes."""
    best = None
    for hidden in HIDDEN_LADDER:
        if hidden > max_hidden:
            break
        base = make_shape(model, hidden, 2).nbytes()
        per_layer = make_shape(model, hidden, 3).nbytes() - base
        layers = 2 + round((target - base) / per_layer)
        if layers >= 2 or best is None:
            best = make_shape(model, hidden, max(2, layers))
    return best


def inspect_shape(tensors: int) -> Shape:
    """A tiny dense model with about ``tensors`` tensors (9 per layer + 3)."""
    return make_shape("dense", 64, max(1, round((tensors - 3) / 9)))


def llama_config(shape: Shape) -> dict:
    """The Hugging Face config.json of a dense shape (export-hf checks it against the tensors)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
            "torch_dtype": "bfloat16"}


def moe_config(shape: Shape) -> dict:
    """The sizes of a moe shape in the fields of the test harness's MoE (``harness.models.TINY_MOE``)."""
    return {"vocab_size": shape.vocab, "dim": shape.hidden, "n_layers": shape.layers,
            "n_dense_layers": shape.dense_layers, "n_heads": shape.heads, "n_kv_heads": shape.kv_heads,
            "ffn_hidden_dim": shape.intermediate, "moe_hidden_dim": shape.moe_intermediate,
            "num_experts": shape.experts, "num_shared_experts": 0}
