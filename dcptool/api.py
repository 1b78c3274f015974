"""dcptool as a Python library: open a checkpoint and read its tensors, or run a command as a function.

This module is the one orchestrator of the commands: each function does what the ``dcptool``
command of the same name does and returns the report that the command prints instead of printing
it; the command line only parses options, builds the objects below from them, calls these and renders.

Options come as objects (``dcptool.options``, all re-exported by ``dcptool``): ``Reading`` for how the
sources are read (``--from``, ``--revision``: always the source's hub revision, ``--no-verify-records``,
``--dequantize``, ``--max-memory``, the progress bar), ``Writing`` for how an output is written
(``--overwrite``, ``--no-fsync``, ``--dry-run``), ``Selection`` (``--include``, ``--exclude``, ``--prefix``),
``MeshOptions`` for the mesh of a reshard (``--dp``, ``--tp``, ... ``--plan``), and the options of one output
format, built by name (``format_options("fsdp1", optim_form="flat")``: fsdp1's ``--world-size``,
``--keep-rank-state``, ``--optim-form``, ``--model-values``, dcp's ``--compress``, hf's ``--max-shard-size``).
``family`` is a naming family of tensor names (hf, archon, torchtitan, megatron; the flag ``--adapter``).
Sizes are bytes or text such as ``"256MiB"`` or ``"5GB"``.

Bad input raises the exceptions of ``dcptool.errors``: ``CheckpointError`` for a checkpoint that cannot be
read, ``UsageError`` for options that cannot work together (the command exits 2 for both); a message names
an option as the caller passed it (``mesh.tp=3``, ``reading.max_memory='12XB'``; on the command line ``--tp
3``). An option a command does not take (``reading.dequantize`` of ``verify``) is refused. A check that finds
a difference is not an error here: look at ``report.equal`` (verify) or ``result.ok`` (checksum,
``verify(load_on=...)``). Every record read (``torch.save`` archives: DCP chunks and objects, ``torch.save``
and FSDP1 files) is checked as torch would check it, and its CRC-32s as its bytes pass: a damaged one raises
``CheckpointError``; ``Reading(verify_records=False)`` skips that, for a caller who accepts the risk.

Nothing here imports torch unless asked to (``read(..., as_torch=True)``, ``verify(load_on=...)``).

>>> import tempfile, numpy as np, safetensors.numpy, dcptool
>>> folder = tempfile.mkdtemp()
>>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
>>> dcptool.reshard(folder, f"{folder}-dp2", mesh=dcptool.MeshOptions(dp=2),
...                 writing=dcptool.Writing(dry_run=True)).planned_files
{'__0_0.distcp': 24, '__1_0.distcp': 24}
"""

from __future__ import annotations

import dataclasses
import functools
import re
from contextlib import contextmanager
from inspect import signature
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from dcptool import errors, formats
from dcptool.storage import hub
from dcptool.planning.conversion import Conversion, Report
from dcptool.engine.core import Checkpoint
from dcptool.errors import UsageError, option
from dcptool.family_interface import FamilyOptions
from dcptool.format_interface import FormatOptions, OutputRequest
from dcptool.options import (LORA_MODES, Completeness, HubPush, LoadOn, Lora, MeshOptions, Options, Progress,
                             Quantize, Reading,
                             Selection, Side, Tolerance, Writing)
from dcptool.reader import Reader, Region, TensorSpec, open  # noqa: A004 - dcptool.open, as builtins.open opens a file
from dcptool.storage import check_apart, check_destination, is_remote, output_path

if TYPE_CHECKING:
    from dcptool.checks.checksums import Result
    from dcptool.arithmetic.difference import Report as DiffReport
    from dcptool.checks.integrity import Report as CheckReport
    from dcptool.checks.inspection import Inspection
    from dcptool.checks.layout import Layout
    from dcptool.checks.loadcheck import LoadReport
    from dcptool.planning.resharding import ReshardPlan, ReshardReport
    from dcptool.checks.verification import Report as VerifyReport

__all__ = ["open", "Reader", "TensorSpec", "Region", "inspect", "tensor_layout", "convert", "export_hf", "import_hf", "reshard",
           "verify", "checksum", "check", "average", "diff", "format_options", "family_options", "Reading", "Writing",
           "Selection", "MeshOptions", "Completeness", "Lora", "Quantize", "HubPush", "Tolerance", "Side", "LoadOn"]


def _command(command: Callable) -> Callable:
    """An API command: while it runs, messages name its options as its caller passes them (an option object's
    field by the keyword the object came as: ``mesh.tp=3``; ``errors.option``), and the checkpoints it opens
    check their records unless ``reading.verify_records`` is False."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        reading = kwargs.get("reading") or Reading()
        with errors.options_as_keywords(_keywords(command)), formats.records_checked(reading.verify_records):
            return command(*args, **kwargs)
    return run


@functools.cache
def _keywords(command: Callable) -> dict[str, str]:
    """The message key of each field of ``command``'s option objects -> that field as its caller names it
    (``tp`` -> ``mesh.tp``). A key that is also one of the command's own keywords stays that keyword, and the
    first object to take a key keeps it (a reshard's ``world_size`` is its mesh's)."""
    parameters = signature(command).parameters
    found: dict[str, str] = {}
    for name, parameter in parameters.items():
        for kind in _option_classes(str(parameter.annotation)):
            for key, field in kind.keys(name).items():
                if key not in parameters:
                    found.setdefault(key, field)
    return found


def _option_classes(annotation: str) -> list[type[Options]]:
    """The option classes an annotation names (``MeshOptions | None``); ``FormatOptions`` stands for every format's,
    ``FamilyOptions`` for every naming family's."""
    named = [globals()[word] for word in re.findall(r"\w+", annotation)
             if isinstance(globals().get(word), type) and issubclass(globals()[word], Options)]
    if FormatOptions in named:
        named = [f.options for f in formats.all_formats().values() if f.options is not None]
    if FamilyOptions in named:
        from dcptool import families

        named = [f.options_type for f in families.all_families().values() if f.options_type is not None]
    return named


def _refuse(given: Options, command: str, *names: str) -> None:
    """Refuse the fields ``names`` of an option object when set: ``command`` does not take them."""
    for name, value in given.given().items():
        if name in names:
            raise UsageError(f"{option(type(given).KEYS.get(name, name), value)}: {command} does not take it")


def format_options(format: str, **values) -> FormatOptions | None:  # noqa: A002 - a format's name, as everywhere
    """The options of output format ``format`` beyond the generic ones, as ``convert``, ``reshard`` and
    ``export_hf`` take them (``format_options=``): fsdp1's ``world_size``, ``keep_rank_state``, ``optim_form``,
    ``model_values``; dcp's ``compress``; hf's ``max_shard_size``. An option the format does not take is refused,
    naming the formats that take it; a format that takes none gives None.

    Example:
        >>> import dcptool
        >>> dcptool.format_options("fsdp1", world_size=2, optim_form="flat")
        Fsdp1Options(world_size=2, keep_rank_state=False, optim_form='flat', model_values=None)
    """
    return formats.options(format, **values)


def family_options(family: str, **values) -> FamilyOptions | None:
    """The options of naming family ``family`` for the names a command writes, as ``export_hf`` (HF's) and
    ``import_hf`` (its target family's) take them (``family_options=``): hf's ``hf_experts``, megatron's
    ``make_vocab_size_divisible_by``. An option the family does not take is refused, naming the families that
    take it; a family that takes none gives None.

    Example:
        >>> import dcptool
        >>> dcptool.family_options("megatron", make_vocab_size_divisible_by=64)
        MegatronFamilyOptions(make_vocab_size_divisible_by=64, megatron_spec=None)
    """
    from dcptool import families

    return families.given(family, **values)


@_command
def inspect(path: str | Path, *, selection: Selection = Selection(), stats: bool = False, threads: int = 0,
            reading: Reading = Reading()) -> Inspection:
    """``dcptool inspect``: a checkpoint's tensors, entries, data files, parameter counts, naming family and
    model kind, and the mesh it was saved on; with ``stats``, every tensor's values read and summarized.

    Args:
        selection: ``include``: only keys matching this regular expression.
        stats: read every tensor (min, max, mean, std, L2 norm, zeros, NaN, Inf, suspicious findings).
        threads: reading threads for ``stats`` (0: the CPUs, at most 4).

    Returns:
        ``inspection.Inspection``; ``.to_json()`` is what ``inspect --json`` prints.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.zeros((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> found = dcptool.inspect(folder, stats=True)
        >>> found.to_json()["total_bytes"], [flag.kind for flag in found.stats.flags]
        (48, ['all zeros'])
    """
    from dcptool.checks import inspection
    from dcptool.checks import stats as statistics

    _refuse(reading, "inspect", "dequantize")
    _refuse(selection, "inspect", "exclude", "prefix")
    path, = hub.with_revision(path, revision=reading.revision)
    checkpoint = formats.open_checkpoint(path, reading.format)
    include = selection.include
    total = sum(t.nbytes for t in statistics.included(checkpoint.tensors, include).values()) if stats else 0
    with _progress(reading.progress if stats else None, total, "reading") as advance:
        return inspection.inspect_checkpoint(checkpoint, include, with_stats=stats, threads=threads or None,
                                             max_memory=reading.budget(), progress=advance)


@_command
def tensor_layout(path: str | Path, key: str, *, mesh: MeshOptions | None = None, svg: str | Path | None = None,
                  reading: Reading = Reading()) -> Layout:
    """``dcptool inspect --layout KEY``: which rank holds which block of tensor ``key``, as saved, or with
    ``mesh`` as ``reshard`` would lay it out (by the mesh's plan); ``svg`` also draws it there.

    Returns:
        ``layout.Layout``; ``.to_json()`` is what ``inspect --layout KEY --json`` prints.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> picture = dcptool.tensor_layout(folder, "w", mesh=dcptool.MeshOptions(dp=2))
        >>> [block["holders"] for block in picture.to_json()["blocks"]]
        [[0], [1]]
    """
    from dcptool.checks import layout as layouts

    _refuse(reading, "tensor_layout", "dequantize")
    path, = hub.with_revision(path, revision=reading.revision)
    checkpoint = formats.open_checkpoint(path, reading.format)
    picture = layouts.planned_layout(checkpoint, key, mesh) if mesh else layouts.saved_layout(checkpoint, key)
    if svg:
        check_apart(checkpoint.files.location, svg)
        layouts.write_svg(picture, Path(svg))
    return picture


@_command
def convert(source: str | Path, destination: str | Path, to: str, *, family: str | None = None,
            config_dir: str | Path | None = None, dtype: str | None = None, selection: Selection = Selection(),
            format_options: FormatOptions | None = None, completeness: Completeness = Completeness(),
            reading: Reading = Reading(), writing: Writing = Writing()) -> Report:
    """``dcptool convert``: write ``source`` as format ``to`` (dcp, torch, hf, hf-dcp, fsdp1, megatron), every
    key as saved (or what the format holds), renamed to naming family ``family``'s names if given.

    Args:
        source: a checkpoint of any format dcptool reads (a path, a URL or a hub repo id).
        destination: the output (a folder or a file, by format), which appears atomically.
        to: the output format; ``format_options`` its own options (``format_options("fsdp1", world_size=8)``).
        config_dir: the model's config folder (head counts, experts, tied embeddings), for ``family``.
        completeness: renamed to HF names, what parts of the config's model the weights may lack (or hold beyond
            it); anything else is refused (``errors.IncompleteModelError``).
        reading: ``dequantize`` turns block-scaled float8 weights and MXFP4 experts into ``dtype`` (default bfloat16).

    Returns:
        ``Report``: ``left_out`` lists what the format cannot hold, ``notes`` what renaming did or left out,
        ``dropped`` what planning did not choose.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> report = dcptool.convert(folder, f"{folder}-dcp", to="dcp")
        >>> report.format, report.tensors, report.bytes_written
        ('dcp', 1, 48)
    """
    from dcptool.planning import conversion

    _refuse(selection, "convert", "prefix")
    checkpoint, notes = _source(source, reading, config_dir, dtype)
    request = OutputRequest(dtype=dtype, include=selection.include, exclude=selection.exclude,
                            format_options=format_options)
    planned = conversion.plan_convert(checkpoint, to, request, family=family, config_dir=config_dir,
                                      completeness=completeness)
    planned.notes += notes
    return _run(planned, destination, reading, writing)


@_command
def export_hf(source: str | Path, destination: str | Path, *, config_dir: str | Path | None = None,
              family: str = "auto", family_options: FamilyOptions | None = None, dtype: str | None = None,
              selection: Selection = Selection(), format_options: FormatOptions | None = None,
              completeness: Completeness = Completeness(), lora: Lora | None = None,
              quantize: Quantize | None = None, push: HubPush | None = None,
              reading: Reading = Reading(), writing: Writing = Writing()) -> Report:
    """``dcptool export-hf``: the model weights as Hugging Face safetensors under HF names, with
    ``config_dir``'s config and tokenizer files.

    Args:
        family: the naming family of the checkpoint's names (auto, hf, archon, torchtitan, megatron).
        family_options: the HF names' own (``family_options("hf", hf_experts="fused")``: MoE experts as
            transformers v5's fused tensors instead of one per expert).
        selection: ``prefix``: the wrapper of the model's keys (found by itself when None).
        format_options: hf's (``format_options("hf", max_shard_size="2GB")``).
        completeness: what parts of the model ``config_dir``'s config describes the export may lack
            (``Completeness(allow_missing="vision")``), or whether it may hold tensors that model has no place
            for; anything else is refused before anything is written (``errors.IncompleteModelError``).
        lora: a peft (LoRA) model's checkpoint merged into the base weights or written as a PEFT adapter folder.
        quantize: the linear weights quantized as they stream out (``Quantize("fp8")``: float8 per 128x128
            block, as DeepSeek-V3 releases; ``Quantize("like=DeepSeek-V3")``: as that release;
            ``dcptool.planning.quant``).
        push: then upload the export to a hub repo (``HubPush("ORG/NAME", branch="step-1000")``).

    Returns:
        ``Report``; after a push, ``report.pushed_to`` is the repo's URL.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"model.norm.weight": np.ones(3, np.float32)}, f"{folder}/model.safetensors")
        >>> report = dcptool.export_hf(folder, f"{folder}-export", dtype="bfloat16")
        >>> report.tensors, report.bytes_written
        (1, 6)
    """
    from dcptool.planning import conversion

    if push is not None:  # before the export: a push that cannot start should not cost one
        hub.check_repo_id(push.repo)
        if is_remote(destination):
            raise UsageError(f"{destination}: {option('push_to_hub')} uploads a local export folder: give a local output folder")
        hub.check_can_push()
    if lora is not None and lora.mode not in LORA_MODES:
        raise UsageError(f"{option('lora', lora.mode)}: choose {' or '.join(LORA_MODES)}")
    checkpoint, notes = _source(source, reading, config_dir, dtype)
    planned = conversion.plan_export_hf(checkpoint, config_dir=config_dir, prefix=selection.prefix, dtype=dtype,
                                        include=selection.include, exclude=selection.exclude, family=family,
                                        family_options=family_options, format_options=format_options,
                                        lora=conversion.LoraRequest(lora.mode, lora.config, lora.alpha) if lora else None,
                                        completeness=completeness, quantize=quantize)
    planned.notes += notes
    report = _run(planned, destination, reading, writing)
    if push is not None and not writing.dry_run:
        report.pushed_to = hub.push(output_path(destination), push)
    return report


@_command
def reshard(source: str | Path, destination: str | Path, *, mesh: MeshOptions = MeshOptions(), to: str = "dcp",
            family: str | None = None, config_dir: str | Path | None = None, dtype: str | None = None,
            keep_rank_state: bool = False, format_options: FormatOptions | None = None,
            reading: Reading = Reading(), writing: Writing = Writing()) -> ReshardReport:
    """``dcptool reshard``: lay ``source`` out for ``mesh`` as a job on it saves it: ``to="dcp"`` chunk for
    chunk as ``dcp.save`` writes it; ``to="fsdp1"`` per-rank FSDP1 files (data parallel only), in the forms
    its ``format_options`` choose (their ``world_size`` and ``keep_rank_state`` are the reshard's own).

    Args:
        keep_rank_state: keep entries of single data-parallel ranks (dataloader.dp_rank_*) as saved instead of
            dropping them.

    Returns:
        ``ReshardReport``: ``mesh``, ``plan``, ``warnings`` (what was dropped or kept); with ``dry_run``
        also ``summary`` (what ``--dry-run --json`` prints) and ``problems``. Without ``dry_run`` a plan
        with problems raises ``UsageError``.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> report = dcptool.reshard(folder, f"{folder}-dp2", mesh=dcptool.MeshOptions(dp=2))
        >>> report.mesh.describe(), sorted(p.name for p in Path(f"{folder}-dp2").iterdir())
        ('2 ranks: dp=2', ['.metadata', '__0_0.distcp', '__1_0.distcp'])
    """
    if getattr(format_options, "world_size", None):
        raise UsageError(f"format_options.world_size={format_options.world_size!r}: a reshard writes the ranks of "
                         f"its mesh ({option('world_size')})")
    if getattr(format_options, "keep_rank_state", False):
        raise UsageError(f"format_options.keep_rank_state=True: a reshard takes {option('keep_rank_state')} itself")
    return _reshard(source, destination, mesh, to=to, family=family, config_dir=config_dir, dtype=dtype,
                    keep_rank_state=keep_rank_state, format_options=format_options, reading=reading, writing=writing)


@_command
def import_hf(source: str | Path, destination: str | Path, *, mesh: MeshOptions = MeshOptions(), family: str = "hf",
              family_options: FamilyOptions | None = None, config_dir: str | Path | None = None,
              dtype: str | None = None, lora_folder: str | Path | None = None,
              completeness: Completeness = Completeness(), reading: Reading = Reading(),
              writing: Writing = Writing()) -> ReshardReport:
    """``dcptool import-hf``: a Hugging Face folder as a DCP checkpoint that ``dcp.load`` reads, laid
    out for ``mesh``, under the names of the job that loads it (naming family ``family``: hf, archon, torchtitan).
    ``lora_folder``: a PEFT adapter folder put on the model, under the names an FSDP job of the peft model loads
    (``get_model_state_dict``). A family with a format of its own writes that (Megatron-Core's torch_dist, with
    Megatron-LM's ``args``). ``family_options``: that family's own (``family_options("megatron",
    make_vocab_size_divisible_by=64, megatron_spec="te")``: the vocabulary padded to a multiple of 64 x ``mesh.tp``,
    under the names Transformer Engine's layer spec saves).
    The folder's tensors must be the whole model its config describes, or what ``completeness`` accepts
    (``errors.IncompleteModelError``).

    Returns:
        ``ReshardReport``, as ``reshard`` returns it.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> dcptool.import_hf(folder, f"{folder}-dcp", mesh=dcptool.MeshOptions(dp=2)).mesh.world
        2
    """
    from dcptool import families

    _refuse(reading, "import_hf", "format")  # it reads Hugging Face folders
    target = families.get(family)
    if lora_folder is not None and (not target.hub or mesh.tp * mesh.ep * mesh.cp != 1):
        raise UsageError(f"{option('lora_folder')} lays out a peft model of HF names for FSDP (data parallel): "
                         f"drop {option('family')}, {option('tp')}, {option('ep')} and {option('cp')}")
    sizes = mesh.sizes()
    options = families.options_for(target, sizes, dtype, family_options)
    return _reshard(source, destination, MeshOptions(**target.output_mesh(sizes), plan=mesh.plan),
                    to=target.output_format or "dcp", family=family, config_dir=config_dir, dtype=dtype,
                    keep_rank_state=False, format_options=None, reading=dataclasses.replace(reading, format="hf"),
                    writing=writing, lora_folder=lora_folder, family_options=options, completeness=completeness)


@_command
def verify(a: str | Path, b: str | Path | None = None, *, roundtrip: str | None = None,
           tolerance: Tolerance = Tolerance(), selection: Selection = Selection(), side_a: Side = Side(),
           side_b: Side = Side(), load_on: LoadOn | None = None, config_dir: str | Path | None = None,
           reading: Reading = Reading()) -> VerifyReport | LoadReport:
    """``dcptool verify``: compare ``a`` with ``b`` (any formats, layouts and naming families), or with its
    own round trip through format ``roundtrip``; bitwise unless ``tolerance`` says otherwise.

    A training state against a model-only checkpoint (its HF export) compares the model parts and
    lists the rest in ``.left_out``; two checkpoints whose layouts differ (model at ``model.`` in one,
    at the top level in the other) compare entry for entry and are unequal (``.layout`` says how)
    unless ``tolerance.values_only``.

    Args:
        tolerance: ``atol``/``rtol``; ``dtype_as="b"``: compare after casting A's floating-point tensors to B's
            dtypes (as torch's ``.to(dtype)`` rounds), ``"a"``: B's to A's; ``values_only``.
        side_a, side_b: each side's ``prefix`` (compare only keys under this wrapper, ``"dcp.model"``;
            ``"auto"``: the model part), ``format`` and naming ``family`` (``"auto"``: detected).
        load_on: instead, load ``a`` with torch's ``dcp.load`` in a real job on a mesh (``LoadOn("dp=2,tp=2")``;
            needs torch).
        config_dir: the model's config.json: with ``load_on``, its head and expert counts checked against the
            mesh (as ``reshard`` checks them); across naming families, Llama's q/k rows matched by its heads.

    Returns:
        ``verification.Report``: ``.equal`` says whether they match, ``.differences`` how not; with
        ``load_on``, ``loadcheck.LoadReport`` (``.ok``).

    Example:
    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> dcptool.convert(folder, f"{folder}.pt", to="torch").tensors
    1
    >>> dcptool.verify(folder, f"{folder}.pt").equal
    True
    >>> safetensors.numpy.save_file({"w": np.zeros((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> [(d.key, d.kind, d.count) for d in dcptool.verify(folder, f"{folder}.pt").differences]
    [('w', 'value', 12)]
    """
    from dcptool.checks import loadcheck, verification

    _refuse(reading, "verify", "format", "dequantize")  # each side's format is its Side's
    _refuse(selection, "verify", "prefix")
    a, b = hub.with_revision(a, b, revision=reading.revision)
    verification.check_arguments(b, roundtrip, load_on, side_a.prefix, side_b.prefix, side_b.format)
    verification.check_dtype_as(tolerance.dtype_as)
    memory = reading.budget()
    include, exclude = selection.include, selection.exclude
    if load_on:
        load_on.sizes()  # a mesh that is not sizes is refused before anything starts
        return loadcheck.run(a, load_on, include=include, exclude=exclude, config_dir=config_dir)
    compared = {"atol": tolerance.atol, "rtol": tolerance.rtol, "dtype_as": tolerance.dtype_as, "max_memory": memory}
    if roundtrip:
        with _progress(reading.progress, None, f"round trip via {roundtrip}") as advance:
            return verification.roundtrip(a, roundtrip, source_format=side_a.format, include=include, exclude=exclude,
                                          progress=advance, **compared)
    pairing = _pair(a, b, selection, side_a, side_b, config_dir)
    total = sum(t.nbytes for k, t in pairing.a.tensors.items() if k in pairing.b.tensors)
    with _progress(reading.progress, total, "comparing") as advance:
        report = verification.compare_sides(pairing.a, pairing.b, progress=advance, **compared)
    report.note, report.layout, report.values_only = pairing.note, pairing.layout, tolerance.values_only
    if pairing.left_out:
        report.left_out, report.left_out_why = pairing.left_out, pairing.left_out_why
    return report


@_command
def checksum(path: str | Path, *, write: bool = False, check: bool = False, against: str | Path | None = None,
             manifest: str | Path | None = None, scan_nonfinite: bool = False, prefix: str | None = None,
             against_prefix: str | None = None, threads: int = 0, overwrite: bool = False,
             reading: Reading = Reading()) -> Result:
    """``dcptool checksum``: ``write`` an integrity manifest (a BLAKE3 hash per file and per tensor),
    ``check`` the checkpoint against it, or check another checkpoint ``against`` it by tensor hashes.

    Args:
        manifest: where the manifest is (default: inside the checkpoint; needed for hub repos).
        scan_nonfinite: with ``write``, also count NaN and Inf values of every floating-point tensor.
        prefix, against_prefix: compare only keys under these wrappers.
        threads: hashing threads (0: the CPUs, at most 16).
        overwrite: with ``write``, replace an existing manifest.

    Returns:
        ``checksums.Result``: ``.ok`` says whether everything matches, ``.problems`` what does not.

    Example:
    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> dcptool.checksum(folder, write=True).tensors
    1
    >>> dcptool.checksum(folder, check=True).ok
    True
    """
    from dcptool.checks import checksums

    _refuse(reading, "checksum", "dequantize")
    path, against = hub.with_revision(path, against, revision=reading.revision)
    if hub.parse(path):  # the hub cache is huggingface_hub's: no manifest is written into it or read from it
        if manifest is None:
            raise UsageError(f"{path}: a hub repo holds no dcptool manifest: give {option('manifest')}")
        if check:
            path = hub.local_path(path)
    with _progress(reading.progress, None, "hashing") as advance:
        return checksums.run(path, write=write, check=check, against=against, manifest=manifest,
                             source_format=reading.format, scan_nonfinite=scan_nonfinite, prefix=prefix,
                             against_prefix=against_prefix, overwrite=overwrite, max_memory=reading.budget(),
                             threads=threads or None, progress=advance)


@_command
def check(path: str | Path, *, config_dir: str | Path | None = None, reading: Reading = Reading()) -> CheckReport:
    """``dcptool check``: everything torch or an engine would trip on in one checkpoint, found without loading
    it and without a manifest: every record's zip structure and CRC-32s, the metadata against the files and
    the records, the chunk cover, index files against their shards, non-tensor entries through the
    restricted unpickler, and ``config_dir``'s ``config.json`` (else one that comes with it) against the weights:
    their shapes, and parts of its model they lack or tensors it has no place for, as export-hf refuses them.

    Returns:
        ``integrity.Report``: ``.ok``, and ``.problems`` (kind, name, detail), every one found;
        ``.not_checked()``: what could not be checked (safetensors values: the format stores no checksum);
        ``.to_json()`` is what ``check --json`` prints. A path that is no checkpoint raises.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> dcptool.check(folder).ok
        True
    """
    from dcptool.checks import integrity

    _refuse(reading, "check", "dequantize", "verify_records")  # checking the records is what it does
    path, = hub.with_revision(path, revision=reading.revision)
    with _progress(reading.progress, None, "checking") as advance:
        return integrity.check_path(path, reading.format, progress=advance, config_dir=config_dir)


@_command
def average(sources: list[str | Path], destination: str | Path, *, weights: str | list[float] | None = None,
            to: str | None = None, mesh: MeshOptions | None = None, config_dir: str | Path | None = None,
            include_optimizer: bool = False, reading: Reading = Reading(), writing: Writing = Writing()) -> Report:
    """``dcptool average``: the weighted mean of checkpoints of one model (any formats, naming families and
    meshes; each paired with the first as ``verify`` pairs them), written as the first is laid out, or as
    format ``to`` on ``mesh`` (as ``reshard`` lays it out, with ``config_dir`` too).

    Each floating-point tensor is ``w0*x0 + w1*x1 + ...`` in float32 (each product and sum rounded to float32,
    in the order of ``sources``), rounded to the first's dtype as torch's ``.to(dtype)``; other dtypes must be
    equal in every source. Optimizer state is left out unless ``include_optimizer``.

    Args:
        weights: one number per source (a list, or ``"0.5,0.3,0.2"``; default equal); weights that do not sum
            to 1 are divided by their sum. Finite, not negative, not all zero.

    Returns:
        ``Report`` (a ``ReshardReport`` when a mesh is given); ``notes`` say the weights used and what was left out.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones(3, np.float32)}, f"{a}/model.safetensors")
        >>> safetensors.numpy.save_file({"w": np.full(3, 4, np.float32)}, f"{b}/model.safetensors")
        >>> dcptool.average([a, b], f"{a}-mean", weights=[3, 1]).tensors
        1
        >>> safetensors.numpy.load_file(f"{a}-mean/model.safetensors")["w"].tolist()
        [1.75, 1.75, 1.75]
    """
    from dcptool.arithmetic import averaging

    _refuse(reading, "average", "format", "dequantize")
    destination = output_path(destination)
    paths = hub.with_revision(*sources, revision=reading.revision)
    checkpoints = []
    try:
        for path in paths:
            checkpoints.append(formats.open_checkpoint(path))
            check_apart(checkpoints[-1].files.location, destination)
        if not writing.dry_run:
            check_destination(destination, writing.overwrite)
        planned = averaging.plan_average(checkpoints, weights, to=to, include_optimizer=include_optimizer, mesh=mesh,
                                         config_dir=config_dir)
        averaging.check_equal(planned, reading.budget())
        if planned.reshard is not None:
            return _write_or_report(planned.reshard, destination, reading, writing)
        return _run(planned.conversion, destination, reading, writing)
    finally:
        for checkpoint in checkpoints:
            checkpoint.files.close()


@_command
def diff(a: str | Path, b: str | Path, *, selection: Selection = Selection(), side_a: Side = Side(),
         side_b: Side = Side(), reading: Reading = Reading()) -> DiffReport:
    """``dcptool diff``: what changed from ``a`` to ``b`` (any formats, layouts and naming families, paired as
    ``verify`` pairs them, with each side's options as verify takes them), per tensor and in total: elements
    changed, bit-identical, the largest absolute change and the relative L2 change ``||b - a|| / ||a||``.

    Returns:
        ``difference.Report``: ``.summary()`` (its first line), ``.changes`` per tensor, ``.grouped()`` (layers
        folded), ``.top(k)``; ``.to_json()`` is what ``diff --json`` prints.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.zeros(4, np.float32)}, f"{a}/model.safetensors")
        >>> safetensors.numpy.save_file({"w": np.array([0, 0, 0, 3], np.float32)}, f"{b}/model.safetensors")
        >>> dcptool.diff(a, b).summary()
        '75.0% of 4 parameters bit-identical; 1 of 1 tensor changed'
    """
    from dcptool.arithmetic import difference

    _refuse(reading, "diff", "format", "dequantize")  # each side's format is its Side's
    _refuse(selection, "diff", "prefix")
    a, b = hub.with_revision(a, b, revision=reading.revision)
    pairing = _pair(a, b, selection, side_a, side_b)
    try:
        total = sum(t.nbytes for k, t in pairing.a.tensors.items() if k in pairing.b.tensors)
        with _progress(reading.progress, total, "comparing") as advance:
            report = difference.diff_sides(pairing.a, pairing.b, max_memory=reading.budget(), progress=advance)
    finally:
        pairing.a.checkpoint.files.close()
        pairing.b.checkpoint.files.close()
    report.note, report.left_out, report.left_out_why = pairing.note, pairing.left_out, pairing.left_out_why
    return report


def _pair(a, b, selection: Selection, side_a: Side, side_b: Side, config_dir=None):
    """verify's and diff's two sides, named alike (``pairing.sides``)."""
    from dcptool.checks.pairing import sides

    return sides(a, b, format_a=side_a.format, format_b=side_b.format, prefix_a=side_a.prefix,
                 prefix_b=side_b.prefix, include=selection.include, exclude=selection.exclude,
                 family_a=side_a.family, family_b=side_b.family, config_dir=config_dir)


def _source(source, reading: Reading, config_dir, dtype) -> tuple[Checkpoint, list[str]]:
    """The source checkpoint (a hub repo at ``reading.revision``), its block-scaled float8 weights and MXFP4 experts
    dequantized to ``dtype`` where asked (``dcptool.planning.quant``), and notes on that."""
    source, = hub.with_revision(source, revision=reading.revision)
    checkpoint = formats.open_checkpoint(source, reading.format)
    if not reading.dequantize:
        return checkpoint, []
    from dcptool.planning import quant

    return quant.dequantized(checkpoint, config_dir, dtype)


def _complete(checkpoint: Checkpoint, config_dir, completeness: Completeness) -> list[str]:
    """import-hf's check of an HF folder's tensors against the model its config (``config_dir``'s, else the
    folder's own) describes (``dcptool.planning.completeness``); its notes."""
    from dcptool.planning import completeness as complete
    from dcptool.selection import config_folder, read_config
    from dcptool.storage import CheckpointFiles

    folder = config_dir or config_folder(checkpoint)
    config = read_config(folder) if folder is not None else None
    where = str(CheckpointFiles(folder).path("config.json")) if folder is not None else ""
    try:
        return complete.check(config, checkpoint.tensors, completeness, str(checkpoint.root), where,
                              excludable=False)
    except errors.DcptoolError:
        checkpoint.files.close()
        raise


def _with_lora_folder(checkpoint: Checkpoint, lora_folder, config_dir) -> tuple[Checkpoint, list[str]]:
    """import-hf's base model with a PEFT adapter folder on it, under a peft model's names (``dcptool.planning.lora``)."""
    from dcptool.planning import lora
    from dcptool.selection import config_folder, read_config

    folder = config_dir or config_folder(checkpoint)
    return lora.with_adapter(checkpoint, formats.open_checkpoint(lora_folder, "hf"),
                             read_config(folder) if folder else None)


def _reshard(source, destination, mesh: MeshOptions, *, to, family, config_dir, dtype, keep_rank_state,
             format_options, reading: Reading, writing: Writing, lora_folder=None,
             family_options=None, completeness: Completeness | None = None) -> ReshardReport:
    """reshard and import-hf: plan for the mesh, then write (or, with ``dry_run``, report the plan); with
    ``completeness`` (import-hf), the source's HF names checked against the model its config describes first."""
    from dcptool.planning import resharding

    destination = output_path(destination)
    checkpoint, notes = _source(source, reading, config_dir, dtype)
    if completeness is not None:
        notes += _complete(checkpoint, config_dir, completeness)
    if lora_folder is not None:
        checkpoint, more = _with_lora_folder(checkpoint, lora_folder, config_dir)
        notes += more
    check_apart(checkpoint.files.location, destination)
    if not writing.dry_run:
        check_destination(destination, writing.overwrite)  # before planning, whose warnings would come first
    result = resharding.plan_for(checkpoint, mesh, to=to, family=family, config_dir=config_dir,
                                 keep_rank_state=keep_rank_state, dtype=dtype, format_options=format_options,
                                 family_options=family_options)
    result.conversion.notes[:0] = notes
    try:
        return _write_or_report(result, destination, reading, writing)
    finally:
        checkpoint.files.close()


def _write_or_report(result: ReshardPlan, destination, reading: Reading, writing: Writing) -> ReshardReport:
    """A planned reshard written with a progress bar, or its plan reported (``dry_run``)."""
    from dcptool.planning import resharding

    if writing.dry_run:
        report = result.conversion.dry_run(destination)
        return resharding.ReshardReport(**vars(report), mesh=result.mesh, plan=result.plan.name if result.plan else "",
                                        warnings=result.warnings, problems=result.problems, summary=result.summary(report.planned_files),
                                        description=result.describe())
    resharding.raise_problems(result)
    with _progress(reading.progress, result.conversion.total_bytes, _writing_label(destination)) as advance:
        report = resharding.write_plan(result, destination, **_writing(reading, writing), progress=advance)
    report.description = result.describe()
    return report


def _run(planned: Conversion, destination, reading: Reading, writing: Writing) -> Report:
    """Write a planned conversion with a progress bar, or report it without writing; the source's files are
    closed after."""
    destination = output_path(destination)
    try:
        check_apart(planned.checkpoint.files.location, destination)
        if writing.dry_run:
            return planned.dry_run(destination)
        with _progress(reading.progress, planned.total_bytes, _writing_label(destination)) as advance:
            return planned.write(destination, **_writing(reading, writing), progress=advance)
    finally:
        planned.checkpoint.files.close()


@contextmanager
def _no_progress(total: int | None, what: str):
    yield lambda n: None


def _progress(progress: Progress | None, total: int | None, what: str) -> ContextManager[Callable[[int], None]]:
    """The caller's progress bar for ``total`` bytes (None: unknown) labelled ``what``, or none."""
    return (progress or _no_progress)(total, what)


def _writing_label(destination) -> str:
    return f"writing {Path(str(destination)).name}"


def _writing(reading: Reading, writing: Writing) -> dict[str, Any]:
    """The options of ``conversion.write_checkpoint`` that every writing command takes."""
    return {"max_memory": reading.budget(), "overwrite": writing.overwrite, "fsync": writing.fsync}
