"""The torch side of the bench, each run as a process of its own: the saving job and the reshard peer (under
torchrun, building their models with the test harness's code), the FP8 source, and the peers: the routes
users take today."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmark.shapes import Shape, llama_config, moe_config

FP8_BLOCK = 128  # the block of the FP8 source's weight_scale_inv, as DeepSeek-V3 and Qwen3-FP8 ship it


def build_model(shape: Shape, dp: int, tp: int):
    """The model of ``shape`` as the test harness builds it (dense: ``llama_skeleton``, moe: ``MoeTransformer``
    without a shared expert), on the meta device, TP'd and FSDP2-sharded on (dp, tp) as the harness's jobs
    shard theirs, then given empty storage for this rank's shards."""
    import torch
    from harness.models import empty_model
    from harness.parallel import Parallel, parallelize

    kind, config = ("llama", llama_config(shape)) if shape.model == "dense" else ("moe", moe_config(shape))
    parallel = Parallel(dp_replicate=1, dp=dp, tp=tp, ep=1, etp=tp).build()
    model = parallelize(empty_model(kind, config, torch.bfloat16), kind, parallel)
    model.to_empty(device="cpu")
    return model


def fill(model, seed: int) -> None:
    """Random bf16 weights (uniform, cheap), norms 1, buffers 0; only the local shards are touched."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if "norm" in name:
                local.fill_(1.0)
            else:
                local.uniform_(-0.05, 0.05, generator=gen)
        for _, b in model.named_buffers():
            b.zero_()


def leave_job() -> None:
    """Wait for every rank, leave the process group and exit without the interpreter's teardown."""
    import torch.distributed as dist
    from harness.runtime import exit_now

    dist.barrier()
    dist.destroy_process_group()
    exit_now(0)


def worker_save(argv: list[str]) -> int:
    """``_save OUT SHAPE_JSON [OUT SHAPE_JSON ...] --dp N --tp N`` under torchrun. A shape's ``layout`` key
    says what is saved: ``model`` (default: dcp.save of the model), ``hf-dcp`` (HuggingFaceStorageWriter),
    ``zstd`` (FileSystemWriter with the ZStandard extension), ``accelerate`` (a Trainer's checkpoint-N
    folder) or ``optim`` (model and AdamW state)."""
    p = argparse.ArgumentParser(prog="bench.py _save")
    p.add_argument("pairs", nargs="+", help="OUT SHAPE_JSON pairs")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args(argv)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from harness.runtime import init_distributed
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    init_distributed()
    for out, spec in zip(args.pairs[::2], args.pairs[1::2]):
        t0 = time.perf_counter()
        spec = json.loads(spec)
        layout = spec.pop("layout", "model")
        shape = Shape(**spec)
        model = build_model(shape, args.dp, args.tp)
        fill(model, seed=1000 + dist.get_rank())
        t1 = time.perf_counter()
        if layout == "model":
            dcp.save(get_model_state_dict(model), checkpoint_id=out)
        elif layout == "hf-dcp":  # torch's HF-storage DCP, unconsolidated (every rank writes its chunks)
            from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

            dcp.save(get_model_state_dict(model), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        elif layout == "zstd":  # dcp.save with torch's zstd extension on every record
            from torch.distributed.checkpoint import FileSystemWriter
            from torch.distributed.checkpoint._extension import ZStandard

            dcp.save(get_model_state_dict(model), storage_writer=FileSystemWriter(out, _extensions=[ZStandard()]))
        elif layout == "accelerate":  # what accelerate's save_fsdp_model writes under SHARDED_STATE_DICT
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{out}/pytorch_model_fsdp_0")
            if dist.get_rank() == 0:
                (Path(out) / "config.json").write_text(json.dumps(llama_config(shape), indent=1))
                (Path(out) / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
        else:  # "optim": torchtitan's layout, model keys at the top and the AdamW state flattened under optimizer
            dcp.save(_with_adamw_state(model), checkpoint_id=out)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"saved {out}: build {t1 - t0:.1f}s, dcp.save {time.perf_counter() - t1:.1f}s", flush=True)
        del model
    leave_job()


def _with_adamw_state(model) -> dict:
    """Model and AdamW state after one step on zero gradients (moments exist, in the parameters' bf16)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    return {**model_sd, "optimizer": optim_sd}


def make_fp8(argv: list[str]) -> int:
    """``_fp8 OUT SHAPE_JSON``: a dense shape as DeepSeek-V3 / Qwen3-FP8 ship it: every 2-D projection
    ``float8_e4m3fn`` with a ``weight_scale_inv`` per 128 x 128 block (f32), embeddings, norms and the
    head bf16, files of up to 1 GB, an index and a config.json with ``quantization_config``."""
    import torch
    from safetensors.torch import save_file

    out, spec = argv
    shape = Shape(**json.loads(spec))
    folder = Path(out)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(7)
    files: list[dict] = [{}]
    weight_map, sizes = {}, [0]
    for name, dims, _ in shape.tensors():
        if len(dims) == 2 and "_proj." in name:  # what the FP8 releases quantize
            w = (torch.rand(dims, generator=gen) * 2 - 1).to(torch.float8_e4m3fn)
            blocks = (math.ceil(dims[0] / FP8_BLOCK), math.ceil(dims[1] / FP8_BLOCK))
            scale = torch.rand(blocks, generator=gen) * 1e-3 + 1e-4
            entries = {name: w, name + "_scale_inv": scale}
        else:
            entries = {name: torch.ones(dims, dtype=torch.bfloat16) if "norm" in name
                       else (torch.rand(dims, generator=gen) * 0.1 - 0.05).to(torch.bfloat16)}
        nbytes = sum(t.nbytes for t in entries.values())
        if sizes[-1] and sizes[-1] + nbytes > 10**9:
            files.append({})
            sizes.append(0)
        files[-1].update(entries)
        sizes[-1] += nbytes
    for i, tensors in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = llama_config(shape) | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                            "activation_scheme": "dynamic",
                                                            "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return 0


LORA_RANK, LORA_ALPHA = 16, 32


def make_lora(argv: list[str]) -> int:
    """``_lora OUT SHAPE_JSON``: a dense shape as an FSDP engine saves a peft model: ``dcp.save`` (one process) of
    ``{"model": ...}`` in peft's names, every 2-D projection a ``base_layer`` with LoRA r=16 (``lora_A`` [r, in],
    ``lora_B`` [out, r], bf16, B not zero as after training), and ``huggingface/`` with config.json and
    adapter_config.json (lora_alpha 32) beside it."""
    import torch
    import torch.distributed.checkpoint as dcp

    out, spec = argv
    shape = Shape(**json.loads(spec))
    folder = Path(out)
    gen = torch.Generator().manual_seed(11)
    model, targets = {}, set()
    for name, dims, _ in shape.tensors():
        value = (torch.ones(dims, dtype=torch.bfloat16) if "norm" in name
                 else (torch.rand(dims, generator=gen) * 0.1 - 0.05).to(torch.bfloat16))
        if len(dims) == 2 and "_proj." in name:
            module = "base_model.model." + name.removesuffix(".weight")
            model[f"{module}.base_layer.weight"] = value
            model[f"{module}.lora_A.default.weight"] = (torch.rand((LORA_RANK, dims[1]), generator=gen) * 0.02 - 0.01).to(torch.bfloat16)
            model[f"{module}.lora_B.default.weight"] = (torch.rand((dims[0], LORA_RANK), generator=gen) * 0.02 - 0.01).to(torch.bfloat16)
            targets.add(module.rsplit(".", 1)[-1])
        else:
            model["base_model.model." + name] = value
    dcp.save({"model": model}, checkpoint_id=folder, no_dist=True)
    beside = folder / "huggingface"
    beside.mkdir()
    (beside / "config.json").write_text(json.dumps(llama_config(shape), indent=1))
    (beside / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": sorted(targets),
         "use_rslora": False, "use_dora": False}, indent=1))
    return 0


def worker_reshard(argv: list[str]) -> int:
    """The peer of ``dcptool reshard``: ``_reshard SRC DST SHAPE_JSON --dp N --tp N`` under torchrun."""
    p = argparse.ArgumentParser(prog="bench.py _reshard")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("shape")
    p.add_argument("--dp", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    args = p.parse_args(argv)
    import torch.distributed.checkpoint as dcp
    from harness.runtime import init_distributed
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    init_distributed()
    model = build_model(Shape(**json.loads(args.shape)), args.dp, args.tp)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=args.src)
    dcp.save(state, checkpoint_id=args.dst)
    leave_job()


def _full_load(src: str) -> dict:
    """A DCP checkpoint as one in-memory state dict, without a process group (as dcp_to_torch_save does)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(src), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


def _flat_tensors(state: dict, prefix: str = "") -> dict:
    """The tensors of a nested state dict under '.'-joined keys."""
    import torch

    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_tensors(v, key + "."))
        elif isinstance(v, torch.Tensor):
            out[key] = v
    return out


def peer(argv: list[str]) -> int:
    """``_peer {torch-save,export-hf,verify,consolidate,accelerate-merge,dequantize,inspect} SRC [DST]``: the
    routes users take today."""
    kind, src, *rest = argv
    if kind == "torch-save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(src, rest[0])
    elif kind == "export-hf":
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in _flat_tensors(_full_load(src)).items()}
        Path(rest[0]).mkdir(parents=True)
        save_file(tensors, str(Path(rest[0]) / "model.safetensors"), metadata={"format": "pt"})
    elif kind == "verify":
        import torch
        from safetensors.torch import load_file

        a = _flat_tensors(_full_load(src))
        b = {}
        for f in sorted(Path(rest[0]).glob("*.safetensors")):
            b.update(load_file(str(f)))
        bad = sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]
        print(f"{len(a)} tensors compared, {len(bad)} differ")
        return 1 if bad else 0
    elif kind == "consolidate":  # torch's own consolidation of HuggingFaceStorageWriter's sharded files
        from safetensors import safe_open
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        keys = set()
        for f in Path(src).glob("*.safetensors"):
            with safe_open(str(f), "pt") as fh:
                keys.update(fh.keys())
        Path(rest[0]).mkdir(parents=True)  # it writes into an existing folder
        consolidate_safetensors_files(src, rest[0], dict.fromkeys(sorted(keys), 1))
    elif kind == "accelerate-merge":  # what `accelerate merge-weights` runs
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(str(Path(src) / "pytorch_model_fsdp_0"), rest[0], safe_serialization=True)
    elif kind == "dequantize":  # the loop users write: w.float() * scale per block, to bf16, file by file
        import torch
        from safetensors import safe_open
        from safetensors.torch import save_file

        Path(rest[0]).mkdir(parents=True)
        block = json.loads((Path(src) / "config.json").read_text())["quantization_config"]["weight_block_size"]
        for f in sorted(Path(src).glob("*.safetensors")):
            out = {}
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    if key.endswith("_scale_inv"):
                        continue
                    w = fh.get_tensor(key)
                    if w.dtype == torch.float8_e4m3fn:
                        scale = fh.get_tensor(key + "_scale_inv")
                        scale = scale.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)
                        w = w.float() * scale[:, :w.shape[1]]
                    out[key] = w.to(torch.bfloat16)
            save_file(out, str(Path(rest[0]) / f.name), metadata={"format": "pt"})
    elif kind == "inspect":
        from torch.distributed.checkpoint import FileSystemReader

        meta = FileSystemReader(src).read_metadata()
        for key, md in meta.state_dict_metadata.items():
            props = getattr(md, "properties", None)
            print(key, getattr(props, "dtype", ""), list(getattr(md, "size", [])), len(getattr(md, "chunks", [])))
    else:
        raise SystemExit(f"unknown peer {kind}")
    return 0


# ---------------------------------------------------------------------------
