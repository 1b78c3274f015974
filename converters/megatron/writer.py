"""Writing a torch_dist folder that Megatron-Core's ``dist_checkpointing.load`` reads at any TP / PP / EP: a DCP
folder as the dcp format writes it (objects as raw ``torch.save`` values under their ShardedObject keys, not
flattened), plus ``metadata.json``; ``plan_output`` adds the objects Megatron's load asks for that the source
lacks (the common state, each stacked linear's ``_extra_state`` per layer: ``[None]`` with the local spec)."""

from __future__ import annotations

import json
import re

from dcptool.converters.dcp import Writer as DcpWriter
from dcptool.converters.megatron.names import BACKEND, COMMON_STATE, CONFIG, EXTRA_STATE, LAYERS, shard_key
from dcptool.engine.core import Checkpoint, ObjectInfo, OutObject, OutTensor

# What the common state holds when the source says nothing of it: what Megatron-LM's loader reads first.
NEW_COMMON_STATE = {"checkpoint_version": 3.0}
# What Megatron-LM's generate_state_dict puts in the common state (a legacy file holds them at its top level).
COMMON_ENTRIES = ("args", "checkpoint_version", "iteration", "opt_param_scheduler",
                  "num_floating_point_operations_so_far", "content_metadata")
STACKED_EXPERTS = ".experts.experts."  # SequentialMLP / grouped GEMM experts: [L, E, ...], an object per (layer, expert)
# A layer saved on its own (non-uniform decoder layers; multi-token-prediction layers): no layer axis, an object
# per expert, or one of shape (1,).
PER_LAYER = re.compile(r"^(?:decoder|mtp)\.layers\.\d+\.")


class Writer(DcpWriter):
    """The dcp format's writer, and ``metadata.json`` with the index (it marks the folder as Megatron's)."""

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        left_out = super().finish_index(objects, records)
        config = {"sharded_backend": BACKEND, "sharded_backend_version": 1}
        (self.folder / CONFIG).write_text(json.dumps(config))
        return left_out


def megatron_objects(tensors: list[OutTensor], objects: list[OutObject], checkpoint: Checkpoint) -> list[OutObject]:
    """``objects`` as Megatron's load asks for them: Megatron-LM's common entries gathered into the common state
    (a legacy checkpoint keeps ``args``, ``iteration`` ... at the top level, as does an import made from an HF
    config), ``checkpoint_version`` 3.0 when none says it, and
    the ``_extra_state`` objects of the stacked linear layers that lack them (``expected_objects``)."""
    have = {obj.key for obj in objects}
    out = list(objects)
    if not has_common_state(have):
        common = [obj for obj in objects if obj.key in COMMON_ENTRIES]
        state = {**NEW_COMMON_STATE, **{obj.key: obj.value() for obj in common}}
        out = [obj for obj in objects if obj not in common]
        source = ObjectInfo((COMMON_STATE,), value=[state])  # a ShardedObject is saved as a one-element list
        out.append(OutObject(COMMON_STATE, (COMMON_STATE,), source, checkpoint, merged=[obj.source for obj in common]))
    for key in expected_objects((tensor.key, tensor.shape) for tensor in tensors):
        if key not in have:
            out.append(OutObject(key, (key,), ObjectInfo((key,), value=[None]), checkpoint))
    return out


def has_common_state(keys) -> bool:
    return any(key.startswith(COMMON_STATE.split("/")[0] + "/") for key in keys)


def expected_objects(tensors) -> list[str]:
    """The ``_extra_state`` objects Megatron's load of these ``(key, shape)`` tensors asks for: one per layer (and
    expert) of each stacked linear layer's weight, ``<module>._extra_state/shard_{layer}[.{expert}]_{L}[.{E}]``."""
    keys = []
    for key, shape in tensors:
        module, _, last = key.rpartition(".")
        linear = module.rsplit(".", 1)[-1].startswith("linear_") or module.endswith(".eh_proj")
        if not ((key.startswith(LAYERS) or PER_LAYER.match(key)) and last == "weight" and linear):
            continue
        experts = STACKED_EXPERTS in module
        if PER_LAYER.match(key):
            stacked = tuple(shape[:1]) if experts else (1,)
        else:
            stacked = tuple(shape[:2] if experts else shape[:1])
        keys += [shard_key(module + EXTRA_STATE, at, stacked) for at in _indices(stacked)]
    return keys


def _indices(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for first in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (first, *rest)
