"""A real LoRA fine-tuning job: a tiny transformers Llama (and Qwen3-MoE) wrapped by peft, FSDP2 on gloo, AdamW, ``dcp.save``.

Run under torchrun from the repository root, with the tests folder on the path::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 -m harness.lora_jobs \
        save-lora /tmp/lora --variants lora,rslora_tied,dora

Each variant is one checkpoint ``OUT/<variant>``: ``{"model": get_model_state_dict(peft model), "optim":
get_optimizer_state_dict(...)}`` as an FSDP engine saves it (``--fsdp1 VARIANT``: also as verl's FSDP1 files), after a few AdamW steps on real losses so
``lora_B`` is not zero, with ``huggingface/config.json`` and ``huggingface/adapter_config.json`` beside
the weights (as verl keeps its config folder). Rank 0 writes ``OUT/<variant>.reference/``:

* ``base/``: the base model as a Hugging Face folder (what ``PeftModel.from_pretrained`` is given);
* ``peft.pt``: the gathered peft state dict; ``merged.pt``: peft's own ``merge_and_unload()`` of it;
* ``adapter/``: peft's ``save_pretrained`` of the trained adapter;
* ``inputs.pt`` and ``logits.pt``: token ids and the trained peft model's logits on them;
* ``optim.pt``: the gathered optimizer state.

``load-lora --ckpt CKPT VARIANT REFERENCE OPTIM`` (repeatable) builds the variant's peft model from another
seed, shards it with FSDP2 on this job's ranks, ``dcp.load``s CKPT into it as a resumed job does (OPTIM 1:
``{"model", "optim"}`` with the AdamW state; 0: the model's keys at the top level, as import-hf writes them)
and compares the gathered model (and optimizer) state bitwise with REFERENCE's ``peft.pt`` (and ``optim.pt``).
Exit status 0 means every comparison held.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from harness.runtime import Timer, exit_now, init_distributed, log, rank

MODEL_SEED, DATA_SEED, STEPS = 1234, 99, 3
VOCAB = 128

# name -> (config of the base model, the peft LoraConfig's settings)
VARIANTS = {
    # LoRA on attention, MLP and the embedding; the head trained whole (modules_to_save)
    "lora": ({"tie_word_embeddings": False},
             {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj", "embed_tokens"],
              "modules_to_save": ["lm_head"]}),
    # rsLoRA, tied embeddings with LoRA on the embedding (so on the head too, once merged)
    "rslora_tied": ({"tie_word_embeddings": True},
                    {"r": 8, "lora_alpha": 8, "use_rslora": True,
                     "target_modules": ["q_proj", "v_proj", "up_proj", "embed_tokens"]}),
    # DoRA on linear layers
    "dora": ({"tie_word_embeddings": False},
             {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]}),
    # Qwen3-MoE: transformers v5's fused experts [E, out, in] (gate_up_proj, down_proj) as target_parameters
    "qwen3_moe": ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                   "head_dim": 8, "tie_word_embeddings": False},
                  {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"],
                   "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}),
    # ~170 MB of float32 weights, for tests/test_memory.py (not made by default; no reference)
    "big": ({"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 6, "num_attention_heads": 12,
             "num_key_value_heads": 4, "tie_word_embeddings": False},
            {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}),
}
DEFAULT_VARIANTS = ["lora", "rslora_tied", "dora", "qwen3_moe"]


def base_config(settings: dict) -> transformers.PretrainedConfig:
    settings = dict(settings)
    kind = transformers.Qwen3MoeConfig if settings.pop("model_type", "llama") == "qwen3_moe" else transformers.LlamaConfig
    shape = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    return kind(**(shape | settings))


def causal_lm(settings: dict) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_config(base_config(settings))


def peft_model(variant: str) -> tuple[transformers.PreTrainedModel, peft.PeftModel]:
    """The base model (seeded) and the peft model around it; lora_B starts at zero, as peft makes it."""
    model_settings, lora_settings = VARIANTS[variant]
    torch.manual_seed(MODEL_SEED)
    base = causal_lm(model_settings)
    return base, peft.get_peft_model(base, peft.LoraConfig(**lora_settings))


def save_lora(out: Path, variant: str) -> None:
    timer = Timer()
    _, model = peft_model(variant)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(DATA_SEED + rank())
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    timer.mark("train")
    target = out / variant
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=target)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=whole)
    full_optim = get_optimizer_state_dict(model, optimizer, options=whole)
    timer.mark("dcp.save")
    if rank() == 0 and variant != "big":
        write_reference(target, variant, full)
        torch.save(full_optim, Path(f"{target}.reference") / "optim.pt")
    dist.barrier()
    timer.mark("reference")
    log(f"{variant}: {timer}")


def save_lora_fsdp1(out: Path, variant: str) -> None:
    """The same training under FSDP1, saved as verl's FSDPCheckpointManager saves it (harness.verl_jobs): each
    decoder layer a unit, verl's 1-D device mesh, ``use_orig_params`` (peft freezes the base weights), and per
    rank ``model_world_size_W_rank_r.pt`` of ``model.state_dict()`` under SHARDED_STATE_DICT, the optimizer
    state and the extra state; ``fsdp_config.json``; the reference as ``save_lora``'s, gathered with
    FULL_STATE_DICT."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from harness.verl_jobs import sharded

    world = dist.get_world_size()
    _, model = peft_model(variant)
    layer = type(model.base_model.model.model.layers[0])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({layer}), use_orig_params=True,
                 device_id=torch.device("cpu"), device_mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(DATA_SEED + rank())
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    target = out / f"{variant}-fsdp1"
    target.mkdir(parents=True, exist_ok=True)
    with sharded(model):
        torch.save(model.state_dict(), target / f"model_world_size_{world}_rank_{rank()}.pt")
        torch.save(optimizer.state_dict(), target / f"optim_world_size_{world}_rank_{rank()}.pt")
    torch.save({"lr_scheduler": None, "rng": {"cpu": torch.get_rng_state()}},
               target / f"extra_state_world_size_{world}_rank_{rank()}.pt")
    # offload_to_cpu=False: with the default, every moment of a parameter comes back in one shared buffer
    full_config = (FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                   FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *full_config):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        full_optim = FSDP.optim_state_dict(model, optimizer)
    if rank() == 0:
        (target / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": world}))
        write_reference(target, variant, full)
        torch.save(full_optim, Path(f"{target}.reference") / "optim.pt")
    dist.barrier()
    log(f"{variant} (FSDP1, verl's files) saved")


def write_reference(target: Path, variant: str, full: dict) -> None:
    """The oracles: peft's own view of the trained model, computed on one process from the gathered state."""
    reference = Path(f"{target}.reference")
    reference.mkdir(parents=True)
    torch.save(full, reference / "peft.pt")
    _, model = peft_model(variant)
    model.load_state_dict(full, strict=True)
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.save(ids, reference / "inputs.pt")
    torch.save(logits, reference / "logits.pt")
    model.save_pretrained(reference / "adapter")
    # The base folder: the weights before training (the same seed), which the adapter goes on.
    torch.manual_seed(MODEL_SEED)
    causal_lm(VARIANTS[variant][0]).save_pretrained(reference / "base")
    merged = model.merge_and_unload()
    torch.save({k: v.clone() for k, v in merged.state_dict().items()}, reference / "merged.pt")
    beside = target / "huggingface"
    beside.mkdir()
    (beside / "config.json").write_text((reference / "base" / "config.json").read_text())
    config = json.loads((reference / "adapter" / "adapter_config.json").read_text())
    (beside / "adapter_config.json").write_text(json.dumps(config, indent=2))


def load_lora(path: Path, variant: str, reference: Path, with_optim: bool) -> list[str]:
    """Load a checkpoint into a freshly built, sharded peft model; the differences from the reference."""
    torch.manual_seed(MODEL_SEED + 1)  # other base weights: the load must replace them all
    model = peft.get_peft_model(causal_lm(VARIANTS[variant][0]), peft.LoraConfig(**VARIANTS[variant][1]))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if with_optim:
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0 only
    gathered = get_model_state_dict(model, options=whole)
    gathered_optim = get_optimizer_state_dict(model, optimizer, options=whole) if with_optim else None
    if rank() != 0:
        return []
    problems = _differences(gathered, torch.load(reference / "peft.pt"), "model")
    if with_optim:
        problems += _differences(gathered_optim, torch.load(reference / "optim.pt"), "optim")
    return problems


def _differences(got, expected, at: str) -> list[str]:
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return [f"{at}: keys differ: {sorted(set(got) ^ set(expected), key=str)[:5] if isinstance(got, dict) else got}"]
        return [line for key in expected for line in _differences(got[key], expected[key], f"{at}.{key}")]
    if isinstance(expected, list):
        return [line for i, item in enumerate(expected) for line in _differences(got[i], item, f"{at}.{i}")]
    if isinstance(expected, torch.Tensor):
        return [] if isinstance(got, torch.Tensor) and torch.equal(got, expected) else [f"{at}: values differ"]
    return [] if got == expected else [f"{at}: {got!r} != {expected!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    save = sub.add_parser("save-lora")
    save.add_argument("out", type=Path)
    save.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    save.add_argument("--fsdp1", default="", help="variants also saved as verl's FSDP1 files (OUT/<variant>-fsdp1)")
    load = sub.add_parser("load-lora")
    load.add_argument("--ckpt", nargs=4, action="append", metavar=("CKPT", "VARIANT", "REFERENCE", "OPTIM"))
    args = parser.parse_args()
    init_distributed()
    if args.cmd == "save-lora":
        for variant in args.variants.split(","):
            save_lora(args.out, variant)
        for variant in filter(None, args.fsdp1.split(",")):
            save_lora_fsdp1(args.out, variant)
        exit_now(0)
    failed = False
    for path, variant, reference, optim in args.ckpt:
        problems = load_lora(Path(path), variant, Path(reference), optim == "1")
        log(f"{path}: " + ("; ".join(problems[:5]) if problems else "loaded, equal to the reference"))
        failed |= bool(problems)
    exit_now(1 if failed else 0)


if __name__ == "__main__":
    main()
