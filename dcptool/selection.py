"""Which entries of a checkpoint are the model, under which names: the leaf helpers every layer above uses.

The model part is found from the checkpoint's own nesting (AReaL's ``{"dcp": {"model": ...}}``,
``{"model": ..., "optim": ...}``, a model at the top level); wrapper prefixes that torch.compile,
activation checkpointing, FSDP1 and DDP add to parameter names are stripped. ``select`` keeps the
names ``--include`` / ``--exclude`` choose; ``out_tensors`` makes the output entries, cast to ``--dtype``.

>>> unwrapped("module._orig_mod.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.weight")
'model.layers.0.mlp.weight'
>>> select({"a.weight": 1, "a.bias": 2, "b.weight": 3}, r"weight$", r"^b\\.")
{'a.weight': 1}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dcptool import dtypes
from dcptool.engine.core import Checkpoint, OutTensor, TensorInfo, join_path
from dcptool.errors import UsageError, option
from dcptool.storage import CheckpointFiles, is_remote

# Wrappers under which checkpoints nest the model, tried in order; the first that holds tensors is the model part.
MODEL_WRAPPERS: list[tuple[str, ...]] = [("dcp", "model"), ("model",), ("module",), ("state_dict",)]
# Top-level entries that are never model weights when a checkpoint keeps its model at the top level.
NON_MODEL_ROOTS = {"optimizer", "optim", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler",
                   "dataloader", "train_state", "extra_state", "rng", "rng_state"}
OPTIMIZER_ROOTS = {"optimizer", "optim", "optimizers"}
# Prefixes that wrappers add to parameter names (torch.compile, activation checkpointing, FSDP1, DDP).
_WRAPPER_PREFIXES = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.|^module\.")


def unwrapped(name: str) -> str:
    """``name`` without the prefixes wrappers add, however they nest: DDP around a compiled model
    (``module._orig_mod.``), a compiled DDP (``_orig_mod.module.``), FSDP1 around checkpointed layers
    (``_fsdp_wrapped_module._checkpoint_wrapped_module.``); one pass of _WRAPPER_PREFIXES leaves the inner one."""
    while (bare := _WRAPPER_PREFIXES.sub(r"\1", name)) != name:
        name = bare
    return name


def model_part(checkpoint: Checkpoint, prefix: str | None = None, entries: dict | None = None) -> dict:
    """The model's tensors (or, given ``entries``, those entries) under their model names.

    The wrapper is found from the checkpoint's own nesting: ``{"dcp": {"model": {...}}}`` (AReaL)
    and ``{"model": {...}, "optim": ...}`` are unwrapped; a checkpoint with its model at the top
    level keeps it, minus optimizer and other state. ``prefix`` (``"dcp.model"``) names it by hand.
    """
    wrapper = None if prefix else model_wrapper(checkpoint)
    start = prefix.rstrip(".") + "." if prefix else None
    found = {}
    for entry in (checkpoint.tensors if entries is None else entries).values():
        if start:
            key = entry.key[len(start):] if entry.key.startswith(start) else None
        elif wrapper:
            inside = len(entry.path) > len(wrapper) and entry.path[: len(wrapper)] == wrapper
            key = join_path(entry.path[len(wrapper):]) if inside else None
        else:
            # A flat key saved whole (Megatron-Core's "optimizer.state.exp_avg.<name>") has its root before the first dot.
            key = entry.key if str(entry.path[0]).split(".")[0] not in NON_MODEL_ROOTS else None
        if key is not None:
            found[unwrapped(key)] = entry
    if start and entries is None and not found:
        raise UsageError(f"{checkpoint.root}: no tensor key starts with {start!r}")
    return found


def model_wrapper(checkpoint: Checkpoint) -> tuple[str, ...] | None:
    """The wrapper that nests the model's tensors (``("dcp", "model")``), None for a model at the top level."""
    tensors = checkpoint.tensors.values()
    return next((w for w in MODEL_WRAPPERS if any(len(t.path) > len(w) and t.path[: len(w)] == w for t in tensors)),
                None)


def optimizer_root(checkpoint: Checkpoint) -> tuple[str, ...] | None:
    """Where the optimizer state sits: an optimizer root beside the model's wrapper (``("dcp", "optim")``,
    ``("optimizer",)``), None when the checkpoint holds none."""
    beside = (model_wrapper(checkpoint) or ("",))[:-1]
    found = {entry.path[len(beside)] for entry in (*checkpoint.tensors.values(), *checkpoint.objects.values())
             if len(entry.path) > len(beside) + 1 and entry.path[: len(beside)] == beside}
    return next((beside + (root,) for root in sorted(OPTIMIZER_ROOTS & found)), None)


def select(names: dict[str, Any], include: str | None, exclude: str | None) -> dict[str, Any]:
    """Keep the entries whose output name matches ``include`` and not ``exclude`` (regular expressions)."""
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None
    return {k: v for k, v in names.items() if (not inc or inc.search(k)) and not (exc and exc.search(k))}


def out_tensors(named: dict[str, TensorInfo], dtype: str | None, keep_paths: bool) -> list[OutTensor]:
    """Output tensors; ``dtype`` casts floating-point tensors only (integer state such as steps stays)."""
    if dtype and dtype not in dtypes.CASTABLE:
        raise UsageError(f"{option('dtype', dtype)}: choose {', '.join(dtypes.CASTABLE)}")
    result = []
    for key, tensor in named.items():
        target = dtype if dtype and tensor.dtype in dtypes.CASTABLE else tensor.dtype
        path = tensor.path if keep_paths else (key,)
        result.append(OutTensor(key, path, target, tensor.shape, tensor))
    return result


# The files of a model folder that make weights usable by transformers (the model's config, its generation config
# and tokenizer): what export-hf writes beside the weights, and what every output keeps for later commands.
CONFIG_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "chat_template.jinja", "chat_template.json", "preprocessor_config.json"]
ADAPTER_CONFIG = "adapter_config.json"  # a peft adapter's settings (lora_alpha, target modules)


def read_config(config_dir: str | Path) -> dict:
    """The ``config.json`` of a model folder (a path or a URL); a missing or broken file is a usage error naming it."""
    files = CheckpointFiles(config_dir)
    if not files.is_file("config.json"):
        raise UsageError(f"{config_dir}: no config.json ({option('config_dir')} must hold the model's Hugging Face config)")
    text = files.read_all("config.json")  # outside the try: its CheckpointError is a ValueError too
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{files.path('config.json')}: not valid JSON ({exc})") from None


def config_folder(checkpoint: Checkpoint) -> str | Path | None:
    """The folder of the model's ``config.json`` that a checkpoint comes with: the one its reader found
    (verl's ``huggingface/``), else one in or beside it (``config_beside``); None when there is none."""
    return checkpoint.info.get("hf_config_dir") or config_beside(checkpoint.root)


def config_beside(root: str | Path) -> Path | None:
    """The folder of a model's ``config.json`` in or beside a local checkpoint: the checkpoint's folder, its
    ``huggingface/`` (verl), the folder above or that folder's ``huggingface/``; None when there is none."""
    if is_remote(root):
        return None
    folder = Path(root) if Path(root).is_dir() else Path(root).parent
    return next((place for place in (folder, folder / "huggingface", folder.parent, folder.parent / "huggingface")
                 if (place / "config.json").is_file()), None)


@dataclass
class ModelConfig:
    """The model's config that an output keeps: ``folder``'s config.json, generation config and tokenizer files
    (``CONFIG_FILES``), with ``config`` written as config.json instead of the folder's where given (fields the
    command changed; one made from a training run's args, ``folder`` None, said by ``made_from``); and for a peft
    model's checkpoint, the ``adapter`` config file (an ``adapter_config.json``: what a merge needs) beside it.

    >>> ModelConfig(None, {"model_type": "llama"}, made_from="the run's args").files()
    {'config.json': 28}
    """

    folder: str | Path | None
    config: dict | None = None
    made_from: str = ""
    adapter: str | Path | None = None

    def files(self) -> dict[str, int]:
        """The files written, with their sizes in bytes."""
        return {name: len(data) for name, data in self.contents().items()}

    def contents(self) -> dict[str, bytes]:
        """The files written, with their bytes (kilobytes to a few megabytes: a tokenizer)."""
        found = _read_files(self.folder, CONFIG_FILES) if self.folder is not None else {}
        if self.config is not None:
            found["config.json"] = self._config_bytes()
        found = dict(sorted(found.items(), key=lambda item: CONFIG_FILES.index(item[0])))
        if self.adapter is not None:
            where = str(self.adapter)
            folder, _, name = where.rpartition("/") if is_remote(where) else (Path(where).parent, "", Path(where).name)
            found[ADAPTER_CONFIG] = _read_files(folder, [name])[name]
        return found

    def write(self, folder: Path) -> None:
        """Write the files into ``folder`` (made if missing)."""
        folder.mkdir(exist_ok=True)
        for name, data in self.contents().items():
            (folder / name).write_bytes(data)

    def describe(self) -> str:
        """Where it comes from, for a note: the config folder's config.json, or what made it."""
        if self.folder is None:
            return f"made from {self.made_from}"
        return str(CheckpointFiles(self.folder).path("config.json"))

    def _config_bytes(self) -> bytes:
        return (json.dumps(self.config, indent=2) + "\n").encode()


def _read_files(location: str | Path, names: list[str]) -> dict[str, bytes]:
    """The files of ``names`` that the folder at ``location`` (a path or a URL) holds, with their bytes."""
    files = CheckpointFiles(location)
    try:
        return {name: files.read_all(name) for name in names if files.is_file(name)}
    finally:
        files.close()
