"""Conversion: choose what goes out (planning), then move the bytes (``dcptool.engine.transfer``) within a memory budget.

Planning turns a source ``Checkpoint`` into ``OutTensor``/``OutObject`` lists (selection, renaming,
dtype) and asks the writer how it lays them out: the ``Piece`` regions it stores, and where each
one's bytes go. Execution copies every piece to its place, from the source chunks it overlaps.

The output's format plans what it holds (``Format.plan_output``) and its writer (the
``format_interface.Writer`` protocol) where each piece goes. Under torchrun each rank writes only
its files and rank 0 the index (``dcptool.engine.distributed``); one process writes everything.

>>> planned = plan_convert(formats.open_checkpoint("step-100"), "hf", OutputRequest(dtype="bfloat16"))  # doctest: +SKIP
>>> report = planned.write("out-hf")                                                   # doctest: +SKIP
>>> report.tensors, report.bytes_written, report.left_out                              # doctest: +SKIP
(291, 16060522496, ['optimizer.param_groups', 'lr_scheduler'])
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dcptool import families, formats, models
from dcptool.engine import distributed, transfer
from dcptool.planning import lora as lora_weights
from dcptool.planning import quant
from dcptool.selection import (OPTIMIZER_ROOTS, ModelConfig, config_folder, model_part, out_tensors, read_config,
                               select)
from dcptool.engine.core import Checkpoint, ObjectInfo, OutObject, OutTensor, TensorInfo
from dcptool.errors import UsageError, option
from dcptool.family_interface import FamilyOptions
from dcptool.format_interface import Format, FormatOptions, Output, OutputRequest
from dcptool.options import Completeness, Quantize
from dcptool.sizes import DEFAULT_MAX_MEMORY
from dcptool.storage import check_destination, fsync_paths, fsync_tree, is_remote



@dataclass
class Report:
    """What a writing command did (or, with ``dry_run``, would do).

    ``left_out``: entries the writer could not hold; ``dropped``: entries of the source that planning did
    not choose, by kind (``left_out_by_kind``), each for its reason in ``reasons``, else ``why_left_out``;
    ``notes``: what planning renamed, made or left out, one line each; ``planned_files``: with
    ``dry_run``, the data files the writer would write and their bytes (metadata and index files are
    made at the end, from what was written).
    """

    destination: Path | str  # a URL for remote outputs
    format: str
    tensors: int = 0
    bytes_written: int = 0
    left_out: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dropped: dict[str, list[str]] = field(default_factory=dict)
    why_left_out: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    dry_run: bool = False
    planned_files: dict[str, int] = field(default_factory=dict)
    pushed_to: str | None = None  # export-hf --push-to-hub: the hub repo's URL
    not_read: list[str] = field(default_factory=list)  # files of the source no reader used, one line each


def hf_export_entries(checkpoint: Checkpoint, config_dir: str | Path | None = None, prefix: str | None = None,
                      dtype: str | None = None, include: str | None = None, exclude: str | None = None,
                      family: str = "auto", family_options: FamilyOptions | None = None, lora: LoraRequest | None = None):
    """The model weights to export under their HF names, the config folder to copy (or None), notes, and the
    config.json made from a Megatron-LM run's args when no config folder is given (or None).

    ``family`` is the naming family of the checkpoint's names (``auto``: detected; see ``dcptool.families``);
    other families' names become HF's, written with the hub family's ``family_options``. ``include`` / ``exclude`` match the names as saved.
    Without ``config_dir`` the config folder the reader found (``info["hf_config_dir"]``, e.g. verl's
    ``huggingface/``) is used; a config that ties the output to the embedding drops the output weight, which
    transformers recreates from the embedding.

    A peft-wrapped model (``dcptool.planning.lora``) is exported with ``lora``: its adapters merged into the base
    weights (``lora.mode == "merge"``), or as a PEFT adapter folder's tensors (``"adapter"``: the config
    folder returned is None); without it, refused.
    """
    named = select(model_part(checkpoint, prefix), include, exclude)
    if not named:
        raise UsageError(f"{checkpoint.root}: no model weights found (set the wrapper with {option('prefix')})")
    found = lora_weights.find(named, str(checkpoint.root))
    if found is not None and found.targets and lora is None:
        raise UsageError(f"{checkpoint.root}: the weights hold LoRA adapters ({', '.join(found.adapters)}): "
                         f"merge them into the model with {option('lora', 'merge')} or write a PEFT adapter folder "
                         f"with {option('lora', 'adapter')}")
    if lora is not None and (found is None or not found.targets):
        if lora.mode == "adapter":
            raise UsageError(f"{checkpoint.root}: no LoRA weights (lora_A / lora_B) to write an adapter folder of")
        lora = None
        notes = [f"{option('lora', 'merge')}: no LoRA weights in the checkpoint; its weights exported as they are"]
    else:
        notes = []
    if found is not None:
        named = found.base
    config_dir = config_dir or checkpoint.info.get("hf_config_dir")
    hub = families.hub()
    adapter_folder = bool(found is not None and found.targets) and lora.mode == "adapter"
    renamed = families.rename(named, hub.name, source=family,
                              config=read_config(config_dir) if config_dir is not None else None,
                              run=checkpoint.info, options=families.options_for(hub, {}, dtype, family_options),
                              where=str(checkpoint.root), hint=f"leave them out with {option('exclude')}",
                              make_config=config_dir is None, without_tied=not adapter_folder)
    named, mapping, notes = renamed.entries, renamed.mapping, notes + renamed.notes
    if adapter_folder:
        return (*_adapter_entries(checkpoint, found, lora, mapping, notes), None)
    if found is not None and found.targets:
        notes += _merge(checkpoint, found, lora, mapping, named, dtype, renamed.config)
    return out_tensors(named, dtype, keep_paths=False), config_dir, notes, renamed.made_config


@dataclass
class LoraRequest:
    """export-hf's ``options.Lora`` (merge or adapter, and where alpha comes from), and what planning made of it."""

    mode: str
    config: str | Path | None = None
    alpha: float | None = None
    adapter_config: dict | None = None  # planned: the adapter folder's adapter_config.json


def _renamer(mapping: families.Mapping | None, where: str, found):
    """``renamed(name, tensor) -> (hf name, tensor)``: a tensor laid out as the weight ``name`` is (a LoRA B's rows
    are the weight's), under the weight's HF name, as the mapping renames and reorders it."""
    experts = [name for name, pairs in found.targets.items() if any(p.experts for p in pairs.values())]
    if mapping is not None and experts:
        raise UsageError(f"{where}: LoRA on the grouped experts {experts[0]} of {mapping.source.name} names is not "
                         "supported (HF names are)")

    def renamed(name: str, tensor: TensorInfo) -> tuple[str, TensorInfo]:
        if mapping is None:
            return name, tensor
        result = mapping.convert({name: tensor}, model=False)
        if len(result.entries) != 1:
            raise UsageError(f"{where}: the LoRA weights of {name} cannot follow it to HF names")
        [(hf_name, (entry, _))] = result.entries.items()
        return hf_name, entry
    return renamed


def _merge(checkpoint: Checkpoint, found, lora: LoraRequest, mapping, named: dict, dtype: str | None,
           config: dict | None) -> list[str]:
    """Replace each targeted weight of ``named`` (HF names) by its merge with its adapters; notes."""
    where = str(checkpoint.root)
    given = lora_weights.settings(checkpoint, lora.config, lora.alpha)
    lora_weights.require_alpha(given, checkpoint.root)
    renamed = _renamer(mapping, where, found)
    tied = {tie.output.hf: tie.embedding.hf for tie in models.active_ties(config)}
    notes = [(f"merged {len(found.targets)} LoRA layers of {', '.join(found.adapters)} (lora_alpha {given.alpha} "
              f"from {given.where}{', rsLoRA' if given.rslora else ''}{', DoRA' if found.dora else ''})")]
    for name, pairs in found.targets.items():
        hf_name, _ = renamed(name, next(iter(pairs.values())).b)
        if hf_name in tied:
            raise UsageError(f"{where}: LoRA on {hf_name}, which the config ties to {tied[hf_name]}: the merged "
                             "model cannot hold both; untie them in config.json (tie_word_embeddings: false) first")
        pairs = {adapter: dataclasses.replace(pair, b=renamed(name, pair.b)[1],
                                              magnitude=pair.magnitude and renamed(name, pair.magnitude)[1])
                 for adapter, pair in pairs.items()}
        named[hf_name] = lora_weights.merged(hf_name, named[hf_name], pairs, given, dtype, where)
        outputs = [output for output, embedding in tied.items() if embedding == hf_name]
        if outputs:
            notes.append(f"merged LoRA into {hf_name}, which the config ties to {outputs[0]}: the head changes "
                         "too, as transformers ties them")
    return notes


def _adapter_entries(checkpoint: Checkpoint, found, lora: LoraRequest, mapping, notes: list[str]):
    """The PEFT adapter folder's tensors, no config folder, and notes; its adapter_config.json goes in ``lora``."""
    where = str(checkpoint.root)
    if len(found.adapters) != 1:
        raise UsageError(f"{where}: {option('lora', 'adapter')} writes one adapter, and the weights hold "
                         f"{len(found.adapters)} ({', '.join(found.adapters)}): merge them with {option('lora', 'merge')}")
    given = lora_weights.settings(checkpoint, lora.config, lora.alpha)
    lora_weights.require_alpha(given, checkpoint.root)
    renamed = _renamer(mapping, where, found)
    entries = lora_weights.adapter_entries(found, renamed)
    modules = [renamed(name, next(iter(pairs.values())).b)[0].removesuffix(".weight")
               for name, pairs in found.targets.items()]
    lora.adapter_config = lora_weights.adapter_config(found, given, modules)
    notes.append(f"adapter {found.adapters[0]!r}: {len(found.targets)} LoRA layers, lora_alpha {given.alpha} from "
                 f"{given.where}; the base model's weights left out")
    return out_tensors(entries, None, keep_paths=False), None, notes


def adapted(checkpoint: Checkpoint, target: str | None, source: str = "auto",
            config_dir: str | Path | None = None, options=None) -> tuple[Checkpoint, list[str], dict | None]:
    """The checkpoint with every entry under ``target``'s names (None: the source's family) and in its
    layout (``Family.engine_state``: where its job keeps model and optimizer), notes, and the config.json made from
    what the checkpoint says of its training run (a Megatron-LM run's args) when renamed without a config (or None).

    Model weights and the optimizer state that names them are renamed and laid out as the target
    family keeps them (views of the same bytes); other entries keep their keys. ``options``: the target
    family's (``families.options_for``: what Megatron names are written for, their vocabulary padding).
    """
    config_dir = config_dir or checkpoint.info.get("hf_config_dir")
    renamed = families.rename(model_part(checkpoint), target, source=source,
                              config=read_config(config_dir) if config_dir is not None else None,
                              run=checkpoint.info, options=options, where=str(checkpoint.root),
                              hint=f"check {option('family')} and {option('config_dir')}", state=checkpoint,
                              make_config=config_dir is None)
    if not renamed.changed:
        return checkpoint, renamed.notes, renamed.made_config
    tensors = {key: e for key, e in renamed.entries.items() if isinstance(e, TensorInfo)}
    objects = {key: e for key, e in renamed.entries.items() if isinstance(e, ObjectInfo)}
    return checkpoint.with_entries(tensors, objects), renamed.notes, renamed.made_config


def kept_config(checkpoint: Checkpoint, config_dir: str | Path | None = None, made: dict | None = None,
                dtype: str | None = None) -> ModelConfig | None:
    """The model's config an output of ``checkpoint`` keeps (``Conversion.keep_config``): the one the command
    used, ``config_dir``'s, else the one the checkpoint comes with (``selection.config_folder``), else ``made``
    (from its training run's args), with what the command changes said in it: ``dtype`` (a cast), no
    ``quantization_config`` once float8 weights are dequantized; and a peft model's ``adapter_config.json``
    (``lora.config_file``). None where there is none."""
    folder = config_dir or config_folder(checkpoint)
    if folder is None and made is None:
        return None
    config = read_config(folder) if folder is not None else made
    changed = _as_dequantized(config, checkpoint) | ({"dtype": dtype, "torch_dtype": dtype} if dtype else {})
    adapter = lora_weights.config_file(checkpoint) if lora_weights.is_peft(model_part(checkpoint)) else None
    if folder is None:
        return ModelConfig(None, changed, made_from="what the checkpoint says of its training run", adapter=adapter)
    return ModelConfig(folder, changed if changed != config else None, adapter=adapter)


def _as_dequantized(config: dict, checkpoint: Checkpoint) -> dict:
    """``config`` without its ``quantization_config`` once the checkpoint's float8 weights are dequantized (left in,
    it would make transformers quantize the weights again)."""
    if not checkpoint.info.get("dequantized"):
        return config
    return {key: value for key, value in config.items() if key != "quantization_config"}


def write_checkpoint(
    checkpoint: Checkpoint,
    destination: Path | str,
    to: str,
    tensors: list[OutTensor],
    objects: list[OutObject],
    *,
    overwrite: bool = False,
    max_memory: int = DEFAULT_MAX_MEMORY,
    fsync: bool = True,
    progress: Callable[[int], None] | None = None,
    writer_options: dict | None = None,
    across_ranks: bool | None = None,
    model_config: ModelConfig | None = None,
) -> Report:
    """Write ``tensors`` and ``objects`` of ``checkpoint`` as format ``to`` at ``destination``, atomically.

    Under torchrun (``across_ranks=None``) every rank must call it with the same arguments: each
    writes its share of the output files, and rank 0 the metadata or index (see ``dcptool.engine.distributed``);
    ``across_ranks=False`` makes this process write everything alone. A URL destination
    (``s3://bucket/step-100``) is written to a local staging folder, then uploaded through fsspec.
    ``model_config`` is written where the format keeps it (``Format.config_home``), inside the output before
    its commit.

    >>> ckpt = formats.open_checkpoint("step-100")                                          # doctest: +SKIP
    >>> output = formats.get("torch").plan_output(ckpt, OutputRequest())                      # doctest: +SKIP
    >>> write_checkpoint(ckpt, Path("step-100.pt"), "torch", output.tensors, output.objects)   # doctest: +SKIP
    """
    fmt = formats.get(to)
    refuse_read_only(fmt)
    upload = _Upload(str(destination), fmt) if is_remote(destination) else None
    try:
        return _write(checkpoint, destination, fmt, tensors, objects, upload, overwrite=overwrite,
                      max_memory=max_memory, fsync=fsync and not upload, progress=progress,
                      writer_options=writer_options, across_ranks=across_ranks, model_config=model_config)
    finally:
        if upload:
            upload.close()


def refuse_read_only(fmt: Format) -> None:
    """Refuse an output format dcptool reads but does not write (accelerate's Trainer folders)."""
    if not fmt.writable:
        raise UsageError(f"{option('to', fmt.name)}: dcptool reads {fmt.name} checkpoints but does not write them")


def _write(checkpoint, destination, fmt: Format, tensors, objects, upload: _Upload | None, *, overwrite, max_memory,
           fsync, progress, writer_options, across_ranks, model_config) -> Report:
    if upload is None and Path(checkpoint.root).resolve() == Path(destination).resolve():
        raise UsageError(f"{destination}: the output would replace its own source")
    ranks = distributed.ranks_for(progress, across_ranks)
    report = Report(upload.url if upload else Path(destination), fmt.name, tensors=len(tensors))
    prepare = (lambda: upload.prepare(overwrite)) if upload else None
    with ranks.output(upload.local if upload else Path(destination), overwrite, fmt.writes_folder,
                      prepare) as temporary:
        writer = fmt.writer(temporary, **(writer_options or {}))
        pieces = writer.plan(tensors, objects)  # the same on every rank
        mine = ranks.my_files(writer.files())
        placed = [(piece, *writer.place(piece)) for piece in pieces]
        try:
            crcs = transfer.copy_pieces(checkpoint, [p for p in placed if p[1] in mine], writer.out,
                                        crc=writer.NEEDS_CRC, max_memory=max_memory, flush=fsync,
                                        on_bytes=ranks.wrote)
            records = writer.finish_files(objects, mine, crcs)
        finally:
            writer.out.close()
        if upload:
            upload.send(writer.out.folder, mine)
        elif fsync and ranks.rank != 0:  # rank 0 flushes the whole folder below
            fsync_paths(writer.out.folder / name for name in mine)
        every_rank_records = ranks.gather(records)
        if ranks.rank == 0:
            report.left_out = writer.finish_index(objects, every_rank_records) or []
            if model_config is not None and fmt.config_home is not None:
                model_config.write(temporary / fmt.config_home)
            if upload and fmt.writes_folder:
                written = (path.relative_to(temporary).as_posix() for path in temporary.rglob("*") if path.is_file())
                upload.send(temporary, sorted(set(written) - set(writer.files())))
            elif fsync:
                fsync_tree(temporary)
    report.left_out = ranks.from_rank_zero(report.left_out)
    report.bytes_written = sum(piece.nbytes for piece in pieces)
    return report


class _Upload:
    """A URL destination: written to a local staging folder (under ``TMPDIR``; one per rank under
    torchrun), then uploaded through fsspec: every rank its own files, then rank 0 the rest (index,
    config), the files that complete the checkpoint (the format's ``completes``) last. Object stores
    have no atomic rename, so an interrupted upload never looks like a finished checkpoint.
    """

    def __init__(self, url: str, fmt: Format):
        from dcptool.storage import remote  # fsspec only for URLs

        self.remote, self.url, self.is_dir = remote, url.rstrip("/"), fmt.writes_folder
        self.completes = fmt.completes
        self._staging = tempfile.TemporaryDirectory(prefix="dcptool-staging-")
        self.local = Path(self._staging.name) / posixpath.basename(self.url)

    def prepare(self, overwrite: bool) -> None:
        """Before any upload (rank 0): refuse an existing output, or remove it with ``overwrite``."""
        if overwrite:
            self.remote.remove(self.url)
        else:
            check_destination(self.url, overwrite)

    def send(self, folder: Path, names) -> None:
        for name in sorted(names, key=lambda name: name in self.completes):
            self.remote.put(folder / name, f"{self.url}/{name}" if self.is_dir else self.url)

    def close(self) -> None:
        self._staging.cleanup()


@dataclass
class Conversion:
    """A planned write: what goes out of ``checkpoint`` as format ``to``, and notes on what planning renamed or
    left out. The CLI shows ``total_bytes`` as its progress bar's length, then calls ``write``."""

    checkpoint: Checkpoint
    to: str
    tensors: list[OutTensor]
    objects: list[OutObject]
    writer_options: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Why entries of the source are not in ``tensors``/``objects``, for the summary's "left out" line:
    # ``reasons`` for particular keys, ``why_left_out`` for the rest.
    why_left_out: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    # The model's config the output keeps where later commands find it (``keep_config``); None: none.
    model_config: ModelConfig | None = None

    @classmethod
    def of(cls, checkpoint: Checkpoint, to: str, output: Output, notes: list[str] = ()) -> Conversion:
        """The planned write of a format's ``Output``, after ``notes`` of the planning before it."""
        return cls(checkpoint, to, output.tensors, output.objects, output.writer_options, [*notes, *output.notes],
                   output.why_left_out, output.reasons)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def keep_config(self, config: ModelConfig | None) -> None:
        """Keep the model's ``config`` in the output where its format keeps it (``Format.config_home``), so that
        later commands find it without ``--config-dir``; a line says so, or why an output of one file cannot."""
        if config is None:
            return
        home = formats.get(self.to).config_home
        if home is None:
            self.notes.append(f"the model's config ({config.describe()}) is not kept: a {self.to} output is one "
                              f"file; give it to later commands with {option('config_dir')}")
            return
        self.model_config = config
        where = f"{home}/ of the output" if home else "the output"
        self.notes.append(f"kept the model's config in {where} for later commands: {', '.join(config.files())} "
                          f"({config.describe()})")

    def planned_files(self) -> dict[str, int]:
        """The files the writer would write, with their planned bytes, and the model's config it keeps;
        nothing is created (``--dry-run``)."""
        writer = formats.get(self.to).writer(Path(os.devnull) / "dry-run", **self.writer_options)
        writer.plan(self.tensors, self.objects)
        files = writer.files()
        if self.model_config is not None:
            home = formats.get(self.to).config_home
            files |= {posixpath.join(home, name): size for name, size in self.model_config.files().items()}
        return files

    def write(self, destination: Path | str, **options) -> Report:
        """Write it (``options``: those of ``write_checkpoint``); the report carries the notes."""
        report = write_checkpoint(self.checkpoint, destination, self.to, self.tensors, self.objects,
                                  writer_options=self.writer_options, model_config=self.model_config, **options)
        return self._explained(report)

    def dry_run(self, destination: Path | str) -> Report:
        """The report of the write, without writing: the files the writer plans, what would be left out."""
        report = Report(destination, self.to, tensors=len(self.tensors), bytes_written=self.total_bytes,
                        dry_run=True, planned_files=self.planned_files())
        return self._explained(report)

    def _explained(self, report: Report) -> Report:
        report.notes = list(self.notes)
        report.dropped = left_out_by_kind(self.checkpoint, self.tensors, self.objects)
        report.why_left_out, report.reasons = self.why_left_out, dict(self.reasons)
        report.not_read = list(self.checkpoint.info.get("not_read") or [])
        return report


def plan_convert(checkpoint: Checkpoint, to: str, request: OutputRequest | None = None, *,
                 family: str | None = None, config_dir: str | Path | None = None,
                 completeness: Completeness | None = None) -> Conversion:
    """What ``dcptool convert`` writes: what format ``to`` holds of the checkpoint (every key as saved unless
    the format says otherwise), under the names of naming family ``family``; ``request`` carries the output's options.

    Renamed to the hub's names (HF), its model weights are checked against the model the config describes
    (``dcptool.planning.completeness``), unless ``completeness`` is None.
    """
    fmt = formats.get(to)
    request = request or OutputRequest()
    refuse_read_only(fmt)
    formats.check_options(fmt, request.format_options)
    renamed, notes, made = adapted(checkpoint, family, config_dir=config_dir)
    planned = Conversion.of(renamed, to, fmt.plan_output(renamed, request), notes)
    planned.keep_config(kept_config(checkpoint, config_dir, made, request.dtype))
    if completeness is not None and family is not None and families.get(family).hub:
        config_dir = config_dir or renamed.info.get("hf_config_dir")
        written = {id(t.source) for t in planned.tensors}
        weights = [name for name, entry in model_part(renamed).items() if id(entry) in written]
        config = read_config(config_dir) if config_dir is not None else made
        planned.notes += _complete(config, weights, completeness, renamed, config_dir)
    return planned


def _complete(config: dict | None, names, completeness: Completeness, checkpoint: Checkpoint,
              config_dir: str | Path | None) -> list[str]:
    """``completeness.check`` of an output's HF names against ``config`` (``config_dir``'s, or one made from the
    run when None); its notes."""
    from dcptool.planning import completeness as complete
    from dcptool.storage import CheckpointFiles

    where = ("the config.json made from the run" if config_dir is None
             else str(CheckpointFiles(config_dir).path("config.json")))
    return complete.check(config, names, completeness, str(checkpoint.root), where)


def plan_export_hf(checkpoint: Checkpoint, *, config_dir: str | Path | None = None, prefix: str | None = None,
                   dtype: str | None = None, include: str | None = None, exclude: str | None = None,
                   family: str = "auto", family_options: FamilyOptions | None = None,
                   format_options: FormatOptions | None = None, lora: LoraRequest | None = None,
                   completeness: Completeness | None = None, quantize: Quantize | None = None) -> Conversion:
    """What ``dcptool export-hf`` writes: the model weights under HF names, with the config folder's files;
    with ``lora.mode == "adapter"``, a PEFT adapter folder instead. ``format_options``: the hf format's;
    ``quantize``: the linear weights quantized as they are written (``dcptool.planning.quant``).

    A config.json the weights do not fit is refused here, before anything is written (``dcptool.planning.hf_config``),
    and so are weights that lack parts of its model or hold more, unless ``completeness`` accepts them (None: not
    checked; ``dcptool.planning.completeness``).
    """
    from dcptool.planning import hf_config

    formats.check_options(formats.get("hf"), format_options)
    tensors, config_dir, notes, made_config = hf_export_entries(checkpoint, config_dir, prefix, dtype, include,
                                                                exclude, family, family_options, lora)
    if lora is not None and lora.adapter_config is not None:
        if quantize is not None:
            raise UsageError(f"{option('quantize', quantize.scheme)} quantizes a model's weights, not an adapter folder's: "
                             f"merge the adapters with {option('lora', 'merge')}")
        why = "an adapter folder holds the adapter's weights only"
        return Conversion(checkpoint, "hf", tensors, [], {"adapter_config": lora.adapter_config}, notes, why)
    config = hf_config.export_config(config_dir, tensors, dtype, made_config)
    config, dropped = hf_config.without_stale_quantization(config, tensors)
    if config is not None:
        config = _as_dequantized(config, checkpoint)
    if completeness is not None:  # the model's names, before quantizing adds scales
        notes += _complete(config, [t.key for t in tensors], completeness, checkpoint, config_dir)
    if quantize is None:
        notes += dropped
    else:
        tensors, config, more = quant.quantized(tensors, quantize, config, str(checkpoint.root))
        notes += more
    if config is None:
        notes.append("warning: no config.json written, so from_pretrained cannot load the export yet: "
                     f"give the model's config folder with {option('config_dir')}")
    options = format_options.writer_options() if format_options else {}
    selected = f", as selected by {option('include')}/{option('exclude')}" if include or exclude else ""
    why = "export-hf writes model weights only" + selected
    planned = Conversion(checkpoint, "hf", tensors, [], options, notes, why)
    if config is not None:  # beside the weights, where from_pretrained reads it
        planned.model_config = ModelConfig(config_dir, config, made_from="what the checkpoint says of its training run")
    return planned


def left_out_by_kind(checkpoint: Checkpoint, tensors: list[OutTensor], objects: list[OutObject]) -> dict[str, list[str]]:
    """The entries of ``checkpoint`` an output of ``tensors`` and ``objects`` does not hold, by kind:
    ``{"optimizer tensors": [...], "other tensors": [...], "non-tensor entries": [...]}`` (empty kinds left out).

    Weights renamed or split to another naming family are views, not the checkpoint's own entries: when the output
    holds any, the whole model part counts as carried (the renaming's notes say what it left out).
    """
    carried = {id(t.source) for t in tensors} | {id(o.source) for o in objects}
    carried |= {id(source) for o in objects for source in o.merged}  # objects made of several entries
    own = {id(e) for e in (*checkpoint.tensors.values(), *checkpoint.objects.values())}
    if not carried <= own:
        carried |= {id(e) for e in model_part(checkpoint).values()}
    found: dict[str, list[str]] = {"optimizer tensors": [], "other tensors": [], "non-tensor entries": []}
    for key, tensor in checkpoint.tensors.items():
        if id(tensor) not in carried:
            optimizer = OPTIMIZER_ROOTS & {str(part).split(".")[0] for part in tensor.path}  # flat keys too (Megatron)
            found["optimizer tensors" if optimizer else "other tensors"].append(key)
    found["non-tensor entries"] = [key for key, entry in checkpoint.objects.items() if id(entry) not in carried]
    return {kind: keys for kind, keys in found.items() if keys}
