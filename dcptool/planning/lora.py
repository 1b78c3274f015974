"""LoRA (peft) in checkpoints: peft's names found, adapters merged into their base weights as computed views,
or written as a PEFT adapter folder.

peft wraps the model: keys gain ``base_model.model.`` in front, a targeted layer's weight becomes
``<module>.base_layer.weight`` and its adapter adds ``<module>.lora_A.<adapter>.weight`` [r, in] and
``<module>.lora_B.<adapter>.weight`` [out, r] (embeddings: ``lora_embedding_A.<adapter>`` [r, vocab] and
``lora_embedding_B.<adapter>`` [dim, r]); ``modules_to_save`` keeps ``<module>.original_module.*`` and the
trained ``<module>.modules_to_save.<adapter>.*``; DoRA adds ``lora_magnitude_vector.<adapter>.weight`` [out].

A merged weight is ``W + s * B @ A`` (``(B @ A).T`` for embeddings and ``fan_in_fan_out`` layers), ``s`` being
``lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``); DoRA's is ``m * (W + s B A) / ||W + s B A||``, the norm
taken over each output row. It is a tensor whose regions are computed when read (``TensorInfo.transform``),
in float32 from the regions of W, A and B, then rounded to the output dtype as torch rounds: nothing is
materialized, so every command streams it within ``--max-memory``.

>>> found = find(model_part(open_checkpoint("step-100")))                      # doctest: +SKIP
>>> found.adapters, found.ranks()["model.layers.0.self_attn.q_proj"]           # doctest: +SKIP
(['default'], 8)
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcptool import dtypes, families, models
from dcptool.engine.core import Checkpoint, Computed, TensorInfo, float32_region
from dcptool.errors import UsageError, option
from dcptool.storage import CheckpointFiles, is_remote
from dcptool.engine.transfer import slabs

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
# Bytes of float32 temporaries per element of a merged block (W, B @ A, their sum, the rounding's)
WORK_BYTES = 32
# <module>.<part>.<adapter>[.weight]: peft's adapter tensors (embedding ones are parameters, no .weight)
# (an adapter folder's names have no adapter name: peft loads them as "default")
_PART = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
                   r"(?:\.(?!weight$)(?P<adapter>[^.]+))?(?:\.weight)?$")
DEFAULT_ADAPTER = "default"
_SAVED = re.compile(r"^(?P<module>.+)\.modules_to_save\.(?P<adapter>[^.]+)\.(?P<rest>.+)$")
_ORIGINAL = re.compile(r"^(?P<module>.+)\.original_module\.(?P<rest>.+)$")
_MARKS = (".lora_", ".base_layer.", ".modules_to_save.", ".original_module.")
_BASE_LAYERS = re.compile(r"(\.base_layer)+\.")  # peft nests parameter wrappers: experts.base_layer.base_layer.w
_WRAPPERS = re.compile(r"(\.base_layer)+$")


@dataclass
class Pair:
    """One adapter on one layer: ``a`` [r, in] and ``b`` [out, r] (embeddings: [r, vocab] and [dim, r]); on
    grouped experts [E, out, in] (peft's ``target_parameters``), ``a`` [r*E, in] and ``b`` [out, r*E]."""

    a: TensorInfo | None = None
    b: TensorInfo | None = None
    embedding: bool = False
    magnitude: TensorInfo | None = None  # DoRA
    module: str = ""  # peft's module path (``...experts.base_layer`` for a nested parameter wrapper)
    experts: int = 0  # grouped experts: how many (0: a plain layer)
    swapped: bool = True  # grouped experts stored [E, out, in] (transformers v5), else [E, in, out]

    @property
    def rank(self) -> int:
        return self.a.shape[0] // (self.experts or 1)


@dataclass
class Found:
    """A peft-wrapped model's weights: the base model's under its own names (``modules_to_save``'s trained
    copies in place of the originals), and the adapters on each targeted weight."""

    base: dict[str, TensorInfo]
    targets: dict[str, dict[str, Pair]]  # base weight name -> adapter -> its pair
    saved: dict[str, TensorInfo] = field(default_factory=dict)  # modules_to_save's weights, by base name
    adapters: list[str] = field(default_factory=list)

    def modules(self) -> list[str]:
        return [name.removesuffix(".weight") for name in self.targets]

    def ranks(self) -> dict[str, int]:
        """The rank of each targeted module (the first adapter's)."""
        return {name.removesuffix(".weight"): next(iter(pairs.values())).rank for name, pairs in self.targets.items()}

    def target_modules(self) -> list[str]:
        """The targeted modules' last names (peft's ``target_modules``: ``q_proj``, ``embed_tokens``); grouped
        experts' parameters are ``target_parameters``."""
        return sorted({name.removesuffix(".weight").rsplit(".", 1)[-1] for name, pairs in self.targets.items()
                       if not next(iter(pairs.values())).experts})

    def target_parameters(self) -> list[str]:
        """peft's ``target_parameters``: grouped experts' parameters (``mlp.experts.gate_up_proj``)."""
        return sorted({".".join(name.split(".")[-3:]) for name, pairs in self.targets.items()
                       if next(iter(pairs.values())).experts})

    def saved_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 2)[-2] for name in self.saved})

    @property
    def dora(self) -> bool:
        return any(pair.magnitude is not None for pairs in self.targets.values() for pair in pairs.values())


def is_peft(names) -> bool:
    """Whether these model names are a peft-wrapped model's."""
    return any(name.startswith(PEFT_PREFIX) or any(mark in name for mark in _MARKS) for name in names)


def find(named: dict[str, TensorInfo], where: str = "", require_base: bool = True) -> Found | None:
    """The peft structure of a model's weights (``selection.model_part``), None when they are not peft's.
    ``require_base``: every targeted weight must be there (False: an adapter folder's, which holds none)."""
    if not is_peft(named):
        return None
    base: dict[str, TensorInfo] = {}
    modules: dict[str, dict[str, Pair]] = {}
    saved: dict[str, dict[str, TensorInfo]] = {}
    originals: dict[str, TensorInfo] = {}
    adapters: dict[str, None] = {}
    for key, tensor in named.items():
        name = key.removeprefix(PEFT_PREFIX)
        part = _PART.match(name)
        if part:
            adapter = part["adapter"] or DEFAULT_ADAPTER
            adapters[adapter] = None
            pair = modules.setdefault(part["module"], {}).setdefault(adapter, Pair(module=part["module"]))
            kind = part["part"]
            if kind == "lora_magnitude_vector":
                pair.magnitude = tensor
            else:
                pair.embedding = kind.startswith("lora_embedding")
                setattr(pair, kind[-1].lower(), tensor)
            continue
        if (match := _SAVED.match(name)) is not None:
            adapters[match["adapter"]] = None
            saved.setdefault(f"{match['module']}.{match['rest']}", {})[match["adapter"]] = tensor
            continue
        if (match := _ORIGINAL.match(name)) is not None:
            originals[f"{match['module']}.{match['rest']}"] = tensor
            continue
        name = _BASE_LAYERS.sub(".", name)
        if ".lora_" in name:
            raise UsageError(f"{where}: {key} is a LoRA tensor dcptool does not know (lora_A/B, lora_embedding_A/B "
                             "and lora_magnitude_vector weights are)")
        base[name] = tensor
    for name, copies in saved.items():
        if len(copies) > 1:
            raise UsageError(f"{where}: {name} is saved by {len(copies)} adapters ({', '.join(copies)}) in "
                             "modules_to_save: which replaces the model's is not known")
    base |= {name: original for name, original in originals.items() if name not in saved}
    base |= {name: next(iter(copies.values())) for name, copies in saved.items()}
    targets: dict[str, dict[str, Pair]] = {}
    for module, pairs in modules.items():
        for adapter, pair in pairs.items():
            name = _target(module, pair, base, where) if require_base else module + ".weight"
            _check_pair(name, adapter, pair, base.get(name), where, require_base)
            if adapter in targets.setdefault(name, {}):
                raise UsageError(f"{where}: two LoRA layers of adapter {adapter!r} on {name}")
            targets[name][adapter] = pair
    return Found(base, targets, {name: base[name] for name in saved}, list(adapters))


def _target(module: str, pair: Pair, base: dict[str, TensorInfo], where: str) -> str:
    """The base weight a module's adapter changes: ``<module>.weight``, or for peft's parameter wrappers on
    grouped experts, the one [E, ., .] parameter of the wrapped module whose shape fits (``pair.experts`` and
    ``pair.swapped`` set)."""
    owner = _WRAPPERS.sub("", module)
    if owner + ".weight" in base or pair.a is None or pair.b is None:
        return owner + ".weight"
    fits = []
    for name, tensor in base.items():
        if name.rpartition(".")[0] != owner or len(tensor.shape) != 3 or pair.a.shape[0] % tensor.shape[0]:
            continue
        experts, first, second = tensor.shape
        if (pair.b.shape[0], pair.a.shape[1]) == (first, second):
            fits.append((name, experts, True))
        elif (pair.b.shape[0], pair.a.shape[1]) == (second, first):
            fits.append((name, experts, False))
    if len(fits) != 1:
        raise UsageError(f"{where}: {module}'s LoRA weights {list(pair.a.shape)} and {list(pair.b.shape)} fit "
                         f"{'no' if not fits else 'more than one'} weight of {owner}")
    name, pair.experts, pair.swapped = fits[0]
    return name


def _check_pair(name: str, adapter: str, pair: Pair, weight: TensorInfo | None, where: str,
                require_base: bool) -> None:
    module = name.removesuffix(".weight")
    if pair.a is None or pair.b is None:
        raise UsageError(f"{where}: {module} has lora_{'B' if pair.a is not None else 'A'} of adapter {adapter!r} "
                         "without its other half")
    if weight is None and require_base:
        raise UsageError(f"{where}: {module} has LoRA weights of adapter {adapter!r} but no base weight {name}")
    a, b = pair.a.shape, pair.b.shape
    if pair.experts:
        if pair.magnitude is not None or pair.embedding:
            raise UsageError(f"{where}: {module}: DoRA on grouped experts is not supported")
        return
    if len(a) != 2 or len(b) != 2 or a[0] != b[1] or (weight is not None and len(weight.shape) != 2):
        on = f" on {list(weight.shape)}" if weight is not None else ""
        raise UsageError(f"{where}: {module}'s LoRA weights {list(a)} and {list(b)}{on} are neither a layer's nor "
                         "grouped experts'")
    product = (a[1], b[0]) if pair.embedding else (b[0], a[1])
    if weight is not None and product not in (tuple(weight.shape), tuple(weight.shape)[::-1]):
        raise UsageError(f"{where}: {module}'s LoRA weights {list(a)} and {list(b)} do not fit its weight "
                         f"{list(weight.shape)}")
    if pair.magnitude is not None and pair.embedding:
        raise UsageError(f"{where}: {module}: DoRA on an embedding is not supported; merge it with peft")


# ---------------------------------------------------------------------------------------------------------
# Settings: alpha, rsLoRA, DoRA, fan_in_fan_out (adapter_config.json)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    """An adapter's settings as peft's ``adapter_config.json`` holds them; ``where`` says where they came from."""

    alpha: float | None = None
    rslora: bool = False
    fan_in_fan_out: bool = False
    alpha_pattern: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the whole adapter_config.json read, for the adapter export
    where: str | None = None

    def scaling(self, module: str, rank: int) -> float:
        """peft's ``scaling``: ``lora_alpha / r`` (rsLoRA ``/ sqrt(r)``), alpha per module from ``alpha_pattern``."""
        alpha = next((value for key, value in self.alpha_pattern.items()
                      if re.match(rf"(.*\.)?({key})$", module)), self.alpha)
        return alpha / (math.sqrt(rank) if self.rslora else rank)


def config_file(checkpoint: Checkpoint) -> Path | str | None:
    """The ``adapter_config.json`` a checkpoint comes with: the adapter folder's of a base model with an adapter
    put on it (``with_adapter``), else in the folder its reader found the model's config in, in the checkpoint's
    folder or its ``huggingface/``, or the folder above and its ``huggingface/``."""
    if checkpoint.info.get("adapter_config"):
        return checkpoint.info["adapter_config"]
    places = [checkpoint.info.get("hf_config_dir")]
    if not is_remote(checkpoint.root):
        root = Path(checkpoint.root)
        folder = root if root.is_dir() else root.parent
        places += [folder, folder / "huggingface", folder.parent, folder.parent / "huggingface"]
    for place in places:
        if place is not None and CheckpointFiles(place).is_file(CONFIG_FILE):
            return f"{str(place).rstrip('/')}/{CONFIG_FILE}"
    return None


def settings(checkpoint: Checkpoint, config: str | Path | None, alpha: float | None) -> Settings:
    """The adapter's settings: from ``config`` (``--lora-config``), else the ``adapter_config.json`` beside the
    checkpoint; ``alpha`` (``--lora-alpha``) overrides its ``lora_alpha``."""
    path = config or config_file(checkpoint)
    found = Settings()
    if path is not None:
        files = CheckpointFiles(Path(path).parent if not is_remote(path) else str(path).rsplit("/", 1)[0])
        name = Path(str(path)).name
        if not files.is_file(name):
            raise UsageError(f"{path}: no such file ({option('lora_config')} names a peft adapter_config.json)")
        try:
            data = json.loads(files.read_all(name))
        except ValueError as exc:
            raise UsageError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("peft_type", "LORA") != "LORA":
            raise UsageError(f"{path}: not a LoRA adapter_config.json (peft_type {data.get('peft_type')!r})"
                             if isinstance(data, dict) else f"{path}: not a JSON object")
        found = Settings(data.get("lora_alpha"), bool(data.get("use_rslora")), bool(data.get("fan_in_fan_out")),
                         dict(data.get("alpha_pattern") or {}), data, str(path))
    if alpha is not None:
        found.alpha, found.where = alpha, option("lora_alpha")
    if found.alpha is not None and (isinstance(found.alpha, bool) or not isinstance(found.alpha, (int, float))):
        raise UsageError(f"{found.where}: lora_alpha is {found.alpha!r}, not a number")
    return found


def require_alpha(found: Settings, root) -> None:
    """Refuse, naming the options that give it, when lora_alpha is not known."""
    if found.alpha is None:
        where = found.where or f"{root}: no {CONFIG_FILE} beside the checkpoint"
        raise UsageError(f"{where}: lora_alpha is not known; give the adapter's config with {option('lora_config')} "
                         f"or the value with {option('lora_alpha')}")


# ---------------------------------------------------------------------------------------------------------
# Merging: a computed view
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Delta:
    """``scaling * B @ A`` of one adapter, transposed for embeddings and ``fan_in_fan_out`` layers; on grouped
    experts, expert ``e``'s ``B[:, :, e] @ A[e]`` with A as [E, r, in] and B as [out, r, E] (peft's ``ParamWrapper``)."""

    a: TensorInfo
    b: TensorInfo
    scaling: float
    transposed: bool
    experts: int = 0
    swapped: bool = True

    def region(self, checkpoint: Checkpoint, offsets, sizes, scratch) -> np.ndarray:
        """The region of the delta at ``offsets`` of ``sizes``, float32."""
        if self.experts:
            return self._experts_region(checkpoint, offsets, sizes, scratch)
        (row0, col0), (rows, cols) = offsets, sizes
        rank = self.a.shape[0]
        if self.transposed:  # delta[i, j] = (B @ A)[j, i]
            b = _float32(checkpoint, self.b, (col0, 0), (cols, rank), scratch)
            a = _float32(checkpoint, self.a, (0, row0), (rank, rows), scratch)
            return _product(b, a).T * np.float32(self.scaling)
        b = _float32(checkpoint, self.b, (row0, 0), (rows, rank), scratch)
        a = _float32(checkpoint, self.a, (0, col0), (rank, cols), scratch)
        return _product(b, a) * np.float32(self.scaling)

    def _experts_region(self, checkpoint, offsets, sizes, scratch) -> np.ndarray:
        (first, out0, in0), (count, outs, ins) = offsets, sizes
        if not self.swapped:  # [E, in, out]
            (in0, out0), (ins, outs) = (out0, in0), (outs, ins)
        rank, total = self.a.shape[0] // self.experts, self.a.shape[0]
        a = _float32(checkpoint, self.a, (first * rank, in0), (count * rank, ins), scratch).reshape(count, rank, ins)
        b = _float32(checkpoint, self.b, (out0, 0), (outs, total), scratch).reshape(outs, rank, self.experts)
        b = b[:, :, first:first + count]
        layout = "ore,eri->eoi" if self.swapped else "ore,eri->eio"
        return np.einsum(layout, b, a, optimize=False) * np.float32(self.scaling)


def _product(b: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``b @ a`` in numpy's own loops: BLAS's threads, started in each of the copy's threads, spin against each
    other (ten times the CPU of a rank-16 product on 2 cores)."""
    return np.einsum("ir,rj->ij", b, a, optimize=False)


@dataclass(frozen=True)
class LoraMerge(Computed):
    """How the regions of a merged weight are computed (a ``TensorInfo.transform``): ``weight`` plus every
    adapter's delta in float32, DoRA's magnitude applied, rounded to ``dtype``."""

    weight: TensorInfo
    deltas: tuple[Delta, ...]
    dtype: str
    magnitude: TensorInfo | None = None  # DoRA (one adapter)

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        """Fill ``out`` (an unsigned view of ``dtype``, shape ``sizes``) with the region at ``offsets``, a block
        at a time: the float32 temporaries of a block take no more than the scratch buffer (``--max-memory``)."""
        for start, block in slabs(tuple(sizes), max(1, len(scratch) // WORK_BYTES)):
            at = tuple(o + s for o, s in zip(offsets, start))
            self._read(checkpoint, at, block, out[tuple(slice(s, s + n) for s, n in zip(start, block))], scratch)

    def _read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        values = self._merged(checkpoint, offsets, sizes, scratch)
        if self.magnitude is not None:
            width = self.weight.shape[1]
            whole = values if sizes[1] == width else self._merged(checkpoint, (offsets[0], 0), (sizes[0], width), scratch)
            norm = np.linalg.norm(whole, axis=1).astype(np.float32)
            magnitude = _float32(checkpoint, self.magnitude, (offsets[0],), (sizes[0],), scratch)
            values = (magnitude / norm)[:, None] * values
        out[...] = dtypes.cast(np.ascontiguousarray(values, np.float32).view(np.uint32), "float32", self.dtype)

    def _merged(self, checkpoint, offsets, sizes, scratch) -> np.ndarray:
        values = _float32(checkpoint, self.weight, offsets, sizes, scratch)
        for delta in self.deltas:
            values = values + delta.region(checkpoint, offsets, sizes, scratch)
        return values


def _float32(checkpoint: Checkpoint, tensor: TensorInfo, offsets, sizes, scratch) -> np.ndarray:
    if tensor.dtype not in dtypes.CASTABLE:
        raise UsageError(f"{checkpoint.root}: {tensor.key} is {tensor.dtype}; LoRA merges float weights")
    return float32_region(checkpoint, tensor, offsets, sizes, scratch, np.empty(sizes, np.float32))


def merged(name: str, weight: TensorInfo, pairs: dict[str, Pair], found: Settings, dtype: str | None,
           where: str) -> TensorInfo:
    """The weight with its adapters merged, a computed view of ``dtype`` (default the weight's)."""
    module = name.removesuffix(".weight")
    dora = [adapter for adapter, pair in pairs.items() if pair.magnitude is not None]
    if dora and len(pairs) > 1:
        raise UsageError(f"{where}: {module} has DoRA adapter {dora[0]!r} and {len(pairs) - 1} more: merge one "
                         "adapter at a time with peft")
    deltas = []
    for pair in pairs.values():
        if pair.experts:
            deltas.append(Delta(pair.a, pair.b, found.scaling(module, pair.rank), False, pair.experts, pair.swapped))
            continue
        transposed = pair.embedding or found.fan_in_fan_out
        shape = (pair.a.shape[1], pair.b.shape[0]) if transposed else (pair.b.shape[0], pair.a.shape[1])
        if shape != tuple(weight.shape):
            raise UsageError(f"{where}: {module}: B @ A is {list(shape)} but the weight is {list(weight.shape)}"
                             + ("" if pair.embedding else f" (check fan_in_fan_out in {found.where or CONFIG_FILE})"))
        deltas.append(Delta(pair.a, pair.b, found.scaling(module, pair.rank), transposed))
    magnitude = pairs[dora[0]].magnitude if dora else None
    if magnitude is not None and (found.fan_in_fan_out or magnitude.shape != (weight.shape[0],)):
        raise UsageError(f"{where}: {module}: DoRA magnitude {list(magnitude.shape)} on a weight of "
                         f"{list(weight.shape)} is not supported")
    out = dtype or weight.dtype
    return TensorInfo(weight.path, out, weight.shape, weight.chunks,
                      transform=LoraMerge(weight, tuple(deltas), out, magnitude))


# ---------------------------------------------------------------------------------------------------------
# The PEFT adapter folder
# ---------------------------------------------------------------------------------------------------------


def adapter_entries(found: Found, renamed) -> dict[str, TensorInfo]:
    """The tensors of ``adapter_model.safetensors`` under peft's names (no adapter name), with the base weight
    names as ``renamed(name, tensor) -> (name, tensor)`` gives them (the HF family's)."""
    [adapter] = found.adapters
    out = {}
    for name, pairs in found.targets.items():
        pair = pairs[adapter]
        hf_name, b = renamed(name, pair.b)
        module = PEFT_PREFIX + (pair.module if hf_name == name else hf_name.removesuffix(".weight"))
        if pair.embedding:
            out[f"{module}.lora_embedding_A"], out[f"{module}.lora_embedding_B"] = pair.a, b
        else:
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = pair.a, b
        if pair.magnitude is not None:
            out[f"{module}.lora_magnitude_vector"] = renamed(name, pair.magnitude)[1]
    for name, tensor in found.saved.items():
        hf_name, tensor = renamed(name, tensor)
        out[PEFT_PREFIX + hf_name] = tensor
    return out


def adapter_config(found: Found, given: Settings, renamed_modules: list[str]) -> dict:
    """``adapter_config.json`` of the adapter folder: the source's settings, with what the weights say."""
    ranks = Counter(found.ranks().values())
    rank = ranks.most_common(1)[0][0]
    layers = [not next(iter(pairs.values())).experts for pairs in found.targets.values()]  # plain layers
    config = dict(given.config)
    config.update({
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": given.alpha,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module, plain in zip(renamed_modules, layers)
                                  if plain}),
        "target_parameters": given.config.get("target_parameters") or found.target_parameters() or None,
        "rank_pattern": {module: r for module, r, plain in zip(renamed_modules, found.ranks().values(), layers)
                         if r != rank and plain},
        "use_rslora": given.rslora,
        "use_dora": found.dora,
        "fan_in_fan_out": given.fan_in_fan_out,
        "modules_to_save": found.saved_modules() or None,
        "base_model_name_or_path": given.config.get("base_model_name_or_path"),
        "inference_mode": True,
    })
    config.setdefault("bias", "none")
    return config


def describe(found: Found, given: Settings) -> dict:
    """What ``inspect`` shows of a peft model's adapters."""
    ranks = found.ranks()
    return {"adapters": found.adapters, "target_modules": found.target_modules(),
            "target_parameters": found.target_parameters(),
            "modules_to_save": found.saved_modules(), "ranks": ranks,
            "rank": sorted(set(ranks.values())), "dora": found.dora,
            "alpha": given.alpha, "alpha_from": given.where, "use_rslora": given.rslora}


# ---------------------------------------------------------------------------------------------------------
# A base model and an adapter folder, as a peft model's state dict (import-hf --lora-adapter)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Elsewhere(Computed):
    """A tensor of another checkpoint (an adapter folder's, written with a base model's): a ``TensorInfo.transform``
    whose regions are that tensor's."""

    checkpoint: Checkpoint
    tensor: TensorInfo

    def read(self, checkpoint: Checkpoint, offsets, sizes, out: np.ndarray, scratch: memoryview) -> None:
        self.checkpoint.read_region(self.tensor, offsets, sizes, out, scratch, passing=True)

    def others(self) -> tuple[Checkpoint, ...]:
        return (self.checkpoint,)


def with_adapter(base: Checkpoint, adapter: Checkpoint, config: dict | None) -> tuple[Checkpoint, list[str]]:
    """``base`` (HF names) with ``adapter`` (a PEFT adapter folder) on it, under the names ``get_model_state_dict``
    gives a peft model (adapter ``default``): what an FSDP job of that model loads. ``config``: the model's
    config.json (a tied output is in the peft model's state dict too; experts an adapter adapts as grouped
    parameters are transformers v5's fused tensors there)."""
    where = str(adapter.root)
    found = find(adapter.tensors, where, require_base=False)
    if found is None or not found.targets:
        raise UsageError(f"{where}: no LoRA weights (lora_A / lora_B) in the adapter folder")
    given = settings(adapter, None, None)
    saved_modules = set(given.config.get("modules_to_save") or [])
    saved = {name: tensor for name, tensor in found.base.items() if name.rsplit(".", 2)[-2] in saved_modules}
    weights = dict(base.tensors)
    pairs = [pairs[DEFAULT_ADAPTER] for pairs in found.targets.values()]
    wrapped = {_WRAPPERS.sub("", pair.module) for pair in pairs} - {name.removesuffix(".weight") for name in weights}
    if any(name.startswith(owner + ".0.") for owner in wrapped for name in weights):  # experts one per tensor
        hub = families.hub()  # fused, as the peft model holds them
        weights = families.rename(weights, hub.name, source=hub.name, config=config, where=str(base.root),
                                  options=families.options_for(hub, {}, None, families.given(hub.name, hf_experts="fused")),
                                  hint="weights of the base model that its kind's table does not name").entries
    for tie in models.active_ties(config):
        if tie.output.hf not in weights and tie.embedding.hf in weights:
            weights[tie.output.hf] = weights[tie.embedding.hf]
    for pair in pairs:  # the adapter's layers on the base model's weights (grouped experts found by their shapes)
        _target(pair.module, pair, weights, where)
    for name in [_WRAPPERS.sub("", pair.module) + ".weight" for pair in pairs if not pair.experts] + list(saved):
        if name not in weights:
            raise UsageError(f"{where}: the adapter has weights for {name}, which the base model {base.root} has not")
    # peft wraps a module once per adapted weight (nested parameter wrappers): its weights sit that deep
    depth = Counter(_WRAPPERS.sub("", pair.module) for pair in pairs)
    tensors: dict[str, TensorInfo] = {}

    def put(key: str, tensor: TensorInfo, source: Checkpoint) -> None:
        key = PEFT_PREFIX + key
        transform = None if source is base else Elsewhere(source, tensor)
        tensors[key] = TensorInfo((key,), tensor.dtype, tensor.shape, tensor.chunks, transform=transform)

    for name, tensor in weights.items():
        module, _, leaf = name.rpartition(".")
        put(f"{module}{'.base_layer' * depth[module]}.{leaf}" if module in depth else
            f"{module}.original_module.{leaf}" if name in saved else name, tensor, base)
    for pair in pairs:
        module = pair.module
        if pair.embedding:
            put(f"{module}.lora_embedding_A.{DEFAULT_ADAPTER}", pair.a, adapter)
            put(f"{module}.lora_embedding_B.{DEFAULT_ADAPTER}", pair.b, adapter)
        else:
            put(f"{module}.lora_A.{DEFAULT_ADAPTER}.weight", pair.a, adapter)
            put(f"{module}.lora_B.{DEFAULT_ADAPTER}.weight", pair.b, adapter)
        if pair.magnitude is not None:
            put(f"{module}.lora_magnitude_vector.{DEFAULT_ADAPTER}.weight", pair.magnitude, adapter)
    for name, tensor in saved.items():
        module, _, leaf = name.rpartition(".")
        put(f"{module}.modules_to_save.{DEFAULT_ADAPTER}.{leaf}", tensor, adapter)
    notes = [f"added adapter {where} as {DEFAULT_ADAPTER!r}: {len(found.targets)} LoRA layers"
             + (f", modules_to_save {', '.join(sorted(saved_modules))}" if saved else "") + ", under peft's names"]
    combined = base.with_entries(tensors, dict(base.objects))
    combined.info["adapter_config"] = config_file(adapter)  # what a later merge of it reads (its lora_alpha)
    return combined, notes
