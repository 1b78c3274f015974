"""Real Megatron-Core jobs on CPU (gloo): a GPTModel with the local layer spec saved as Megatron-LM saves it,
and loaded back by Megatron's own ``dist_checkpointing.load`` (the oracle of dcptool's ``--to megatron``).

Needs megatron-core 0.19.2 (``pip install --no-deps --ignore-requires-python megatron-core==0.19.2`` after
``numpy 'packaging>=24.2' einops psutil triton``; scripts/test.sh installs it). Run under torchrun from the
repository root with the tests folder on the path::

    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        -m harness.megatron save /tmp/run --tp 2 --pp 2
    PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m harness.megatron load /tmp/run/iter_0000100 --tp 2 --model /tmp/run/model.json --out /tmp/loaded.pt

``save RUN`` writes Megatron-LM's run layout: ``RUN/iter_{N:07d}/`` (torch_dist: ``dist_checkpointing.save``
of the model, the optimizer in ``fully_reshardable`` form when asked, RNG and rerun-state objects and the
common state: ``args`` Namespace, ``iteration``, ``checkpoint_version`` ...; or, with ``--format torch``, the
legacy per-rank ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``), ``RUN/latest_checkpointed_iteration.txt``,
``RUN/model.json`` (the model's options), and beside the run ``RUN.reference/full.pt`` (every weight, whole, by
its torch_dist key: stacked ``decoder.layers.X`` of ``[L, ...]``; outside the run, which lists only iterations). ``--weights FILE`` loads such a file of whole
weights into the model before saving (the model's own random init otherwise); ``--tokens FILE`` (pipeline size 1)
writes the logits of the model's forward before saving to ``RUN.reference/logits.pt`` (``logits``' dict: with the
prediction layers' too, for a model that has them).

``--etp N`` sets the experts' tensor parallelism (Megatron's default: the tensor parallelism; a MoE with biases,
GPT-OSS's, needs 1). ``--vpp N`` gives each pipeline stage N model chunks (``model0``, ``model1`` ... in the state dict, as Megatron-LM
keeps virtual pipeline stages). ``load CKPT`` builds the model of ``--model`` (model.json; ``--tp/--pp/--ep/--vpp``
override its layout), loads CKPT
with ``dist_checkpointing.load`` and writes every weight, whole, to ``--out`` (torch.save, by torch_dist key);
``--tokens FILE`` (a torch.save of int64 ``[batch, seq]``, pipeline size 1 only) adds the logits of a forward
pass as ``__logits__`` (and the prediction layers' as ``__mtp_logits__``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from harness.runtime import exit_now, reference_dir  # noqa: E402

# The options of a model, with their defaults (model.json holds them all).
MODEL_DEFAULTS = {
    "tp": 1, "pp": 1, "ep": 1, "etp": 0, "vpp": 1, "num_layers": 2, "hidden": 32, "heads": 4, "kv_groups": 2, "ffn": 64,
    "experts": 0, "moe_ffn": 32, "topk": 2, "grouped_gemm": False, "qk_layernorm": False, "qkv_bias": False,
    "vocab": 100, "divisible_by": 16, "padded_vocab": 0, "tied": False, "seq_len": 64, "rope_base": 10000.0,
    "eps": 1e-6, "kv_channels": 0, "hf_config": "", "mtp_layers": 0, "pre_softmax": False, "shared_ffn": 0, "shared_gate": False,
}
ITERATION = 100


def padded_vocab(model: dict) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: a multiple of ``make_vocab_size_divisible_by * tp`` (the saving
    run's: a run loaded at another TP keeps the embedding rows it was saved with, ``padded_vocab``)."""
    if model["padded_vocab"]:
        return model["padded_vocab"]
    multiple = model["divisible_by"] * model["tp"]
    return -(-model["vocab"] // multiple) * multiple


def expert_tp(model: dict) -> int:
    """The experts' tensor parallelism: ``etp``, or as Megatron defaults it, the tensor parallelism."""
    return model["etp"] or model["tp"]


def iteration_folder(run: Path, iteration: int) -> Path:
    return run / f"iter_{iteration:07d}"


def legacy_rank_folder(model: dict, tp_rank: int, pp_rank: int, ep_rank: int) -> str:
    """Megatron-LM's ``get_checkpoint_name``: ``mp_rank_TT[_PPP][_EEE]``."""
    name = f"mp_rank_{tp_rank:02d}"
    if model["pp"] > 1:
        name += f"_{pp_rank:03d}"
    if model["ep"] > 1:
        name += f"_{ep_rank:03d}"
    return name


# ---------------------------------------------------------------------------------------------------------
# The job: Megatron on CPU under gloo


def patch_cuda() -> None:
    """What megatron-core calls of CUDA while saving and building on CPU: no-ops."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # the tied embedding's all-reduce across pipeline stages


def init(model: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(model["tp"], model["pp"], expert_model_parallel_size=model["ep"],
                                             expert_tensor_parallel_size=expert_tp(model),
                                             virtual_pipeline_model_parallel_size=virtual(model))


def virtual(model: dict) -> int | None:
    """The virtual pipeline size as Megatron takes it: None without virtual stages."""
    return model["vpp"] if model["vpp"] > 1 else None


def chunk_key(number: int, chunks: list) -> str:
    """Where Megatron-LM keeps a model chunk in its state dict: ``model``, or ``model0``, ``model1`` ... with VPP."""
    return "model" if len(chunks) == 1 else f"model{number}"


def build(model: dict) -> list:
    """The GPTModel chunks of ``model`` on this rank (one per virtual stage of its pipeline stage), float32,
    initialized from a fixed seed. ``hf_config`` (an HF config.json of DeepSeek-V3, GLM-4.5 MoE or GPT-OSS): that
    model (harness.megatron_deepseek: latent attention, MoE; harness.megatron_glm: partial RoPE, q/k/v biases, MoE;
    both with ``mtp_layers`` prediction layers; harness.megatron_gpt_oss: biases, sinks, sliding windows, YaRN,
    clamped experts with biases) instead."""
    import torch.nn.functional as F
    from megatron.core import parallel_state

    if model["hf_config"]:
        from harness import megatron_deepseek, megatron_glm, megatron_gpt_oss

        config = json.loads(Path(model["hf_config"]).read_text())
        gpt_model = {"deepseek_v3": megatron_deepseek, "glm4_moe": megatron_glm,
                     "gpt_oss": megatron_gpt_oss}[config["model_type"]].gpt_model
        torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
        return [gpt_model(config, padded_vocab(model), model["mtp_layers"], tensor_model_parallel_size=model["tp"],
                          pipeline_model_parallel_size=model["pp"], expert_model_parallel_size=model["ep"],
                          expert_tensor_parallel_size=expert_tp(model))]
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = model["experts"] > 0
    config = TransformerConfig(
        num_layers=model["num_layers"], hidden_size=model["hidden"], num_attention_heads=model["heads"],
        num_query_groups=model["kv_groups"], kv_channels=model["kv_channels"] or None, ffn_hidden_size=model["ffn"],
        use_cpu_initialization=True,
        normalization="RMSNorm", layernorm_epsilon=model["eps"], gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=model["qkv_bias"], qk_layernorm=model["qk_layernorm"],
        tensor_model_parallel_size=model["tp"], pipeline_model_parallel_size=model["pp"],
        virtual_pipeline_model_parallel_size=virtual(model),
        # MoE with TP > 1 asks for sequence parallel, but megatron-core 0.19.2 only warns (model_parallel_config.py):
        # saving, loading and the forward work without it; the experts' TP is TP (expert_tensor_parallel_size)
        expert_model_parallel_size=model["ep"],
        num_moe_experts=model["experts"] or None, moe_ffn_hidden_size=model["moe_ffn"] if moe else None,
        moe_router_topk=model["topk"], moe_grouped_gemm=model["grouped_gemm"], moe_token_dispatcher_type="allgather",
        moe_router_pre_softmax=model["pre_softmax"],
        # Qwen2-MoE's shared expert, scaled by a sigmoid gate (moe/shared_experts.py)
        moe_shared_expert_intermediate_size=model["shared_ffn"] or None, moe_shared_expert_gate=model["shared_gate"],
        moe_aux_loss_coeff=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=model["experts"] or None, moe_grouped_gemm=model["grouped_gemm"],
                                    qk_layernorm=model["qk_layernorm"], normalization="RMSNorm")
    torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
    stages = [None] if virtual(model) is None else list(range(model["vpp"]))
    return [GPTModel(config, spec, vocab_size=padded_vocab(model), max_sequence_length=model["seq_len"],
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                     share_embeddings_and_output_weights=model["tied"], position_embedding_type="rope",
                     rotary_base=model["rope_base"], vp_stage=stage) for stage in stages]


# The args of a model built from an HF config (hf_config), read off its TransformerConfig: Megatron-LM's
# core_transformer_config_from_args gives these config fields the args' names, or (the second) its own.
CONFIG_ARGS = {name: name for name in (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "add_qkv_bias", "qk_layernorm", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_pre_softmax",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq", "mtp_num_layers",
    "multi_latent_attention")} | {
    "num_experts": "num_moe_experts", "norm_epsilon": "layernorm_epsilon"}


def run_args(model: dict, checkpoint_format: str, gpt=None):
    """The ``args`` Namespace Megatron-LM keeps in a checkpoint (the fields a reader of the run looks at, with
    Megatron's enums), as ``megatron/training/arguments.py`` names them; of a model built from an HF config, those
    its GPTModel ``gpt`` was built with (its TransformerConfig, rotary_percent and rotary_base)."""
    from argparse import Namespace

    import torch.distributed as dist
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend

    world = dist.get_world_size()
    args = Namespace(
        tensor_model_parallel_size=model["tp"], pipeline_model_parallel_size=model["pp"],
        expert_model_parallel_size=model["ep"], expert_tensor_parallel_size=expert_tp(model),
        virtual_pipeline_model_parallel_size=virtual(model), context_parallel_size=1,
        data_parallel_size=world // (model["tp"] * model["pp"]), world_size=world,
        num_layers=model["num_layers"], hidden_size=model["hidden"], ffn_hidden_size=model["ffn"],
        num_attention_heads=model["heads"], group_query_attention=model["kv_groups"] != model["heads"],
        num_query_groups=model["kv_groups"], kv_channels=model["kv_channels"] or model["hidden"] // model["heads"],
        num_experts=model["experts"] or None, moe_ffn_hidden_size=model["moe_ffn"] if model["experts"] else None,
        moe_router_topk=model["topk"], moe_router_pre_softmax=model["pre_softmax"], moe_grouped_gemm=model["grouped_gemm"],
        moe_shared_expert_intermediate_size=model["shared_ffn"] or None, moe_shared_expert_gate=model["shared_gate"],
        qk_layernorm=model["qk_layernorm"],
        add_qkv_bias=model["qkv_bias"], add_bias_linear=False, swiglu=True, normalization="RMSNorm",
        norm_epsilon=model["eps"], position_embedding_type="rope", rotary_base=model["rope_base"],
        max_position_embeddings=model["seq_len"], seq_length=model["seq_len"],
        untie_embeddings_and_output_weights=not model["tied"], vocab_size=model["vocab"],
        padded_vocab_size=padded_vocab(model), make_vocab_size_divisible_by=model["divisible_by"],
        params_dtype=torch.float32, bf16=False, fp16=False, ckpt_format=checkpoint_format,
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        iteration=ITERATION, consumed_train_samples=ITERATION * 8, transformer_impl="local")
    if model["hf_config"] and gpt is not None:
        built = gpt.config
        for name, field in CONFIG_ARGS.items():
            setattr(args, name, getattr(built, field))
        args.group_query_attention = built.num_query_groups != built.num_attention_heads
        args.rotary_percent, args.rotary_base = gpt.rotary_percent, gpt.rotary_base
    return args


def rng_state():
    """Megatron-LM's ``get_rng_state`` on CPU: python, numpy and torch generators (no CUDA)."""
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}


def fill(chunks: list, full: dict[str, torch.Tensor]) -> None:
    """Load whole weights ``full`` (by torch_dist key) into this rank's model chunks: each ShardedTensor of a
    chunk's sharded state dict takes its slice, the way ``dist_checkpointing.load`` places what it reads."""
    for chunk in chunks:
        _fill(chunk, full)


def _fill(model, full: dict[str, torch.Tensor]) -> None:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor, ShardedTensorFactory,
                                                          apply_factories, apply_factory_merges)

    sharded = model.sharded_state_dict()
    factories, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensorFactory),
                                           return_lists_as_dicts=True)
    apply_factories(sharded)

    def take(value):
        if isinstance(value, ShardedTensor):
            return full[value.key][value.global_slice()].clone().view(value.local_shape)
        if isinstance(value, ShardedObject):
            return value.data
        return value

    dict_list_map_inplace(take, sharded)
    model.load_state_dict(apply_factory_merges(sharded, factories), strict=False)


def gather_full(chunks: list) -> dict[str, torch.Tensor] | None:
    """Every weight of the model across ranks, whole, by torch_dist key (on rank 0; None elsewhere)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    sharded = [chunk.sharded_state_dict() for chunk in chunks]
    apply_factories(sharded)
    mine = [(t.key, tuple(t.global_shape), t.global_slice(), t.data.detach().clone().reshape(t.local_shape))
            for t in nested_values(sharded) if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank():
        return None
    full: dict[str, torch.Tensor] = {}
    for pieces in every:
        for key, shape, where, data in pieces:
            whole = full.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            whole[where] = data
    holes = [key for key, whole in full.items() if whole.isnan().any()]
    assert not holes, f"pieces missing from the gathered weights: {holes}"
    return dict(sorted(full.items()))


def common_state(model: dict, checkpoint_format: str, gpt=None) -> dict:
    """What Megatron-LM's ``generate_state_dict`` puts beside the model: the common state and per-rank objects."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: F401 (the scheduler's fields)

    return {"args": run_args(model, checkpoint_format, gpt), "checkpoint_version": 3.0, "iteration": ITERATION,
            "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 10, "num_steps": ITERATION * 8,
                                    "lr_decay_style": "cosine", "lr_decay_steps": 1000},
            "num_floating_point_operations_so_far": 12345.0,
            "content_metadata": {"singleton_local_shards": False, "distrib_optim_sharding_type": "fully_reshardable"}}


def sharded_objects(model: dict) -> dict:
    """Megatron-LM's per-rank ShardedObjects: RNG per (pp, tp) rank, replicated over dp; the rerun state machine."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    rng = ShardedObject("rng_state", [rng_state()], (model["pp"], model["tp"]), (pp_rank, tp_rank),
                        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True))
    rerun = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist", force=True)
    rerun = ShardedObject("rerun_state_machine_state", rerun, (dist.get_world_size(),), (dist.get_rank(),))
    return {"rng_state": [rng], "rerun_state_machine_state": rerun}


def optimizer_state(chunks: list) -> dict:
    """An optimizer state in Megatron's ``fully_reshardable`` form, laid out as ``DistributedOptimizer.
    sharded_state_dict`` lays it out (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, each sharded like
    its weight); its values are made here from the weights (Megatron's DistributedOptimizer needs CUDA)."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = [chunk.sharded_state_dict() for chunk in chunks]
    apply_factories(sharded)
    state = []
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor):
            continue
        weight = tensor.data.detach().reshape(tensor.local_shape)
        for name, values in (("param", weight), ("exp_avg", weight * 0.1), ("exp_avg_sq", weight ** 2)):
            state.append(replace(tensor, key=f"optimizer.state.{name}.{tensor.key}", data=values.clone()))
    return {"state": state, "param_groups": [{"lr": 3e-4, "weight_decay": 0.1, "step": ITERATION}]}


def cmd_save(args) -> int:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    model = {name: getattr(args, name) for name in MODEL_DEFAULTS}
    model["padded_vocab"] = padded_vocab(model)
    init(model)
    chunks = build(model)
    if args.weights:
        fill(chunks, torch.load(args.weights, weights_only=True))
    if args.tokens:  # the model's forward before it is saved: every rank runs it, rank 0 keeps the logits
        before = logits(chunks[0], torch.load(args.tokens, weights_only=True), parallel_state)
    run = Path(args.run)
    folder = iteration_folder(run, ITERATION)
    state = common_state(model, args.format, chunks[0])
    if args.format == "torch_dist":
        state.update({chunk_key(i, chunks): chunk.sharded_state_dict() for i, chunk in enumerate(chunks)})
        state.update(sharded_objects(model))
        if args.optimizer:
            state["optimizer"] = optimizer_state(chunks)
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(state, str(folder))
    else:  # Megatron-LM's --ckpt-format torch: the ranks of expert-data-parallel rank 0 save their model part
        state.update({chunk_key(i, chunks): chunk.state_dict_for_save_checkpoint() for i, chunk in enumerate(chunks)})
        state["rng_state"] = [rng_state()]
        if parallel_state.get_expert_data_parallel_rank() == 0:
            name = legacy_rank_folder(model, parallel_state.get_tensor_model_parallel_rank(),
                                      parallel_state.get_pipeline_model_parallel_rank(),
                                      parallel_state.get_expert_model_parallel_rank())
            (folder / name).mkdir(parents=True, exist_ok=True)
            torch.save(state, folder / name / "model_optim_rng.pt")
    full = gather_full(chunks)
    dist.barrier()
    if dist.get_rank() == 0:
        (run / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
        (run / "model.json").write_text(json.dumps(model, indent=1))
        reference_dir(run).mkdir(exist_ok=True)
        torch.save(full, reference_dir(run) / "full.pt")
        if args.tokens:
            torch.save(before, reference_dir(run) / "logits.pt")
    return 0


def cmd_load(args) -> int:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    model = {**MODEL_DEFAULTS, **json.loads(Path(args.model).read_text())}
    model.update({name: value for name in ("tp", "pp", "ep", "vpp") if (value := getattr(args, name)) is not None})
    init(model)
    chunks = build(model)
    loaded = dist_checkpointing.load({chunk_key(i, chunks): chunk.sharded_state_dict()
                                      for i, chunk in enumerate(chunks)}, args.ckpt)
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[chunk_key(i, chunks)], strict=False)
    full = gather_full(chunks)
    if args.tokens:  # every rank runs the forward; rank 0 keeps the logits
        out = logits(chunks[0], torch.load(args.tokens, weights_only=True), parallel_state)
    if dist.get_rank() == 0:
        torch.save({**full, **out} if args.tokens else full, args.out)
    return 0


def logits(gpt, tokens: torch.Tensor, parallel_state) -> dict[str, torch.Tensor]:
    """The model's logits ``[batch, seq, vocab]`` for ``tokens`` (pipeline size 1; causal, no padding) as
    ``__logits__``; a model with prediction layers adds theirs as ``__mtp_logits__`` ``[layers, batch, seq, vocab]``
    (the first's position i predicts token i + 2 from token i + 1 and the main model's hidden state i; past the
    input, Megatron fills the tokens with 0)."""
    import contextlib

    from megatron.core import tensor_parallel

    assert parallel_state.get_pipeline_model_parallel_world_size() == 1, "--tokens needs a pipeline size of 1"
    # Attention forks the CUDA RNG tracker around its dropout (none here, in eval): a no-op on CPU.
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    gpt.eval()
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand(batch, seq)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    predictions = []  # the prediction layers' hidden states [seq, batch, hidden], after the main ones
    if getattr(gpt, "mtp", None) is not None:
        gpt.mtp.register_forward_hook(lambda module, inputs, output: predictions.append(output))
    with torch.no_grad(), CudaOnCpu():
        out = {"__logits__": tp_gathered(gpt(tokens, positions, mask), parallel_state)}  # [batch, seq, vocab / tp]
        if predictions:
            out["__mtp_logits__"] = torch.stack([
                tp_gathered(gpt.output_layer(hidden)[0].transpose(0, 1), parallel_state)
                for hidden in torch.chunk(predictions[0], 1 + gpt.config.mtp_num_layers)[1:]])
    return out


class CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors megatron-core makes on ``device="cuda"`` made on the CPU: its local attention builds the
    sliding-window mask there (0.19.2, ``transformer/utils.py`` ``get_sliding_window_causal_mask``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def tp_gathered(out: torch.Tensor, parallel_state) -> torch.Tensor:
    """Logits ``[..., vocab / tp]`` of every tensor-parallel rank joined: ``[..., vocab]``."""
    import torch.distributed as dist

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out.detach().contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("save", help="save a Megatron-LM run folder")
    p.add_argument("run")
    for name, default in MODEL_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--format", choices=("torch_dist", "torch"), default="torch_dist")
    p.add_argument("--optimizer", action="store_true", help="save the optimizer in fully_reshardable form")
    p.add_argument("--weights", help="torch.save of whole weights by torch_dist key, loaded before saving")
    p.add_argument("--tokens", help="torch.save of int64 tokens [batch, seq]: their logits before saving, in "
                                    "RUN.reference/logits.pt")
    p.set_defaults(func=cmd_save)
    p = sub.add_parser("load", help="dist_checkpointing.load a torch_dist folder and write its whole weights")
    p.add_argument("ckpt")
    p.add_argument("--model", required=True, help="model.json of the run")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--vpp", type=int)
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", help="torch.save of int64 tokens [batch, seq]: add their logits as __logits__")
    p.set_defaults(func=cmd_load)
    return parser.parse_args(argv)


def stop_writer_manager() -> None:
    """Shut down the Manager process megatron's checkpoint writer starts (it would outlive the job's fast exit)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None and getattr(queue, "_manager", None) is not None:
        queue._manager.shutdown()


def main(argv: list[str]) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    patch_cuda()
    args = parse_args(argv)
    try:
        return args.func(args)
    finally:
        stop_writer_manager()


if __name__ == "__main__":  # megatron's async writer starts a Manager that imports this module again

    exit_now(main(sys.argv[1:]))
