"""The tensor- and expert-parallel plans transformers declares for its models, read from transformers or a snapshot.

Every transformers model declares how a job splits it: ``base_model_tp_plan`` and ``base_model_ep_plan`` on its
config class (names relative to the base model), the class's own ``_tp_plan`` (``lm_head``), and the input
embedding's vocabulary split that transformers adds to every plan. The model resolves them into one plan of
names relative to the class a checkpoint saves (``model.layers.*.self_attn.q_proj: colwise``), its ``tp_plan``
and ``ep_plan``. They are read here by building that model on the meta device from the checkpoint's
``config.json`` when transformers is installed, else taken from ``transformers_plans.json``, the snapshot
``scripts/transformers_plans.py`` writes from an installed transformers (its version named in it), so an install
without transformers has them too. The model's persistent buffers are recorded beside the plans: FSDP2 leaves
buffers whole, so a job's layout depends on which tensors they are.

Nothing of dcptool is imported here, and transformers and torch only when a plan is read from them.

>>> plan = plan_of({"model_type": "qwen3_next"})     # doctest: +SKIP
>>> plan.tp["model.layers.*.linear_attn.in_proj_qkvz"], plan.source   # doctest: +SKIP
('colwise_gather_output', 'transformers 5.24.0')
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import re
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("transformers_plans.json")


@dataclass(frozen=True)
class TransformersPlan:
    """A model's plans as transformers resolves them: ``tp`` and ``ep`` map a module or parameter name, with ``*``
    for layer numbers, to a parallel style; ``buffers``: its persistent buffers in the same form; ``model_class``:
    the class whose names they use; ``source``: where they were read (``transformers 5.24.0``, or dcptool's
    snapshot of it)."""

    model_type: str
    model_class: str
    tp: dict[str, str]
    ep: dict[str, str]
    buffers: tuple[str, ...] = ()
    source: str = ""

    def as_json(self) -> dict:
        """The snapshot's record of it."""
        return {"class": self.model_class, "tp": self.tp, "ep": self.ep, "buffers": list(self.buffers)}


@dataclass
class Snapshot:
    """``transformers_plans.json``: the plans of every model type of one transformers version."""

    transformers: str
    models: dict[str, TransformersPlan] = field(default_factory=dict)


def wildcard(name: str) -> str:
    """``name`` with its layer numbers as ``*``, as transformers matches names against its plans."""
    return re.sub(r"\.\d+(\.|$)", lambda match: ".*" + match.group(1), name)


def plan_of(config: dict | None) -> TransformersPlan | None:
    """The plans of the model ``config`` (a config.json) describes, None when nothing knows its ``model_type``.

    The installed transformers decides; its plans are read from the snapshot when it was written from this very
    version for the class the config names (building a model takes seconds), else from a model built from the
    config. Without transformers (or torch), the snapshot's plans, whatever version wrote them.
    """
    model_type = (config or {}).get("model_type")
    if not isinstance(model_type, str):
        return None
    shipped = snapshot()
    recorded = shipped.models.get(model_type)
    architectures = (config or {}).get("architectures") or []
    same_class = recorded is not None and (not architectures or architectures[0] == recorded.model_class)
    installed = _installed_version()
    if installed is not None and not (installed == shipped.transformers and same_class):
        found = from_transformers(json.dumps(config, sort_keys=True))
        if found is not None:
            return found
    return recorded


def _installed_version() -> str | None:
    """The installed transformers' version, read without importing it; None when it is not installed."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def snapshot() -> Snapshot:
    """The shipped snapshot (empty when the file is missing)."""
    if not SNAPSHOT.is_file():
        return Snapshot("")
    data = json.loads(SNAPSHOT.read_text())
    source = f"dcptool's snapshot of transformers {data['transformers']}"
    return Snapshot(data["transformers"], {
        model_type: TransformersPlan(model_type, record["class"], record["tp"], record["ep"], tuple(record["buffers"]),
                                     source)
        for model_type, record in data["models"].items()})


@cache
def from_transformers(config_json: str) -> TransformersPlan | None:
    """The plans the installed transformers resolves for the config (JSON text, so that it caches): None when
    transformers or torch is not installed, or does not know the model type or cannot build it."""
    try:
        import torch  # noqa: F401  (transformers builds models only with it)
        import transformers
    except ImportError:
        return None
    config = json.loads(config_json)
    try:
        with _quiet(transformers):
            return read_model(transformers, config["model_type"], config)
    except Exception:  # noqa: BLE001 (a config this transformers cannot build a model of: the snapshot may know it)
        return None


def read_model(transformers, model_type: str, config: dict | None = None) -> TransformersPlan | None:
    """Build the model of ``model_type`` (from ``config``, else the config class's defaults) on the meta device and
    read its resolved plans and buffers; None when transformers has no model class for the type.

    The classes a checkpoint may come from are tried in turn (``_model_classes``); the first that builds is read,
    and when none does, the last one's error is raised.
    """
    import torch
    from transformers.models.auto.configuration_auto import (
        CONFIG_MAPPING,
        CONFIG_MAPPING_NAMES,
    )

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    config_class = CONFIG_MAPPING[model_type]
    error = None
    for model_class in _model_classes(transformers, model_type, (config or {}).get("architectures")):
        hf_config = config_class.from_dict(config) if config else config_class()
        try:
            with torch.device("meta"):
                model = model_class._from_config(hf_config)
        except Exception as exc:  # noqa: BLE001 (a class taking another config: a composite's text-only class)
            error = exc
            continue
        parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
        buffers = sorted({wildcard(name) for name in model.state_dict() if name not in parameters})
        return TransformersPlan(model_type, model_class.__name__, dict(model.tp_plan or {}),
                                dict(model.ep_plan or {}), tuple(buffers), f"transformers {transformers.__version__}")
    if error is not None:
        raise error
    return None


def _model_classes(transformers, model_type: str, architectures) -> list[type]:
    """The classes a checkpoint of ``model_type`` is saved from, most likely first: the config's architectures,
    then its causal LM, image-text-to-text and base model classes."""
    from transformers.models.auto import modeling_auto

    names = [name for name in architectures or [] if isinstance(name, str)]
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
                    "MODEL_MAPPING_NAMES"):
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, str):
            names.append(name)
    classes = [getattr(transformers, name, None) for name in dict.fromkeys(names)]
    return [found for found in classes if isinstance(found, type) and hasattr(found, "_from_config")]


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' warnings and logs silenced while a model is built only to read its plans."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
