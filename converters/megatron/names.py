"""What Megatron-Core and Megatron-LM call things on disk: the files of a torch_dist folder and of the legacy
per-rank format, the run layout's iteration folders, and the objects Megatron keeps beside the tensors."""

from __future__ import annotations

import re

from dcptool.safe_pickle import SafeGlobals

NAME = "megatron"
CONFIG = "metadata.json"  # dist_checkpointing/core.py save_config: {"sharded_backend": ..., "sharded_backend_version": 1}
BACKEND = "torch_dist"  # the sharded backend dcptool reads and writes (DCP underneath)
REMOVED_BACKENDS = {"zarr": "0.16"}  # backends Megatron-Core no longer reads, with the release that removed them
COMMON_PT = "common.pt"  # the common state before core 0.19
COMMON_STATE = "common_state/shard_0_1"  # the common state from core 0.19: a ShardedObject inside the DCP
EXTRA_STATE = "._extra_state"  # a module's extra state (None with the local layer spec), one object per layer
LAYERS = "decoder.layers."
# Megatron-LM's --ckpt-format torch: one file per (tensor, pipeline, expert) rank, ``get_checkpoint_name``.
LEGACY_FILE = "model_optim_rng.pt"
LEGACY_RANK = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?/" + re.escape(LEGACY_FILE) + "$")
# The local layer spec saves these norms apart in the module's state dict and under the fused linear's
# names in the sharded one (gpt_layer_specs.py sharded_state_dict_keys_map).
LOCAL_SPEC_NAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def shard_key(key: str, offsets: tuple[int, ...], shape: tuple[int, ...]) -> str:
    """A ShardedObject's key on disk (``mapping.py`` ``unique_key``): ``rng_state/shard_0.1_1.2``."""
    return f"{key}/shard_{'.'.join(map(str, offsets))}_{'.'.join(map(str, shape))}"

# What Megatron's pickles hold beyond torch's: Megatron-LM's common state (its args) and rerun state, the classes
# megatron-core's safe_globals.py lets torch.load take, read as data (an enum as its value, a config as its
# attributes); and Megatron-Core 0.15's .metadata and save plans, subclasses of torch's (with an mcore_data
# field), read as what they subclass.
SAFE_GLOBALS = SafeGlobals(
    enums=("megatron.core.enums.ModelType",
           *(f"megatron.core.transformer.enums.{name}" for name in
             ("AttnBackend", "CudaGraphModule", "CudaGraphScope", "InferenceCudaGraphScope")),
           *(f"megatron.core.rerun_state_machine.{name}" for name in ("RerunDiagnostic", "RerunMode", "RerunState"))),
    namespaces=("megatron.core.optimizer.optimizer_config.OptimizerConfig",
                "megatron.core.dist_checkpointing.mapping.ShardedObject"),  # nested in the rerun state machine's state
    read_as=(("megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
              "torch.distributed.checkpoint.metadata.Metadata"),
             ("megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
              "torch.distributed.checkpoint.planner.SavePlan")),
)
