"""The models the jobs train and save and the bench sizes up, and the step the jobs take.

* ``build_model``: a tiny transformers Llama (HF names), trained for real by the jobs.
* ``llama_skeleton``: the same state dict (HF names) as plain modules of parameters only, from the
  fields of a config.json: what the bench saves at sizes where transformers would only cost time.
* ``MoeTransformer``: a torchtitan-style MoE (torchtitan / AReaL Archon names), parameters only:
  grouped routed experts, an optional shared expert, the f32 ``expert_bias`` buffer.
* ``empty_model``: either of the last two on the meta device, to be sharded and then given storage.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from torch import nn

# The "tiny" Llama.  vocab_size=250 is deliberately not divisible by 4, so
# FSDP shards of embed_tokens / lm_head are uneven (torch.chunk: dp=4 gives
# 63, 63, 63, 61 rows; dp=2 over tp=2 gives 63 + 62 of each 125-row TP shard).
TINY_LLAMA = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "vocab_size": 250,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
PRESETS = {"tiny": TINY_LLAMA}

# The tiny torchtitan-style MoE transformer (``--model moe``): layers below
# n_dense_layers have a dense FFN, the others an MoE with grouped experts and
# (num_shared_experts > 0) a shared expert.  Every TP-sharded dim (vocab, dim,
# heads, ffn and expert hidden dims) is divisible by 4, so tp=4 works; ep can be 2 or 4.
TINY_MOE = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_dense_layers": 1,
    "n_heads": 4,
    "n_kv_heads": 4,
    "ffn_hidden_dim": 96,
    "moe_hidden_dim": 32,
    "num_experts": 4,
    "num_shared_experts": 1,
}
MODELS = ("llama", "moe")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# Seeds.  The saver builds the model from MODEL_SEED.  Loaders build it from a
# different seed, so a load that silently does nothing cannot pass the check.
MODEL_SEED = 0
LOADER_SEED = 1234
DATA_SEED = 1000

BATCH_SIZE = 2
SEQ_LEN = 16
LR = 1e-2


# ---------------------------------------------------------------------------
# The Llama: transformers' (trained) and a skeleton of the same names (sized)
# ---------------------------------------------------------------------------


def load_model_config(spec: str | None):
    """Build a ``LlamaConfig`` from a preset name, a JSON string or a path.

    The JSON (inline or a config.json file) overrides the "tiny" preset, so
    ``'{"hidden_size": 512, "intermediate_size": 1408}'`` is enough to make a
    bigger model.  Attention is forced to "eager" (pure PyTorch, identical on
    every rank and happy with TP-local head counts).
    """
    from transformers import LlamaConfig

    fields = dict(TINY_LLAMA)
    if spec and spec in PRESETS:
        fields = dict(PRESETS[spec])
    elif spec and Path(spec).is_file():
        fields.update(json.loads(Path(spec).read_text()))
    elif spec:
        fields.update(json.loads(spec))
    # Keys that a saved config.json carries but LlamaConfig should not get back.
    for key in ("architectures", "model_type", "transformers_version", "_attn_implementation"):
        fields.pop(key, None)
    fields["attn_implementation"] = "eager"
    return LlamaConfig(**fields)


def build_model(config, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Identical, deterministic model on every rank (CPU, before sharding)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    random.seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(dtype)


def holder(**children: nn.Module) -> nn.Module:
    """A module that only holds ``children`` under their names (the names make the state dict)."""
    module = nn.Module()
    for name, child in children.items():
        module.add_module(name, child)
    return module


def linear(inputs: int, outputs: int) -> nn.Linear:
    """A projection without bias, as every weight of these models is."""
    return nn.Linear(inputs, outputs, bias=False)


def llama_skeleton(config: dict) -> nn.Module:
    """A Llama of parameters only under Hugging Face's names (``LlamaForCausalLM``'s state dict without
    transformers) from the fields of its config.json; never run forward."""
    hidden, vocab, intermediate = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    query, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layers = nn.ModuleList(holder(
        self_attn=holder(q_proj=linear(hidden, query), k_proj=linear(hidden, kv), v_proj=linear(hidden, kv),
                         o_proj=linear(query, hidden)),
        mlp=holder(gate_proj=linear(hidden, intermediate), up_proj=linear(hidden, intermediate),
                   down_proj=linear(intermediate, hidden)),
        input_layernorm=nn.RMSNorm(hidden), post_attention_layernorm=nn.RMSNorm(hidden),
    ) for _ in range(config["num_hidden_layers"]))
    return holder(model=holder(embed_tokens=nn.Embedding(vocab, hidden), layers=layers, norm=nn.RMSNorm(hidden)),
                  lm_head=linear(hidden, vocab))


# ---------------------------------------------------------------------------
# The MoE model (torchtitan / AReaL Archon parameter names)
# ---------------------------------------------------------------------------
#
# Parameters only: the jobs never run it forward (see synthetic_step), so the
# modules carry just what decides the state dict and its sharding.


def load_moe_config(spec: str | None) -> dict[str, int]:
    """TINY_MOE overridden by a JSON string or a config.json path."""
    fields = dict(TINY_MOE)
    if spec and Path(spec).is_file():
        fields.update(json.loads(Path(spec).read_text()))
    elif spec and spec not in PRESETS:  # "tiny" means TINY_MOE itself
        fields.update(json.loads(spec))
    fields.pop("model", None)  # the marker a reference's config.json carries
    return fields


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = linear(dim, hidden)
        self.w2 = linear(hidden, dim)
        self.w3 = linear(dim, hidden)


class GroupedExperts(nn.Module):
    """All routed experts' weights as 3-D parameters [experts, out, in]."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int) -> None:
        super().__init__()
        self.gate = linear(dim, num_experts)


class MoE(nn.Module):
    """Router, grouped experts and, as torchtitan sizes it, a shared expert of ``num_shared`` experts' width
    (none for 0: Qwen3-MoE has none)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, num_shared: int) -> None:
        super().__init__()
        self.router = Router(dim, num_experts)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_experts = FeedForward(dim, hidden * num_shared) if num_shared else None
        # Load-balancing bias: a persistent float32 buffer, as in torchtitan.
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        head_dim = dim // n_heads
        self.wq = linear(dim, n_heads * head_dim)
        self.wk = linear(dim, n_kv_heads * head_dim)
        self.wv = linear(dim, n_kv_heads * head_dim)
        self.wo = linear(n_heads * head_dim, dim)


class TransformerBlock(nn.Module):
    def __init__(self, config: dict[str, int], moe_enabled: bool) -> None:
        super().__init__()
        dim = config["dim"]
        self.moe_enabled = moe_enabled
        self.attention = Attention(dim, config["n_heads"], config["n_kv_heads"])
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        if moe_enabled:
            self.moe = MoE(dim, config["moe_hidden_dim"], config["num_experts"], config["num_shared_experts"])
        else:
            self.feed_forward = FeedForward(dim, config["ffn_hidden_dim"])


class MoeTransformer(nn.Module):
    def __init__(self, config: dict[str, int]) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config["vocab_size"], config["dim"])
        # A ModuleDict, as torchtitan uses, so the keys read "layers.<i>....".
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(config, moe_enabled=i >= config["n_dense_layers"])
            for i in range(config["n_layers"])
        })
        self.norm = nn.RMSNorm(config["dim"])
        self.output = linear(config["dim"], config["vocab_size"])


def build_moe_model(config: dict[str, int], dtype: torch.dtype, seed: int) -> MoeTransformer:
    """Identical model on every rank: every parameter and buffer drawn from ``seed``.

    Random normal everywhere (norm weights and expert_bias included), so a
    misplaced or permuted shard cannot go unnoticed.
    """
    model = MoeTransformer(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in [*model.named_parameters(), *model.named_buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    model.to(dtype)
    # expert_bias stays float32 whatever the parameter dtype (torchtitan).
    for block in model.layers.values():
        if block.moe_enabled:
            block.moe.expert_bias = block.moe.expert_bias.float()
    return model


def load_config(kind: str, spec: str | None):
    """A LlamaConfig for --model llama, a dict of sizes for --model moe."""
    return load_model_config(spec) if kind == "llama" else load_moe_config(spec)


def empty_model(kind: str, config: dict, dtype: torch.dtype) -> nn.Module:
    """``llama_skeleton`` (HF config fields) or ``MoeTransformer`` (TINY_MOE's fields) on the meta device,
    parameters in ``dtype`` (expert_bias stays float32): shard it, then ``to_empty`` gives each rank storage
    for its shards alone, with no initialization to pay for."""
    with torch.device("meta"):
        model = llama_skeleton(config) if kind == "llama" else MoeTransformer(config)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


# ---------------------------------------------------------------------------
# The training step
# ---------------------------------------------------------------------------


def training_batch(config, data_rank: int) -> torch.Tensor:
    """Deterministic token ids for one data-parallel rank (same for its TP peers)."""
    gen = torch.Generator().manual_seed(DATA_SEED + data_rank)
    return torch.randint(0, config.vocab_size, (BATCH_SIZE, SEQ_LEN), generator=gen)


def train_steps(model, optimizer, config, steps: int, data_rank: int) -> list[float]:
    """Real forward + backward + AdamW step(s); returns the losses.

    With TP the HF Llama attention still works on CPU: ColwiseParallel hands
    back local tensors, and LlamaAttention reshapes with ``-1`` heads, so each
    TP rank simply runs its local heads.  No synthetic gradients are needed
    (checked: dp=2,tp=2 reproduces the dp=2 losses over 3 steps to ~1e-6).
    """
    ids = training_batch(config, data_rank)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW over every parameter."""
    # foreach=False: the plain per-parameter loop, which handles DTensor
    # parameters on different meshes (TP'd vs. non-TP'd) without fuss.
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False)


def synthetic_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One real AdamW step on gradients made from the parameters themselves.

    The gradient is an elementwise function of each parameter, computed on the
    (sharded) DTensor, so it keeps the parameter's placements and needs no
    forward pass (the MoE experts under EP would need all-to-all routing).
    """
    for param in model.parameters():
        param.grad = torch.sin(3 * param.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
