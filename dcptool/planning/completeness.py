"""Is an HF-named output the whole model its config describes? Checked before anything is written.

export-hf, import-hf and convert to HF names compare their tensors' names with what the config's model holds:
a part left out (a VL model's vision tower, DeepSeek's prediction layers, an untied model's ``lm_head``, experts,
a norm) would load as random weights without a word from ``from_pretrained``, and a tensor the model has no place
for would be dropped as silently. Either is refused (``errors.IncompleteModelError``, exit 2) naming the parts and
the option that accepts them (``options.Completeness``: ``--allow-missing vision,mtp``, ``--allow-unexpected``).

What the model holds comes from, in this order:

- dcptool's table of the model kind (``ModelKind.hf_weights``: Llama, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE,
  DeepSeek-V3), which tests/test_completeness.py holds equal to what transformers says below: the same answer
  without importing torch and transformers (seconds of start-up, for every export), and the same in an install
  without them;
- transformers, where it is installed and knows the ``model_type``: the model of the config (its
  ``architectures`` class, else the Auto classes') built on the meta device; its state dict less the weights it
  ties to others (recreated from them on load) and those it neither saves nor needs. Each weight counts as present
  under the name the model gives it or under the names ``save_pretrained`` writes (transformers v5 renames keys
  on load and back on save: a Qwen2.5-VL's ``visual.*`` is its model's ``model.visual.*``; per-expert tensors
  are one fused tensor), as ``from_pretrained`` reads either;
- else nothing: one note says that completeness was not checked, and why.

Both add the layers after the main ones that transformers ignores and the kind declares
(``ModelKind.extra_weights``: DeepSeek's prediction layers ``model.layers.{num_hidden_layers + i}``), which
dcptool exports on purpose; the copies of main weights such a layer may repeat (its embedding and head) are
neither required nor unexpected. A quantized model's scales (``weight_scale_inv``, MXFP4's ``_blocks`` and
``_scales``) stand for the weights they quantize.

>>> found = find({"model_type": "qwen3", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
...               "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 10,
...               "tie_word_embeddings": False}, ["model.embed_tokens.weight"])           # doctest: +SKIP
>>> sorted(found.missing), found.source                                                 # doctest: +SKIP
(['layers', 'lm_head', 'norms'], "dcptool's qwen3 table")
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from dcptool import models
from dcptool.errors import IncompleteModelError, UsageError, counted, option, printable
from dcptool.options import Completeness
from dcptool.planning import hf_config

# Names a quantized model's files hold beside or instead of a weight: (pattern, the weight it stands for as a
# substitution; None: a scale beside the weight, which holds no weight of its own).
QUANTIZED = (
    (re.compile(r"^(.+)_blocks$"), r"\1"),  # MXFP4 (GPT-OSS): experts.gate_up_proj_blocks holds gate_up_proj
    (re.compile(r"^.+(_scales|\.weight_scale_inv|\.weight_scale|\.input_scale)$"), None),
)


@dataclass
class Findings:
    """What an output lacks of its model (``missing``: the names, by part of ``models.PARTS``) and what it holds
    beyond it (``unexpected``), as ``source`` says the model holds; ``not_checked``: why nothing could be said."""

    source: str = ""
    missing: dict[str, list[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    not_checked: str | None = None


@dataclass
class Expected:
    """What a model holds: ``required``, each weight by the name the model gives it with the names a checkpoint
    may hold it under instead (all of them: one fused weight is several per-expert tensors); ``owner(name)``: the
    weight a checkpoint's name holds (None: none); ``harmless(name)``: a name that holds no weight the model
    loads and that loading ignores (a recomputed buffer, an output the config ties)."""

    source: str
    required: dict[str, list[str]]
    owner: Callable[[str], str | None]
    harmless: Callable[[str], bool]


def find(config: dict | None, names: Iterable[str]) -> Findings:
    """What the tensors ``names`` (HF names) lack of the model ``config`` describes, and hold beyond it."""
    names = list(names)
    if config is None:
        return Findings(not_checked="no config.json says what the model holds")
    fused = any(name.endswith(".experts.gate_up_proj") for name in names)
    model, why = by_table(config, fused)
    if model is None:
        model, more = by_transformers(config)
        why = f"{why}, and {more}"
    if model is None:
        return Findings(not_checked=why)
    extra, copies = models.extra_weights(config, fused)
    present = set(names)
    whole, unexpected = set(), []
    for name in names:
        held = _stand_in(name, config)
        owner = None if held is None else model.owner(held)
        if owner is not None:
            if held == owner or held not in model.required.get(owner, ()):
                whole.add(owner)  # under the model's own name, or a name that stands for all of it
            present.add(held)
        elif held is not None and name not in extra and name not in copies and not model.harmless(held):
            unexpected.append(name)
    missing = [form for weight, forms in model.required.items() if weight not in whole
               for form in forms if form not in present]
    missing += [name for name in extra if name not in present]
    return Findings(model.source, _by_part(missing, [*(f for forms in model.required.values() for f in forms), *extra],
                                           config), unexpected)


def _by_part(missing: list[str], expected: list[str], config: dict) -> dict[str, list[str]]:
    """``missing`` by part (``models.part_of``); a decoder layer missing whole is one part, ``layers``, rather than
    its norms, experts and the rest apart."""
    def layer(names):
        counts: dict[int, int] = {}
        for name in names:
            number = models.decoder_layer(name)
            if number is not None:
                counts[number] = counts.get(number, 0) + 1
        return counts

    whole = {number for number, count in layer(missing).items() if count == layer(expected)[number]}
    by_part: dict[str, list[str]] = {}
    for name in missing:
        part = models.part_of(name, config)
        if part not in ("vision", "audio", "mtp") and models.decoder_layer(name) in whole:
            part = "layers"
        by_part.setdefault(part, []).append(name)
    return by_part


def check(config: dict | None, names: Iterable[str], completeness: Completeness, where: str, config_where: str,
          excludable: bool = True) -> list[str]:
    """Refuse tensors ``names`` that lack parts of ``config``'s model or hold more, unless ``completeness`` accepts
    them (``IncompleteModelError`` naming the parts and the option); the notes to report: what was accepted, or why
    completeness was not checked. ``where`` names the checkpoint, ``config_where`` the config; ``excludable``: the
    command takes ``--exclude`` (a way to leave unexpected tensors out)."""
    allowed = completeness.parts()
    unknown = [part for part in allowed if part not in models.PARTS]
    if unknown:
        raise UsageError(f"{option('allow_missing', ','.join(unknown))}: no such part; choose from "
                         f"{', '.join(models.PARTS)}")
    found = find(config, names)
    if found.not_checked:
        return [f"completeness not checked: {found.not_checked}"]
    refused = {part: names for part, names in found.missing.items() if part not in allowed}
    model = f"the model {config_where} describes ({found.source})"
    problems = []
    if refused:
        them = "it" if len(refused) == 1 else "them"
        problems.append(f"the output lacks {missing_parts(refused)} of {model}: {_consequence(refused, them)}; "
                        f"accept {them} with {option('allow_missing', ','.join(refused))}")
    if found.unexpected and not completeness.allow_unexpected:
        them = "it" if len(found.unexpected) == 1 else "them"
        leave_out = f"leave {them} out with {option('exclude')} or " if excludable else ""
        problems.append(f"{unexpected_tensors(found.unexpected)} no place in {model}: from_pretrained would drop "
                        f"{them}; {leave_out}keep {them} with {option('allow_unexpected')}")
    if problems:
        raise IncompleteModelError(f"{where}: {'; '.join(problems)}", missing=refused,
                                   unexpected=[] if completeness.allow_unexpected else found.unexpected, path=where)
    notes = [f"{option('allow_missing', part)}: left out {missing_parts({part: names})}: "
             f"{_consequence({part: names}, 'it', would=False)}" for part, names in found.missing.items()]
    if found.unexpected:
        them = "it" if len(found.unexpected) == 1 else "them"
        notes.append(f"{option('allow_unexpected')}: kept {_named(found.unexpected)}, which the model has no place "
                     f"for (from_pretrained drops {them})")
    return notes


def _consequence(missing: dict[str, list[str]], them: str, would: bool = True) -> str:
    """What loading an output that lacks ``missing`` does: transformers builds no prediction layers (an engine that
    runs them finds none), anything else it fills with random weights."""
    if set(missing) == {"mtp"}:
        return f"an engine that runs them (vLLM's or SGLang's MTP) {'would find' if would else 'finds'} none"
    return f"from_pretrained {'would fill' if would else 'fills'} {them} with random weights"


def missing_parts(missing: dict[str, list[str]]) -> str:
    """The parts of ``missing`` (names by part) in words: ``the vision tower (390 tensors, e.g. visual.blocks.0...)``."""
    shown = []
    for part, names in missing.items():
        first = printable(names[0])
        count = f"1 tensor: {first}" if len(names) == 1 else f"{counted(len(names), 'tensor')}, e.g. {first}"
        shown.append(f"the {models.PARTS[part]} ({count})")
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " and " + shown[-1]


def unexpected_tensors(names: list[str]) -> str:
    """``names`` as the subject of "have no place": ``3 tensors, e.g. x.weight, have`` or ``x.weight has``."""
    return f"{_named(names)}{',' if len(names) > 1 else ''} {'has' if len(names) == 1 else 'have'}"


def _named(names: list[str]) -> str:
    """``names`` in a few words: ``x.weight``, or ``3 tensors, e.g. x.weight``."""
    if len(names) == 1:
        return printable(names[0])
    return f"{counted(len(names), 'tensor')}, e.g. {printable(names[0])}"


def _stand_in(name: str, config: dict) -> str | None:
    """The name a tensor holds a weight under: its own, or in a quantized model the weight it quantizes (None: a
    scale beside one, which holds none of its own)."""
    if not config.get("quantization_config") and not models.text_config(config).get("quantization_config"):
        return name
    for pattern, weight in QUANTIZED:
        if pattern.match(name):
            return None if weight is None else pattern.sub(weight, name)
    return name


def by_table(config: dict, fused: bool) -> tuple[Expected | None, str]:
    """What dcptool's table of the config's model kind says the model holds (``fused``: experts in transformers v5's
    fused tensors); (None, why not) without a table."""
    kind = models.kind_of(config)
    if kind is None:
        return None, f"dcptool has no table of model_type {config.get('model_type')!r}"
    try:
        required, optional = hf_config.expected_weights(config, kind, fused)
    except (KeyError, TypeError) as exc:
        return None, f"the {kind.name} config has no usable {exc} for dcptool's table"
    known = {**required, **optional}
    return Expected(f"dcptool's {kind.name} table", {name: [name] for name in required},
                    lambda name: name if name in known else None,
                    lambda name: bool(hf_config.RECOMPUTED.search(name))), ""


def by_transformers(config: dict) -> tuple[Expected | None, str]:
    """What the model transformers builds from ``config`` holds; (None, why not) where it cannot say."""
    if importlib.util.find_spec("transformers") is None:
        return None, "transformers is not installed"
    try:
        return _built(json.dumps(config, sort_keys=True)), ""
    except _Unknown as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot build a model of: not checked, and why
        return None, f"transformers could not build its model ({type(exc).__name__}: {printable(str(exc), 120)})"


class _Unknown(Exception):
    """transformers cannot build the config's model (why, in words)."""


@functools.lru_cache(maxsize=4)
def _built(config_json: str) -> Expected:
    """``by_transformers`` of a config (as sorted JSON: one model built per config in a process)."""
    import torch
    import transformers

    config = json.loads(config_json)
    version = f"transformers {transformers.__version__}"
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise _Unknown(f"{version} has no model of model_type {model_type!r}")
    with _quiet(transformers):
        settings = transformers.CONFIG_MAPPING[model_type].from_dict(config)
        model = _instantiate(transformers, torch, settings, config.get("architectures") or [])
    if model is None:
        raise _Unknown(f"{version} builds no model of model_type {model_type!r} from its Auto classes")
    state = model.state_dict()
    ignored = [*(model._keys_to_ignore_on_save or ()), *(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())]
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    required = [name for name in state if name not in tied and not any(re.search(p, name) for p in ignored)]
    to_model = _load_names(model, state)
    forms: dict[str, list[str]] = {}
    for saved in _saved_names(model, {name: state[name] for name in required}):
        forms.setdefault(to_model(saved), []).append(saved)
    buffers = {name for name, _ in model.named_buffers()} - set(state)  # non-persistent: recomputed

    def owner(name: str) -> str | None:
        held = to_model(name)
        return held if held in state else None

    return Expected(f"{version}'s {type(model).__name__}", {name: forms.get(name, [name]) for name in required},
                    owner, lambda name: to_model(name) in buffers or bool(hf_config.RECOMPUTED.search(name)))


def _instantiate(transformers, torch, settings, architectures: list[str]):
    """The model of ``settings`` on the meta device: the config's first architecture, else the first Auto class
    that takes it (a causal LM, an image-text-to-text model, a base model); None where none does."""
    named = getattr(transformers, architectures[0], None) if architectures else None
    candidates = [named._from_config] if named is not None else []
    candidates += [getattr(transformers, auto).from_config for auto in
                   ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")]
    for build in candidates:
        try:
            with torch.device("meta"):
                return build(settings)
        except (ValueError, KeyError, ImportError):
            continue
    return None


def _load_names(model, state: dict) -> Callable[[str], str]:
    """``name -> the model's name of it``, as ``from_pretrained`` renames a checkpoint's keys (transformers v5's
    conversion mapping: renamings, converters, the base model's prefix added or dropped); the names as they are
    where this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return lambda name: name
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]

    @functools.cache
    def to_model(name: str) -> str:
        renamed, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
        return name if renamed not in state and name in state else renamed
    return to_model


def _saved_names(model, state: dict) -> list[str]:
    """The names ``save_pretrained`` writes ``state`` under (transformers v5 reverts its load-time renaming)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion

        return list(revert_weight_conversion(model, dict(state)))
    except Exception:  # noqa: BLE001 - an older transformers, or a conversion meta tensors cannot run: the model's names
        return list(state)


@contextlib.contextmanager
def _quiet(transformers):
    """transformers' warnings and logs held back while a model is only built to be looked at."""
    import warnings

    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.set_verbosity(level)
