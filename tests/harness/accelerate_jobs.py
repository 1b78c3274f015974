"""An HF Trainer / accelerate FSDP checkpoint folder from a real gloo job on CPU, for testing dcptool.

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 -m harness.accelerate_jobs \
        save OUT/checkpoint-2

A tiny transformers Llama is wrapped in FSDP1 (one unit per decoder layer), trained two steps and
saved with accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` under
``SHARDED_STATE_DICT`` (``pytorch_model_fsdp_0/``: DCP of ``{"model": ...}``; ``optimizer_0/``: DCP
of ``{"optimizer": FSDP.optim_state_dict(...)}``), plus what ``Trainer._save_checkpoint`` adds beside
them: ``scheduler.pt``, ``rng_state_{rank}.pth`` (python, numpy and cpu RNG states, as
``Trainer._save_rng_state`` writes them), ``trainer_state.json`` and the model's ``config.json``.
Rank 0 also writes ``OUT.full.pt``: the model's full state dict (FULL_STATE_DICT) and logits of a
fixed batch from the FSDP model, for the tests to hold the HF export against.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

CONFIG = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 61, "max_position_embeddings": 32, "tie_word_embeddings": False}
IDS = torch.arange(2 * 7).reshape(2, 7) % CONFIG["vocab_size"]


def job_save(out: Path) -> None:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    accelerator = Accelerator(cpu=True)  # joins torchrun's process group (gloo)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type="SHARDED_STATE_DICT")
    rank = accelerator.process_index
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, architectures=["LlamaForCausalLM"])  # as save_pretrained of the model records it
    model = FSDP(LlamaForCausalLM(config), auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                 use_orig_params=True, device_id=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        model(input_ids=IDS.chunk(dist.get_world_size())[rank]).logits.pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
    out.mkdir(parents=True, exist_ok=True)
    save_fsdp_model(plugin, accelerator, model, str(out))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(out))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(rng, out / f"rng_state_{rank}.pth")
    with torch.no_grad():
        logits = model(input_ids=IDS).logits  # every rank runs the forward: FSDP gathers the shards
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(scheduler.state_dict(), out / "scheduler.pt")
        (out / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
        config.save_pretrained(out)
        torch.save({"model": full, "logits": logits, "ids": IDS}, out.parent / f"{out.name}.full.pt")
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1] != "save":
        raise SystemExit(f"unknown job {sys.argv[1]!r}: save")
    job_save(Path(sys.argv[2]))
