"""Megatron-LM's ``args`` (its checkpoint's common state, read as data) and a Hugging Face config.json, made from
each other: the config fields taking Megatron's tensors apart needs (``config_from_args``), the ``args`` an import
writes (``run_args``), and the config.json an export writes from a run's ``args`` (``hf_config_from_args``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcptool import models
from dcptool.engine.core import TensorInfo
from dcptool.errors import option
from dcptool.families.megatron.layers import LAYER, MTP_LAYER
from dcptool.models.kind import ArgsFields, ModelKind
from dcptool.safe_pickle.allowlist import Name

if TYPE_CHECKING:
    from dcptool.families.megatron import MegatronOptions

# Megatron-LM's --transformer-impl of each layer spec whose names dcptool writes (models.kind.MEGATRON_SPECS).
TRANSFORMER_IMPL = {"local": "local", "te": "transformer_engine"}

# Megatron-LM's args (megatron/training/arguments.py) -> the HF config fields taking its tensors apart needs.
_ARGS = {"num_attention_heads": "num_attention_heads", "kv_channels": "head_dim", "hidden_size": "hidden_size",
         "num_layers": "num_hidden_layers", "vocab_size": "vocab_size", "num_experts": "num_experts"}


def config_from_args(args: dict | None) -> dict:
    """The HF config fields a Megatron-LM run's ``args`` (its checkpoint's common state, read as data) gives:
    head counts and size, layers, the vocabulary before padding (when the run was given ``--vocab-size``)."""
    if not isinstance(args, dict):
        return {}
    config = {hf: args[name] for name, hf in _ARGS.items() if type(args.get(name)) is int and args[name] > 0}
    groups = args.get("num_query_groups") if args.get("group_query_attention") else args.get("num_attention_heads")
    if type(groups) is int and groups > 0:
        config["num_key_value_heads"] = groups
    return config


# Megatron-LM's args <-> a Hugging Face config.json, for the kinds whose whole model both describe.

# args field -> config.json field, the same value in both (loader_llama_mistral.py, loader_hf_moe.py).
_SAME = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
         "num_attention_heads": "num_attention_heads", "num_query_groups": "num_key_value_heads",
         "kv_channels": "head_dim", "max_position_embeddings": "max_position_embeddings",
         "norm_epsilon": "rms_norm_eps", "vocab_size": "vocab_size", "rotary_base": "rope_theta"}
# (num_experts: under the kind's own expert field)
_SAME_MOE = {"moe_router_topk": "num_experts_per_tok", "moe_ffn_hidden_size": "moe_intermediate_size"}
# Megatron-LM's defaults (arguments.py) of the fields read here: what a field absent from args means.
_DEFAULTS = {"norm_epsilon": 1e-5, "rotary_base": 10000, "swiglu": False, "normalization": "LayerNorm",
             "position_embedding_type": "learned_absolute", "add_bias_linear": True, "rotary_percent": 1.0,
             "rotary_interleaved": False, "use_rope_scaling": False, "apply_layernorm_1p": False,
             "multi_latent_attention": False, "moe_layer_freq": 1, "moe_router_score_function": "softmax",
             "moe_router_topk_scaling_factor": None, "moe_shared_expert_intermediate_size": None,
             "untie_embeddings_and_output_weights": False, "moe_router_pre_softmax": False,
             "moe_router_enable_expert_bias": False, "moe_router_num_groups": None, "moe_shared_expert_gate": False,
             "mtp_num_layers": None, "add_qkv_bias": False, "qk_layernorm": False}
# What args must say for config.json to describe the run's model: field -> the value needed (less what a kind's
# ArgsFields state, ``_needed``).
_MODEL_ARGS = {"swiglu": True, "normalization": "RMSNorm", "position_embedding_type": "rope", "add_bias_linear": False,
               "rotary_percent": 1.0, "rotary_interleaved": False, "use_rope_scaling": False,
               "apply_layernorm_1p": False, "multi_latent_attention": False, "moe_layer_freq": 1,
               "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
               "moe_router_num_groups": None, "moe_router_topk_scaling_factor": None,
               "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False, "mtp_num_layers": None}
# An ArgsFields field -> the args field that states it (its value for the kinds without it: _MODEL_ARGS').
_STATED_BY = {"partial_rotary": "rotary_percent", "dense_layers": "moe_layer_freq",
              "shared_experts": "moe_shared_expert_intermediate_size", "routed_scaling": "moe_router_topk_scaling_factor",
              "predictions": "mtp_num_layers"}


def rope_base(config: dict) -> float | None:
    """The RoPE base of a config without rope scaling (transformers 5 keeps it in ``rope_parameters``, 4 at the
    top level); None for scaled RoPE, which args cannot state."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict) or params.get("rope_type", params.get("type", "default")) != "default":
        return None
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    return base if isinstance(base, (int, float)) and base > 0 else None


def _needed(fields: ArgsFields) -> dict:
    """What args must say for config.json of a kind that has ``fields`` to describe the run's model."""
    needed = {name: value for name, value in _MODEL_ARGS.items()
              if name not in {_STATED_BY[field] for field in _STATED_BY if getattr(fields, field)}}
    if fields.sigmoid_router:
        needed.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    return needed


def _dense_layers(moe_layer_freq, layers: int) -> int | None:
    """The dense first layers of Megatron-LM's ``moe_layer_freq`` (1: none; a list [0] x k + [1] x the rest: k);
    None for any other pattern."""
    if isinstance(moe_layer_freq, int) and not isinstance(moe_layer_freq, bool):
        return 0 if moe_layer_freq == 1 else None
    if not isinstance(moe_layer_freq, list) or len(moe_layer_freq) != layers:
        return None
    dense = next((layer for layer, moe in enumerate(moe_layer_freq) if moe == 1), layers)
    return dense if moe_layer_freq == [0] * dense + [1] * (layers - dense) else None


def _config_fields(fields: ArgsFields, args: dict) -> tuple[dict, list[str]]:
    """The config fields of ``fields`` (``ArgsFields``) that a run's ``args`` (defaults filled in) state, and the
    args whose value no such config field states."""
    config, differ = {}, []
    if fields.qkv_bias:
        config[fields.qkv_bias] = bool(args["add_qkv_bias"])
    if fields.qk_norm:
        config[fields.qk_norm] = bool(args["qk_layernorm"])
    if fields.partial_rotary:
        config[fields.partial_rotary] = args["rotary_percent"]
    if fields.dense_layers:
        dense = _dense_layers(args["moe_layer_freq"], args.get("num_layers"))
        if dense is None:
            differ.append("moe_layer_freq")
        else:
            config[fields.dense_layers] = dense
    if fields.shared_experts:
        shared, expert = args["moe_shared_expert_intermediate_size"], args.get("moe_ffn_hidden_size")
        if type(shared) is not int or type(expert) is not int or expert <= 0 or shared % expert:
            differ.append("moe_shared_expert_intermediate_size")
        else:
            config[fields.shared_experts] = shared // expert
    if fields.routed_scaling:
        config[fields.routed_scaling] = args["moe_router_topk_scaling_factor"] or 1.0
    if fields.predictions:
        config[fields.predictions] = args["mtp_num_layers"] or 0
    return config, differ


def _stated_args(fields: ArgsFields, config: dict) -> dict | None:
    """The args a config's ``fields`` (``ArgsFields``) state (but its prediction layers, which the tensors written
    count); None where one is absent or Megatron has no such model (a sigmoid router that does not normalise its
    top k, or routes in groups)."""
    args = {}
    try:
        if fields.partial_rotary:  # transformers 5 keeps it in rope_parameters, 4 at the top level
            params = config.get("rope_parameters") or {}
            args["rotary_percent"] = float(params[fields.partial_rotary] if fields.partial_rotary in params
                                           else config[fields.partial_rotary])
        layers = int(config["num_hidden_layers"])
        if fields.dense_layers:
            dense = int(config[fields.dense_layers])
            args["moe_layer_freq"] = [0] * dense + [1] * (layers - dense) if dense else 1
        if fields.shared_experts:
            args["moe_shared_expert_intermediate_size"] = int(config["moe_intermediate_size"]) * int(
                config[fields.shared_experts]) or None
        if fields.routed_scaling:
            args["moe_router_topk_scaling_factor"] = float(config[fields.routed_scaling])
    except (KeyError, TypeError, ValueError):
        return None
    if fields.sigmoid_router:  # Megatron normalises a sigmoid router's top k (more than one), in one group here
        topk = config.get("num_experts_per_tok")
        if (config.get("n_group") or 1) != 1 or (config.get("topk_group") or 1) != 1 or (
                isinstance(topk, int) and topk > 1 and not config.get("norm_topk_prob", True)):
            return None
        args.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    return args


def run_args(kind: ModelKind, config: dict, built: dict, options: MegatronOptions) -> dict | None:
    """The ``args`` Megatron-LM's own HF conversion (tools/checkpoint ``loader_*hf*`` and ``saver_mcore``) writes
    for the model of ``config`` whose tensors in Megatron's names are ``built``: the fields dcptool can state
    exactly (the layout written is one rank's: TP for the vocabulary padding, PP and EP 1; the layer spec whose
    names it holds as ``transformer_impl``), with those of the kind's ``args_fields``; None for a kind args do not
    describe, a config without the fields, scaled RoPE or another activation than SiLU. Megatron-LM's
    ``check_checkpoint_args`` compares some on load, so a field is written right or not at all."""
    config = models.text_config(config)
    embedding = built.get("embedding.word_embeddings.weight")
    base = rope_base(config)
    if (kind.args_config is None or not isinstance(embedding, TensorInfo) or base is None
            or not float(base).is_integer() or config.get("hidden_act", "silu") != "silu"):
        return None  # (--rotary-base is an int; scaled RoPE is more fields than args state exactly)
    try:
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        args = {"num_layers": int(config["num_hidden_layers"]), "hidden_size": hidden,
                "ffn_hidden_size": int(config["intermediate_size"]), "num_attention_heads": heads,
                "group_query_attention": True, "num_query_groups": int(config.get("num_key_value_heads") or heads),
                "kv_channels": int(config.get("head_dim") or hidden // heads),
                "max_position_embeddings": int(config["max_position_embeddings"]),
                "norm_epsilon": float(config["rms_norm_eps"]), "vocab_size": int(config["vocab_size"])}
    except (KeyError, TypeError, ValueError):
        return None
    stated = _stated_args(kind.args_fields, config)
    if stated is None:
        return None
    names = {LAYER.match(name)[2] for name in built if LAYER.match(name)}
    dtype = options.dtype or embedding.dtype
    args.update(padded_vocab_size=embedding.shape[0], make_vocab_size_divisible_by=options.vocab_multiple,
                tensor_model_parallel_size=options.tp, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                add_qkv_bias="self_attention.linear_qkv.bias" in names,
                qk_layernorm="self_attention.q_layernorm.weight" in names,
                untie_embeddings_and_output_weights="output_layer.weight" in built,
                position_embedding_type="rope", tokenizer_type="HuggingFaceTokenizer", ckpt_format="torch_dist",
                transformer_impl=TRANSFORMER_IMPL[options.spec],
                params_dtype=Name(dtype), bf16=dtype == "bfloat16", fp16=dtype == "float16")
    args["rotary_base"] = int(base)
    experts = kind.expert_count(config)
    if experts:
        args.update(num_experts=experts, moe_router_topk=config.get("num_experts_per_tok"),
                    moe_ffn_hidden_size=config.get("moe_intermediate_size"))
        if not kind.args_fields.sigmoid_router:
            # HF's top-k of every expert's softmax, renormalised = Megatron's softmax of the top-k logits
            args["moe_router_pre_softmax"] = not config.get("norm_topk_prob", False)
    if kind.args_fields.predictions:  # those written (the config may count some the source lacks)
        args["mtp_num_layers"] = len({match[1] for name in built if (match := MTP_LAYER.match(name))}) or None
    args.update(stated)
    return {name: value for name, value in args.items() if value is not None}


def args_kinds() -> list[str]:
    """The model kinds Megatron-LM's args and an HF config.json are made from each other for."""
    return [name for name, kind in models.kinds().items() if kind.args_config is not None]


def hf_config_from_args(kind: str, args: dict | None) -> tuple[dict | None, str]:
    """The config.json of a Megatron-LM run's model from its ``args`` (read as data; a field absent is Megatron-LM's
    default), for the kinds args describe whole; else None. And a line saying which, or why not."""
    model = models.kinds()[kind]
    if model.args_config is None:
        return None, f"no config.json made from the run's args: dcptool makes one for {', '.join(args_kinds())}"
    args = {**_DEFAULTS, **(args or {})}
    differ = [name for name, needed in _needed(model.args_fields).items() if args[name] != needed]
    stated, unstated = _config_fields(model.args_fields, args)
    differ += unstated
    if bool(args.get("num_experts")) != bool(model.expert_fields):
        differ.append("num_experts")
    fields = {**_SAME, **({"num_experts": model.expert_fields[0], **_SAME_MOE} if model.expert_fields else {})}
    if not args.get("group_query_attention"):  # Megatron-LM's num_query_groups counts only with it
        fields.pop("num_query_groups")
    missing = [name for name in fields if type(args.get(name)) not in (int, float)]
    if differ or missing:
        what = (f"args {', '.join(differ)} describe a model that config.json of {kind} does not" if differ else
                f"args lack {', '.join(missing)}")
        return None, f"no config.json made from the run's args: {what}"
    config = {"model_type": kind, "num_key_value_heads": args["num_attention_heads"],
              **{hf: args[name] for name, hf in fields.items()}, "hidden_act": "silu",
              "tie_word_embeddings": not args["untie_embeddings_and_output_weights"], **stated, **model.args_config}
    if model.args_fields.sigmoid_router:  # Megatron normalises a sigmoid router's top k when there are more than one
        config["norm_topk_prob"] = args["moe_router_topk"] > 1
    elif model.expert_fields:  # HF's renormalised top-k of every expert's softmax = Megatron's softmax of the top-k
        config["norm_topk_prob"] = not args["moe_router_pre_softmax"]
    return config, (f"config.json made from the Megatron-LM run's args (no tokenizer files: give the model's config "
                    f"folder with {option('config_dir')} for them)")
