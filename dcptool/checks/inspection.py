"""What ``dcptool inspect`` finds in a checkpoint: its tensors and entries, data files, parameter counts, the
naming family and model kind of its weights, the mesh it was saved on, and with ``stats`` its values.

>>> import tempfile, numpy as np, safetensors.numpy
>>> from dcptool import formats
>>> folder = tempfile.mkdtemp()
>>> safetensors.numpy.save_file({"model.norm.weight": np.ones(4, np.float32)}, f"{folder}/model.safetensors")
>>> found = inspect_checkpoint(formats.open_checkpoint(folder))
>>> found.to_json()["tensors"], found.names
({'model.norm.weight': {'dtype': 'float32', 'shape': [4], 'bytes': 16, 'chunks': 1}}, {'family': 'hf', 'kind': 'llama'})
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dcptool import families, selection
from dcptool.engine import chunks
from dcptool.planning import lora
from dcptool.checks import stats
from dcptool.engine.core import Checkpoint, ObjectInfo, TensorInfo
from dcptool.errors import UsageError
from dcptool.mesh import Mesh
from dcptool.sizes import DEFAULT_MAX_MEMORY


@dataclass
class Inspection:
    """What inspect found: the tensors and entries ``include`` chose, the data files and their bytes, whether the
    chunks record the ranks that saved them, the mesh (and plan) a built-in plan reproduces the saved layout with,
    the naming family and kind of the weights, parameter counts, and the ``stats`` summary when asked."""

    checkpoint: Checkpoint
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    files: list[str]
    disk: int
    ranks_recorded: bool
    mesh: Mesh | None
    plan: str | None
    names: dict | None
    parameters: dict[str, Any]
    stats: stats.StatsReport | None = None
    lora: dict | None = None  # a peft model's adapters (``lora.describe``)

    def to_json(self) -> dict[str, Any]:
        """``inspect --json``."""
        report = {
            "format": self.checkpoint.format,
            "tensors": {k: {"dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes, "chunks": len(t.chunks)}
                        for k, t in self.tensors.items()},
            "objects": list(self.objects),
            "total_bytes": sum(t.nbytes for t in self.tensors.values()),
            "files": {"count": len(self.files), "bytes": self.disk},
            "info": {k: str(v) if isinstance(v, Path) else v for k, v in self.checkpoint.info.items()},
            "mesh": None if self.mesh is None else self.mesh.as_dict() | {"plan": self.plan},
            "names": self.names,
            "parameters": self.parameters,
            "lora": self.lora,
        }
        if self.stats:
            report["stats"] = self.stats.to_json()
        return report


def inspect_checkpoint(checkpoint: Checkpoint, include: str | None = None, *, with_stats: bool = False,
                       threads: int | None = None, max_memory: int = DEFAULT_MAX_MEMORY,
                       progress: Callable[[int], None] | None = None) -> Inspection:
    """Everything inspect shows of ``checkpoint``; the tensors' values are read only ``with_stats``."""
    tensors, objects = stats.included(checkpoint.tensors, include), stats.included(checkpoint.objects, include)
    files = checkpoint.data_files()
    ranks_recorded = any(chunks.ranks_recorded(t.chunks) for t in checkpoint.tensors.values())
    inferred = None
    if ranks_recorded:  # the planning layers, imported only for checkpoints that record their saving ranks
        from dcptool.planning import resharding

        inferred = resharding.infer_mesh(checkpoint)
    found = Inspection(checkpoint, tensors, objects, files, sum(checkpoint.files.size(f) for f in files),
                       ranks_recorded, inferred[0] if inferred else None, inferred[1].name if inferred else None,
                       naming(checkpoint), stats.parameter_counts(checkpoint, tensors), lora=adapters_of(checkpoint))
    if with_stats:
        found.stats = stats.compute(checkpoint, tensors, max_memory=max_memory, threads=threads, progress=progress)
    return found


def naming(checkpoint: Checkpoint) -> dict | None:
    """The naming family and model kind of the model weights (``dcptool.families``), or None for names no table knows."""
    params = selection.model_part(checkpoint)
    try:  # a peft model's: the base model's names, without peft's wrapping
        params = getattr(lora.find(params), "base", params)
    except UsageError:
        pass
    family = families.detect(params)
    if family is None:
        return None
    config_dir = checkpoint.info.get("hf_config_dir")
    try:
        kind = families.kind_of(params, family, selection.read_config(config_dir) if config_dir else None)
    except UsageError:  # a model type with no table: the family is still worth showing
        kind = None
    return {"family": family.name, "kind": kind}


def adapters_of(checkpoint: Checkpoint) -> dict | None:
    """A peft model's adapters: names, rank per module, target modules, and lora_alpha where an
    ``adapter_config.json`` beside the checkpoint says it (None: not a peft model's weights)."""
    try:
        found = lora.find(selection.model_part(checkpoint), str(checkpoint.root), require_base=False)
        if found is None or not found.targets:
            return None
        given = lora.settings(checkpoint, None, None)
    except UsageError as exc:
        return {"problem": str(exc)}
    return lora.describe(found, given)
