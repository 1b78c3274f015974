"""Writing a torch_dist folder that Megatron-Core's ``dist_checkpointing.load`` reads at any TP / PP / EP: a DCP
folder as the dcp format writes it (objects as raw ``torch.save`` values under their ShardedObject keys, not
flattened), plus ``metadata.json``; ``plan_output`` adds the objects Megatron's load asks for that the source
lacks (the common state, each stacked linear's ``_extra_state`` per layer: ``[None]`` with the local spec)."""

from __future__ import annotations

import json

from dcptool.converters.dcp import Writer as DcpWriter
from dcptool.converters.megatron.names import BACKEND, COMMON_STATE, CONFIG, EXTRA_STATE, LAYERS, shard_key
from dcptool.core import Checkpoint, ObjectInfo, OutObject, OutTensor

# The common state of a checkpoint dcptool made from another format: what Megatron-LM's loader reads first.
NEW_COMMON_STATE = {"checkpoint_version": 3.0}
STACKED_EXPERTS = ".experts.experts."  # SequentialMLP / grouped GEMM experts: [L, E, ...], an object per (layer, expert)


class Writer(DcpWriter):
    """The dcp format's writer, and ``metadata.json`` with the index (it marks the folder as Megatron's)."""

    def finish_index(self, objects, records: list[dict]) -> list[str]:
        left_out = super().finish_index(objects, records)
        config = {"sharded_backend": BACKEND, "sharded_backend_version": 1}
        (self.folder / CONFIG).write_text(json.dumps(config))
        return left_out


def missing_objects(tensors: list[OutTensor], objects: list[OutObject], checkpoint: Checkpoint) -> list[OutObject]:
    """The objects Megatron's load of these tensors asks for that ``objects`` lacks: the common state, and
    ``<module>._extra_state/shard_{layer}[.{expert}]_{L}[.{E}]`` of each stacked linear layer's weight."""
    have = {obj.key for obj in objects}
    wanted: dict[str, object] = {COMMON_STATE: [NEW_COMMON_STATE]} if not any(
        key.startswith(COMMON_STATE.split("/")[0] + "/") for key in have) else {}
    for tensor in tensors:
        module, _, last = tensor.key.rpartition(".")
        if not (tensor.key.startswith(LAYERS) and last == "weight" and module.rsplit(".", 1)[-1].startswith("linear_")):
            continue
        stacked = tensor.shape[:2] if STACKED_EXPERTS in module else tensor.shape[:1]
        for at in _indices(stacked):
            key = shard_key(module + EXTRA_STATE, at, stacked)
            if key not in have:
                wanted[key] = [None]
    return [OutObject(key, (key,), ObjectInfo((key,), value=value), checkpoint) for key, value in wanted.items()]


def _indices(shape: tuple[int, ...]):
    if not shape:
        yield ()
        return
    for first in range(shape[0]):
        for rest in _indices(shape[1:]):
            yield (first, *rest)
