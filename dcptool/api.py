"""dcptool as a Python library: open a checkpoint and read its tensors, or run a command as a function.

This module is the one orchestrator of the commands: each function does what the ``dcptool``
command of the same name does, with every option it has (``--from`` is ``source_format``,
``--revision`` of a hub source ``revision``), and returns the report that the command prints
instead of printing it; the command line only parses options, calls these and renders. Bad input
raises the exceptions of ``dcptool.errors``: ``CheckpointError`` for a checkpoint that cannot be
read, ``UsageError`` for options that cannot work together (the command exits 2 for both). A check
that finds a difference is not an error here: look at ``report.equal`` (verify) or ``result.ok``
(checksum, ``verify(load_on=...)``). Sizes (``max_memory``, ``max_shard_size``) are bytes or text
such as ``"256MiB"`` or ``"5GB"``. ``dry_run=True`` plans and reports, and writes nothing. Every record
read (``torch.save`` archives: DCP chunks and objects, ``torch.save`` and FSDP1 files) is checked as torch
would check it, and its CRC-32s as its bytes pass: a damaged one raises ``CheckpointError``;
``verify_records=False`` (``--no-verify-records``) skips that, for a caller who accepts the risk.
``progress`` is a callable ``progress(total_bytes, label)`` returning a context manager that
yields ``advance(n)`` (the command line passes its progress bar).

Nothing here imports torch unless asked to (``read(..., as_torch=True)``, ``verify(load_on=...)``).

>>> import tempfile, numpy as np, safetensors.numpy, dcptool
>>> folder = tempfile.mkdtemp()
>>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
>>> dcptool.reshard(folder, f"{folder}-dp2", dp=2, dry_run=True).planned_files
{'__0_0.distcp': 24, '__1_0.distcp': 24}
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Union

from dcptool import formats, hub
from dcptool.conversion import Conversion, Report
from dcptool.core import Checkpoint
from dcptool.errors import UsageError, option
from dcptool.format_interface import OutputRequest
from dcptool.mesh import parse_mesh
from dcptool.reader import Reader, Region, TensorSpec, open  # noqa: A004 - dcptool.open, as builtins.open opens a file
from dcptool.sizes import parse_size
from dcptool.storage import check_apart, check_destination, is_remote, output_path
from dcptool.transfer import DEFAULT_MAX_MEMORY

if TYPE_CHECKING:
    from dcptool.checksums import Result
    from dcptool.difference import Report as DiffReport
    from dcptool.integrity import Report as CheckReport
    from dcptool.inspection import Inspection
    from dcptool.layout import Layout
    from dcptool.loadcheck import LoadReport
    from dcptool.resharding import ReshardPlan, ReshardReport
    from dcptool.verification import Report as VerifyReport

__all__ = ["open", "Reader", "TensorSpec", "Region", "inspect", "tensor_layout", "convert", "export_hf", "import_hf", "reshard",
           "verify", "checksum", "check", "average", "diff"]

Size = Union[int, str]
Progress = Callable[[Union[int, None], str], ContextManager[Callable[[int], None]]]


def _records(command: Callable) -> Callable:
    """The command's ``verify_records`` keyword: False (``--no-verify-records``) reads the checkpoints it opens
    without checking their records (zip structure, CRC-32s), for a caller who accepts the risk."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        with formats.records_checked(kwargs.get("verify_records", True)):
            return command(*args, **kwargs)
    return run


@_records
def inspect(path: str | Path, *, source_format: str | None = None, revision: str | None = None,
            include: str | None = None, stats: bool = False, threads: int = 0, max_memory: Size = DEFAULT_MAX_MEMORY,
            progress: Progress | None = None,
            verify_records: bool = True) -> Inspection:
    """``dcptool inspect``: a checkpoint's tensors, entries, data files, parameter counts, naming family and
    model kind, and the mesh it was saved on; with ``stats``, every tensor's values read and summarized.

    Args:
        include: only keys matching this regular expression.
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
    from dcptool import inspection
    from dcptool import stats as statistics

    path, = hub.with_revision(path, revision=revision)
    checkpoint = formats.open_checkpoint(path, source_format)
    total = sum(t.nbytes for t in statistics.included(checkpoint.tensors, include).values()) if stats else 0
    with _progress(progress if stats else None, total, "reading") as advance:
        return inspection.inspect_checkpoint(checkpoint, include, with_stats=stats, threads=threads or None,
                                             max_memory=parse_size(max_memory, "max_memory"), progress=advance)


def tensor_layout(path: str | Path, key: str, *, mesh: str | None = None, plan: str = "auto", svg: str | Path | None = None,
           source_format: str | None = None, revision: str | None = None) -> Layout:
    """``dcptool inspect --layout KEY``: which rank holds which block of tensor ``key``, as saved, or with
    ``mesh`` (``"dp=2,tp=4"``) as ``reshard`` would lay it out under ``plan``; ``svg`` also draws it there.

    Returns:
        ``layout.Layout``; ``.to_json()`` is what ``inspect --layout KEY --json`` prints.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> [block["holders"] for block in dcptool.tensor_layout(folder, "w", mesh="dp=2").to_json()["blocks"]]
        [[0], [1]]
    """
    from dcptool import layout as layouts

    path, = hub.with_revision(path, revision=revision)
    checkpoint = formats.open_checkpoint(path, source_format)
    picture = layouts.planned_layout(checkpoint, key, mesh, plan) if mesh else layouts.saved_layout(checkpoint, key)
    if svg:
        check_apart(checkpoint.files.location, svg)
        layouts.write_svg(picture, Path(svg))
    return picture


@_records
def convert(source: str | Path, destination: str | Path, to: str, *, source_format: str | None = None,
            revision: str | None = None, dtype: str | None = None, include: str | None = None,
            exclude: str | None = None, world_size: int | None = None, max_shard_size: Size | None = None,
            adapter: str | None = None, config_dir: str | Path | None = None, keep_rank_state: bool = False,
            optim_form: str | None = None, model_values: str | None = None, dequantize: bool = False,
            compress: str | None = None, max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False,
            fsync: bool = True, dry_run: bool = False, progress: Progress | None = None,
            verify_records: bool = True) -> Report:
    """``dcptool convert``: write ``source`` as format ``to`` (dcp, torch, hf, hf-dcp, fsdp1), every key as
    saved (or what the format holds), renamed to ``adapter``'s family if given.

    Args:
        source: a checkpoint of any format dcptool reads (a path, a URL or a hub repo id).
        destination: the output (a folder or a file, by format), which appears atomically.
        to: the output format. Options a format does not take are refused: ``compress`` goes with dcp,
            ``max_shard_size`` with hf, ``world_size``, ``keep_rank_state``, ``optim_form`` and
            ``model_values`` with fsdp1.
        dequantize: block-scaled float8 weights become ``dtype`` (default bfloat16) weights.

    Returns:
        ``Report``: ``left_out`` lists what the format cannot hold, ``notes`` what an adapter renamed or
        left out, ``dropped`` what planning did not choose.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> report = dcptool.convert(folder, f"{folder}-dcp", to="dcp")
        >>> report.format, report.tensors, report.bytes_written
        ('dcp', 1, 48)
    """
    from dcptool import conversion

    checkpoint, notes = _source(source, source_format, revision, dequantize, config_dir, dtype)
    shard_size = None if max_shard_size is None else parse_size(max_shard_size, "max_shard_size")
    request = OutputRequest(dtype=dtype, include=include, exclude=exclude, world_size=world_size, compress=compress,
                            max_shard_size=shard_size, keep_rank_state=keep_rank_state,
                            forms=_forms(optim_form, model_values))
    planned = conversion.plan_convert(checkpoint, to, request, adapter=adapter, config_dir=config_dir)
    planned.notes += notes
    return _run(planned, destination, dry_run, progress, max_memory, overwrite, fsync)


@_records
def export_hf(source: str | Path, destination: str | Path, *, config_dir: str | Path | None = None,
              prefix: str | None = None, source_format: str | None = None, revision: str | None = None,
              dtype: str | None = None, include: str | None = None, exclude: str | None = None,
              max_shard_size: Size = "5GB", adapter: str = "auto", hf_experts: str = "per-expert",
              lora: str | None = None, lora_config: str | Path | None = None, lora_alpha: float | None = None,
              dequantize: bool = False, push_to_hub: str | None = None, private: bool = False,
              hub_branch: str | None = None, commit_message: str | None = None,
              max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False, fsync: bool = True,
              dry_run: bool = False, progress: Progress | None = None,
              verify_records: bool = True) -> Report:
    """``dcptool export-hf``: the model weights as Hugging Face safetensors under HF names, with
    ``config_dir``'s config and tokenizer files.

    Args:
        adapter: the family of the checkpoint's names (auto, hf, archon, torchtitan).
        lora: a peft (LoRA) model's checkpoint: ``"merge"`` merges every adapter into the base weights,
            ``"adapter"`` writes a PEFT adapter folder; ``lora_config`` (an ``adapter_config.json``, default one
            beside the checkpoint) and ``lora_alpha`` give lora_alpha and the other settings.
        push_to_hub: then upload the export to this hub repo (``ORG/NAME``), with ``private``,
            ``hub_branch`` and ``commit_message`` as the command's ``--private``, ``--revision``,
            ``--commit-message``.

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
    from dcptool import conversion

    if push_to_hub:  # before the export: a push that cannot start should not cost one
        hub.check_repo_id(push_to_hub)
        if is_remote(destination):
            raise UsageError(f"{destination}: {option('push_to_hub')} uploads a local export folder: give a local output folder")
        hub.check_can_push()
    elif private or hub_branch or commit_message:
        raise UsageError(f"{option('private')}, {option('hub_branch')} and {option('commit_message')} go with "
                         f"{option('push_to_hub')}")
    if lora not in (None, "merge", "adapter"):
        raise UsageError(f"{option('lora', lora)}: choose merge or adapter")
    if lora is None and (lora_config is not None or lora_alpha is not None):
        raise UsageError(f"{option('lora_config')} and {option('lora_alpha')} go with {option('lora')}")
    checkpoint, notes = _source(source, source_format, revision, dequantize, config_dir, dtype)
    planned = conversion.plan_export_hf(checkpoint, config_dir=config_dir, prefix=prefix, dtype=dtype,
                                        include=include, exclude=exclude, adapter=adapter, hf_experts=hf_experts,
                                        max_shard_size=parse_size(max_shard_size, "max_shard_size"),
                                        lora=conversion.LoraRequest(lora, lora_config, lora_alpha) if lora else None)
    if dequantize:  # a quantization_config left in would make transformers quantize the weights again
        from dcptool import quant

        planned.writer_options["config"] = quant.drop_quantization_config(planned.writer_options.get("config"))
    planned.notes += notes
    report = _run(planned, destination, dry_run, progress, max_memory, overwrite, fsync)
    if push_to_hub and not dry_run:
        report.pushed_to = hub.push(destination, push_to_hub, private=private, revision=hub_branch,
                                    commit_message=commit_message)
    return report


@_records
def reshard(source: str | Path, destination: str | Path, *, dp: int | None = None, tp: int = 1, ep: int = 1,
            etp: int | str = 1, cp: int = 1, dp_replicate: int = 1, world_size: int | None = None, plan: str = "auto",
            to: str = "dcp", keep_rank_state: bool = False, adapter: str | None = None,
            config_dir: str | Path | None = None, source_format: str | None = None, revision: str | None = None,
            dtype: str | None = None, optim_form: str | None = None, model_values: str | None = None,
            dequantize: bool = False, compress: str | None = None, max_memory: Size = DEFAULT_MAX_MEMORY,
            overwrite: bool = False, fsync: bool = True, dry_run: bool = False,
            progress: Progress | None = None,
            verify_records: bool = True) -> ReshardReport:
    """``dcptool reshard``: lay ``source`` out for a mesh as a job on it saves it: ``to="dcp"`` chunk for
    chunk as ``dcp.save`` writes it; ``to="fsdp1"`` per-rank FSDP1 files (data parallel only), in the
    forms ``optim_form`` and ``model_values`` choose.

    Returns:
        ``ReshardReport``: ``mesh``, ``plan``, ``warnings`` (what was dropped or kept); with ``dry_run``
        also ``summary`` (what ``--dry-run --json`` prints) and ``problems``. Without ``dry_run`` a plan
        with problems raises ``UsageError``.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> report = dcptool.reshard(folder, f"{folder}-dp2", dp=2)
        >>> report.mesh.describe(), sorted(p.name for p in Path(f"{folder}-dp2").iterdir())
        ('2 ranks: dp=2', ['.metadata', '__0_0.distcp', '__1_0.distcp'])
    """
    return _reshard(source, destination, source_format, revision,
                    _mesh(dp, tp, ep, etp, cp, dp_replicate, world_size), plan=plan, to=to,
                    keep_rank_state=keep_rank_state, adapter=adapter, config_dir=config_dir,
                    dtype=dtype, dequantize=dequantize, compress=compress, forms=_forms(optim_form, model_values),
                    max_memory=max_memory, overwrite=overwrite, fsync=fsync, dry_run=dry_run, progress=progress)


def import_hf(source: str | Path, destination: str | Path, *, dp: int | None = None, tp: int = 1, ep: int = 1,
              etp: int | str = 1, cp: int = 1, dp_replicate: int = 1, world_size: int | None = None,
              plan: str = "auto", adapter: str = "hf", make_vocab_size_divisible_by: int | None = None,
              config_dir: str | Path | None = None, revision: str | None = None, dtype: str | None = None,
              dequantize: bool = False,
              lora_adapter: str | Path | None = None,
              max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False, fsync: bool = True,
              dry_run: bool = False, progress: Progress | None = None) -> ReshardReport:
    """``dcptool import-hf``: a Hugging Face folder as a DCP checkpoint that ``dcp.load`` reads, laid
    out for the mesh, under the names of the job that loads it (``adapter``: hf, archon, torchtitan). ``lora_adapter``:
    a PEFT adapter folder put on the model, under the names an FSDP job of the peft model loads (``get_model_state_dict``).
    ``adapter="megatron"`` writes Megatron-Core's torch_dist with Megatron-LM's ``args``, the vocabulary padded to a
    multiple of ``make_vocab_size_divisible_by`` (Megatron-LM's default, 128) x ``tp``.

    Returns:
        ``ReshardReport``, as ``reshard`` returns it.

    Example:
        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
        >>> dcptool.import_hf(folder, f"{folder}-dcp", dp=2).mesh.world
        2
    """
    from dcptool import families

    family = families.get(adapter)
    if lora_adapter is not None and (not family.hub or tp * ep * cp != 1):
        raise UsageError(f"{option('lora_adapter')} lays out a peft model of HF names for FSDP (data parallel): "
                         f"drop {option('adapter')}, {option('tp')}, {option('ep')} and {option('cp')}")
    mesh = {"dp": dp, "tp": tp, "ep": ep, "etp": etp, "cp": cp, "dp_replicate": dp_replicate, "world_size": world_size}
    options = families.options_for(family, mesh, dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    return _reshard(source, destination, "hf", revision, _mesh(**family.output_mesh(mesh)), plan=plan,
                    to=family.output_format or "dcp", keep_rank_state=False, adapter=adapter, config_dir=config_dir,
                    dtype=dtype, dequantize=dequantize, compress=None, forms={}, max_memory=max_memory,
                    overwrite=overwrite, fsync=fsync, dry_run=dry_run, progress=progress, lora_adapter=lora_adapter,
                    family_options=options)


@_records
def verify(a: str | Path, b: str | Path | None = None, *, roundtrip: str | None = None, atol: float | None = None,
           rtol: float | None = None, dtype_as: str | None = None, values_only: bool = False,
           include: str | None = None, exclude: str | None = None,
           prefix_a: str | None = None, prefix_b: str | None = None, from_a: str | None = None,
           from_b: str | None = None, adapter_a: str = "auto", adapter_b: str = "auto",
           load_on: str | Mapping[str, int] | None = None, nproc: int | None = None, backend: str = "auto",
           plan: str = "auto", timeout: float = 600.0, config_dir: str | Path | None = None,
           max_memory: Size = DEFAULT_MAX_MEMORY, revision: str | None = None, progress: Progress | None = None,
           verify_records: bool = True) -> VerifyReport | LoadReport:
    """``dcptool verify``: compare ``a`` with ``b`` (any formats, layouts and naming families), or with its
    own round trip through format ``roundtrip``; bitwise unless ``atol``/``rtol``.

    A training state against a model-only checkpoint (its HF export) compares the model parts and
    lists the rest in ``.left_out``; two checkpoints whose layouts differ (model at ``model.`` in one,
    at the top level in the other) compare entry for entry and are unequal (``.layout`` says how)
    unless ``values_only``.

    Args:
        dtype_as: ``"b"``: compare after casting A's floating-point tensors to B's dtypes (as torch's
            ``.to(dtype)`` rounds), bitwise unless tolerances; ``"a"``: B's to A's.
        prefix_a, prefix_b: compare only keys under this wrapper (``"dcp.model"``; ``"auto"``: the model part).
        adapter_a, adapter_b: the naming family of each side's weights (``"auto"``: detected).
        load_on: instead, load ``a`` with torch's ``dcp.load`` in a real job on this mesh (``"dp=2,tp=2"``;
            needs torch), with ``nproc`` processes on ``backend``.
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
    from dcptool import loadcheck, verification

    a, b = hub.with_revision(a, b, revision=revision)
    verification.check_arguments(b, roundtrip, load_on, prefix_a, prefix_b, from_b)
    verification.check_dtype_as(dtype_as)
    memory = parse_size(max_memory, "max_memory")
    if load_on:
        mesh = parse_mesh(load_on, "load_on") if isinstance(load_on, str) else dict(load_on)
        return loadcheck.run(a, mesh, nproc=nproc, backend=backend, plan=plan, timeout=timeout, include=include,
                             exclude=exclude, config_dir=config_dir)
    if roundtrip:
        with _progress(progress, None, f"round trip via {roundtrip}") as advance:
            return verification.roundtrip(a, roundtrip, source_format=from_a, include=include, exclude=exclude,
                                          max_memory=memory, atol=atol, rtol=rtol, dtype_as=dtype_as,
                                          progress=advance)
    pairing = verification.sides(a, b, format_a=from_a, format_b=from_b, prefix_a=prefix_a, prefix_b=prefix_b,
                                 include=include, exclude=exclude, family_a=adapter_a, family_b=adapter_b,
                                 config_dir=config_dir)
    total = sum(t.nbytes for k, t in pairing.a.tensors.items() if k in pairing.b.tensors)
    with _progress(progress, total, "comparing") as advance:
        report = verification.compare_sides(pairing.a, pairing.b, atol=atol, rtol=rtol, dtype_as=dtype_as,
                                            max_memory=memory, progress=advance)
    report.note, report.layout, report.values_only = pairing.note, pairing.layout, values_only
    if pairing.left_out:
        report.left_out, report.left_out_why = pairing.left_out, pairing.left_out_why
    return report


@_records
def checksum(path: str | Path, *, write: bool = False, check: bool = False, against: str | Path | None = None,
             manifest: str | Path | None = None, scan_nonfinite: bool = False, prefix: str | None = None,
             against_prefix: str | None = None, source_format: str | None = None, threads: int = 0,
             max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False, revision: str | None = None,
             progress: Progress | None = None,
             verify_records: bool = True) -> Result:
    """``dcptool checksum``: ``write`` an integrity manifest (a BLAKE3 hash per file and per tensor),
    ``check`` the checkpoint against it, or check another checkpoint ``against`` it by tensor hashes.

    Args:
        manifest: where the manifest is (default: inside the checkpoint; needed for hub repos).
        scan_nonfinite: with ``write``, also count NaN and Inf values of every floating-point tensor.
        prefix, against_prefix: compare only keys under these wrappers.

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
    from dcptool import checksums

    path, against = hub.with_revision(path, against, revision=revision)
    if hub.parse(path):  # the hub cache is huggingface_hub's: no manifest is written into it or read from it
        if manifest is None:
            raise UsageError(f"{path}: a hub repo holds no dcptool manifest: give {option('manifest')}")
        if check:
            path = hub.local_path(path)
    with _progress(progress, None, "hashing") as advance:
        return checksums.run(path, write=write, check=check, against=against, manifest=manifest,
                             source_format=source_format, scan_nonfinite=scan_nonfinite, prefix=prefix,
                             against_prefix=against_prefix, overwrite=overwrite,
                             max_memory=parse_size(max_memory, "max_memory"), threads=threads or None,
                             progress=advance)


def check(path: str | Path, *, source_format: str | None = None, revision: str | None = None,
          progress: Progress | None = None) -> CheckReport:
    """``dcptool check``: everything torch or an engine would trip on in one checkpoint, found without loading
    it and without a manifest: every record's zip structure and CRC-32s, the metadata against the files and
    the records, the chunk cover, index files against their shards, non-tensor entries through the
    restricted unpickler, and a ``config.json`` that comes with it against the weights.

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
    from dcptool import integrity

    path, = hub.with_revision(path, revision=revision)
    with formats.records_checked(True), _progress(progress, None, "checking") as advance:
        return integrity.check_path(path, source_format, progress=advance)


@_records
def average(sources: list[str | Path], destination: str | Path, *, weights: str | list[float] | None = None,
            to: str | None = None, dp: int | None = None, tp: int = 1, ep: int = 1, etp: int | str = 1, cp: int = 1,
            dp_replicate: int = 1, world_size: int | None = None, plan: str = "auto",
            config_dir: str | Path | None = None, include_optimizer: bool = False, revision: str | None = None, max_memory: Size = DEFAULT_MAX_MEMORY,
            overwrite: bool = False, fsync: bool = True, dry_run: bool = False, progress: Progress | None = None,
            verify_records: bool = True) -> Report:
    """``dcptool average``: the weighted mean of checkpoints of one model (any formats, naming families and
    meshes; each paired with the first as ``verify`` pairs them), written as the first is laid out, or as
    format ``to`` on the mesh of ``dp``, ``tp``, ... (as ``reshard`` takes them, ``plan`` and ``config_dir`` too).

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
    from dcptool import averaging

    destination = output_path(destination)
    paths = hub.with_revision(*sources, revision=revision)
    checkpoints = []
    try:
        for path in paths:
            checkpoints.append(formats.open_checkpoint(path))
            check_apart(checkpoints[-1].files.location, destination)
        if not dry_run:
            check_destination(destination, overwrite)
        mesh = {"dp": dp, "tp": tp, "ep": ep, "etp": etp, "cp": cp, "dp_replicate": dp_replicate, "world_size": world_size}
        given = any(value not in (None, 1, "1") for value in mesh.values())
        planned = averaging.plan_average(checkpoints, weights, to=to, include_optimizer=include_optimizer, plan=plan,
                                         mesh_options=_mesh(**mesh) if given else None, config_dir=config_dir)
        averaging.check_equal(planned, parse_size(max_memory, "max_memory"))
        if planned.reshard is not None:
            return _write_or_report(planned.reshard, destination, dry_run, progress, max_memory, overwrite, fsync)
        return _run(planned.conversion, destination, dry_run, progress, max_memory, overwrite, fsync)
    finally:
        for checkpoint in checkpoints:
            checkpoint.files.close()


@_records
def diff(a: str | Path, b: str | Path, *, include: str | None = None, exclude: str | None = None,
         prefix_a: str | None = None, prefix_b: str | None = None, from_a: str | None = None,
         from_b: str | None = None, adapter_a: str = "auto", adapter_b: str = "auto", revision: str | None = None,
         max_memory: Size = DEFAULT_MAX_MEMORY, progress: Progress | None = None,
         verify_records: bool = True) -> DiffReport:
    """``dcptool diff``: what changed from ``a`` to ``b`` (any formats, layouts and naming families, paired as
    ``verify`` pairs them), per tensor and in total: elements changed, bit-identical, the largest absolute
    change and the relative L2 change ``||b - a|| / ||a||``.

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
    from dcptool import difference, verification

    a, b = hub.with_revision(a, b, revision=revision)
    pairing = verification.sides(a, b, format_a=from_a, format_b=from_b, prefix_a=prefix_a, prefix_b=prefix_b,
                                 include=include, exclude=exclude, family_a=adapter_a, family_b=adapter_b)
    try:
        total = sum(t.nbytes for k, t in pairing.a.tensors.items() if k in pairing.b.tensors)
        with _progress(progress, total, "comparing") as advance:
            report = difference.diff_sides(pairing.a, pairing.b, max_memory=parse_size(max_memory, "max_memory"),
                                           progress=advance)
    finally:
        pairing.a.checkpoint.files.close()
        pairing.b.checkpoint.files.close()
    report.note, report.left_out, report.left_out_why = pairing.note, pairing.left_out, pairing.left_out_why
    return report


def _source(source, source_format, revision, dequantize: bool, config_dir, dtype) -> tuple[Checkpoint, list[str]]:
    """The source checkpoint (a hub repo at ``revision``), its block-scaled float8 weights dequantized
    to ``dtype`` where asked (``dcptool.quant``), and notes on that."""
    source, = hub.with_revision(source, revision=revision)
    checkpoint = formats.open_checkpoint(source, source_format)
    if not dequantize:
        return checkpoint, []
    from dcptool import quant

    return quant.dequantized(checkpoint, config_dir, dtype)


def _with_lora_adapter(checkpoint: Checkpoint, adapter_dir, config_dir) -> tuple[Checkpoint, list[str]]:
    """import-hf's base model with a PEFT adapter folder on it, under a peft model's names (``dcptool.lora``)."""
    from dcptool import lora
    from dcptool.selection import config_folder, read_config

    folder = config_dir or config_folder(checkpoint)
    return lora.with_adapter(checkpoint, formats.open_checkpoint(adapter_dir, "hf"),
                             read_config(folder) if folder else None)


def _forms(optim_form: str | None, model_values: str | None) -> dict[str, str]:
    """The fsdp1 output forms given (``OutputRequest.forms``)."""
    return {name: value for name, value in (("optim_form", optim_form), ("model_values", model_values)) if value}


def _mesh(dp, tp, ep, etp, cp, dp_replicate, world_size) -> dict:
    from dcptool import resharding

    return resharding.mesh_options(dp, tp, ep, etp, cp, dp_replicate, world_size)


def _reshard(source, destination, source_format, revision, mesh_options, *, plan, to, keep_rank_state, adapter,
             config_dir, dtype, dequantize, compress, forms, max_memory, overwrite, fsync, dry_run,
             progress, lora_adapter=None, family_options=None) -> ReshardReport:
    """reshard and import-hf: plan for the mesh, then write (or, with ``dry_run``, report the plan)."""
    from dcptool import resharding

    destination = output_path(destination)
    checkpoint, notes = _source(source, source_format, revision, dequantize, config_dir, dtype)
    if lora_adapter is not None:
        checkpoint, more = _with_lora_adapter(checkpoint, lora_adapter, config_dir)
        notes += more
    check_apart(checkpoint.files.location, destination)
    if not dry_run:
        check_destination(destination, overwrite)  # before planning, whose warnings would come first
    result = resharding.plan_for(checkpoint, mesh_options, plan, to=to, adapter=adapter,
                                 config_dir=config_dir, keep_rank_state=keep_rank_state, dtype=dtype,
                                 compress=compress, forms=forms, family_options=family_options)
    result.conversion.notes[:0] = notes
    try:
        return _write_or_report(result, destination, dry_run, progress, max_memory, overwrite, fsync)
    finally:
        checkpoint.files.close()


def _write_or_report(result: ReshardPlan, destination, dry_run: bool, progress: Progress | None, max_memory,
                     overwrite, fsync) -> ReshardReport:
    """A planned reshard written with a progress bar, or its plan reported (``dry_run``)."""
    from dcptool import resharding

    if dry_run:
        report = result.conversion.dry_run(destination)
        return resharding.ReshardReport(**vars(report), mesh=result.mesh, plan=result.plan.name if result.plan else "",
                                        warnings=result.warnings, problems=result.problems, summary=result.summary(report.planned_files),
                                        description=result.describe())
    resharding.raise_problems(result)
    with _progress(progress, result.conversion.total_bytes, _writing_label(destination)) as advance:
        report = resharding.write_plan(result, destination, **_writing(max_memory, overwrite, fsync), progress=advance)
    report.description = result.describe()
    return report


def _run(planned: Conversion, destination, dry_run: bool, progress: Progress | None, max_memory, overwrite,
         fsync) -> Report:
    """Write a planned conversion with a progress bar, or report it without writing; the source's files are
    closed after."""
    destination = output_path(destination)
    try:
        check_apart(planned.checkpoint.files.location, destination)
        if dry_run:
            return planned.dry_run(destination)
        with _progress(progress, planned.total_bytes, _writing_label(destination)) as advance:
            return planned.write(destination, **_writing(max_memory, overwrite, fsync), progress=advance)
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


def _writing(max_memory: Size, overwrite: bool, fsync: bool) -> dict[str, Any]:
    """The options of ``conversion.write_checkpoint`` that every writing command takes."""
    return {"max_memory": parse_size(max_memory, "max_memory"), "overwrite": overwrite, "fsync": fsync}
