"""``dcptool check``: everything torch or an engine would trip on in one checkpoint, found without loading it.

The checkpoint is opened as every command opens it (its metadata checked against the files, every tensor
covered by its chunks exactly once), each entry that fails there named and left out, then:

- every record (``torch.save`` archives: DCP chunks, ``torch.save`` and FSDP1 files) is checked as torch
  would check it and more: its zip structure, the CRC-32 of every entry over all of its bytes, and the
  tensor it pickles against the dtype and shape the metadata gives its chunk;
- records that overlap in their file;
- every non-tensor entry is unpickled by the restricted unpickler (its record checked whole);
- what the format itself knows a loader needs (``Format.problems``: an HF index against its shards);
- the model's ``config.json`` (given, or one that comes with it, in or beside it) against the weights' shapes (as
  transformers would build the model), and their names against what that model holds: parts it lacks (a vision
  tower, prediction layers, an untied ``lm_head``: ``missing``) and tensors the model has no place for
  (``unexpected``), as export-hf refuses them (``dcptool.planning.completeness``).

Values outside any record (safetensors files store no checksum) cannot be checked: the report counts those
tensors and says so (``Report.not_checked``), and ``dcptool checksum --write`` makes a manifest that covers them.

Every problem is collected (``Report.problems``), none stops the others. Records are checked by a few
threads, each reading its records' bytes once.

>>> report = check_checkpoint(formats.open_checkpoint("step-100"))   # doctest: +SKIP
>>> report.ok, [(p.kind, p.name) for p in report.problems]          # doctest: +SKIP
(False, [('record', 'model.layers.3.mlp.up_proj.weight')])
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from dcptool import encodings, formats
from dcptool.engine.chunks import RAW
from dcptool.engine.core import Checkpoint, TensorInfo, entry_problems
from dcptool.errors import CheckpointError, UsageError, counted, printable

# Why the values of tensors outside any record (safetensors) are not checked, and what does check them.
NO_CHECKSUM = "the format stores no checksum; use `dcptool checksum --write` for a manifest"

# Threads checking records: reading from disk overlaps, and CRC-32 releases the GIL.
THREADS = 4


@dataclass(frozen=True)
class Problem:
    """One thing a loader would trip on: its kind (``metadata``, ``cover``, ``record``, ``object``, ``checkpoint``,
    ``file``, ``config`` and what a format adds, e.g. ``index``), the entry or file it concerns, and the one-line
    message."""

    kind: str
    name: str
    detail: str


@dataclass
class Report:
    path: str
    format: str | None
    tensors: int = 0
    objects: int = 0
    records: int = 0
    bytes_checked: int = 0
    config: str | None = None  # the config.json the weights were checked against
    completeness: str | None = None  # what the weights' completeness was checked against, or why not
    problems: list[Problem] = field(default_factory=list)
    values_unchecked: int = 0  # tensors whose values no checksum covers (safetensors stores none)

    @property
    def ok(self) -> bool:
        return not self.problems

    def counts(self) -> dict[str, int]:
        """Problems by kind, in the order first found."""
        found: dict[str, int] = {}
        for problem in self.problems:
            found[problem.kind] = found.get(problem.kind, 0) + 1
        return found

    def not_checked(self) -> str | None:
        """What ``check`` could not check, in a line: the values of tensors whose format stores no checksum."""
        if not self.values_unchecked:
            return None
        every = self.values_unchecked == self.tensors
        what = "values" if every else f"values of {counted(self.values_unchecked, 'tensor')}"
        return f"{what} not checked: {NO_CHECKSUM}"

    def summary(self) -> str:
        checked = (f"{counted(self.tensors, 'tensor')} ({self.bytes_checked:,} bytes, {counted(self.records, 'record')}), "
                   f"{counted(self.objects, 'non-tensor entry', 'non-tensor entries')}"
                   + (", config.json" if self.config else ""))
        unchecked = f"; {self.not_checked()}" if self.not_checked() else ""
        if self.ok:
            return f"fine: {checked} checked{unchecked}"
        kinds = ", ".join(f"{n} {kind}" for kind, n in self.counts().items())
        return f"{counted(len(self.problems), 'problem')} ({kinds}): {checked} checked{unchecked}"

    def to_json(self) -> dict:
        unchecked = {"tensors": self.values_unchecked, "why": NO_CHECKSUM} if self.values_unchecked else None
        return {"path": self.path, "format": self.format, "ok": self.ok, "tensors": self.tensors,
                "objects": self.objects, "records": self.records, "bytes_checked": self.bytes_checked,
                "values_not_checked": unchecked, "config": self.config, "completeness": self.completeness,
                "counts": self.counts(),
                "problems": [{"kind": p.kind, "name": p.name, "detail": p.detail} for p in self.problems]}


def check_path(path, source_format: str | None = None, progress: Callable[[int], None] | None = None,
               config_dir=None) -> Report:
    """Check the checkpoint at ``path``: a path that is no checkpoint raises (exit 2). An entry that the
    metadata describes wrongly (its record missing or past its file's end, a chunk cover with a gap or an
    overlap) is a problem of its own, the entry left out and the rest checked (``core.entry_problems``); a
    checkpoint that cannot be opened at all is a report of that problem and those found before it."""
    name = source_format or formats.detect(path)
    with entry_problems() as found:
        try:
            checkpoint = formats.open_checkpoint(path, name)
        except CheckpointError as exc:
            problems = _entry_problems(found) + [Problem("checkpoint", str(path), str(exc))]
            return Report(str(path), name, problems=problems)
    try:
        report = check_checkpoint(checkpoint, progress, config_dir)
    finally:
        checkpoint.files.close()
    report.problems[:0] = _entry_problems(found)
    return report


def _entry_problems(found) -> list[Problem]:
    return [Problem(kind, key, str(error)) for kind, key, error in found]


def check_checkpoint(checkpoint: Checkpoint, progress: Callable[[int], None] | None = None,
                     config_dir=None) -> Report:
    """Every problem of an opened checkpoint (see the module's docstring); its model weights checked against
    ``config_dir``'s config.json, else the one it comes with."""
    report = Report(str(checkpoint.root), checkpoint.format, tensors=len(checkpoint.tensors),
                    objects=len(checkpoint.objects))
    advance = progress or (lambda n: None)
    with ThreadPoolExecutor(THREADS) as pool:
        for problems, records, covered in pool.map(lambda tensor: _check_tensor(checkpoint, tensor),
                                                   checkpoint.tensors.values()):
            report.problems += problems
            report.records += records
            report.values_unchecked += not covered
        for tensor in checkpoint.tensors.values():
            report.bytes_checked += tensor.nbytes
            advance(tensor.nbytes)
    report.problems += _overlapping_records(checkpoint)
    for key, obj in checkpoint.objects.items():
        try:
            checkpoint.object_value(obj)
        except CheckpointError as exc:
            report.problems.append(Problem("object", key, str(exc)))
    for name, detail in formats.get(checkpoint.format).problems(checkpoint):
        report.problems.append(Problem("index", name, detail))
    report.config, problems, report.completeness = _config_problems(checkpoint, config_dir)
    report.problems += problems
    return report


def _check_tensor(checkpoint: Checkpoint, tensor: TensorInfo) -> tuple[list[Problem], int, bool]:
    """The problems of a tensor's records, how many records it has, and whether a checksum covers all its
    values: each chunk's record checked whole and its pickled tensor against what the metadata says of the
    chunk. Raw bytes outside any record (safetensors) have no checksum to check."""
    problems, records, covered = [], 0, True
    for chunk in tensor.chunks:
        encoding = encodings.get(chunk.encoding) if chunk.encoding != RAW else None
        try:
            records += encoding is not None
            checkpoint.check_record(tensor, chunk)
            if encoding is not None:
                encoding.locate(checkpoint.files, tensor, chunk)
            else:
                in_record = checkpoint.record_of(tensor, chunk) is not None
                records += in_record
                covered &= in_record
        except CheckpointError as exc:
            problems.append(Problem("record", tensor.key, str(exc)))
    return problems, records, covered


def _overlapping_records(checkpoint: Checkpoint) -> list[Problem]:
    """Records that share bytes of their file: a loader reads one chunk's values for another's."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for tensor in checkpoint.tensors.values():
        for chunk in tensor.chunks:
            if chunk.encoding != RAW and chunk.view is None:
                spans.setdefault(chunk.file, []).append((chunk.offset, chunk.offset + chunk.length,
                                                         f"{tensor.key} chunk at {list(chunk.offsets)}"))
    problems = []
    for file, found in spans.items():
        found.sort()
        for (_, end, a), (begin, _, b) in zip(found, found[1:]):
            if begin < end:
                problems.append(Problem("file", file, f"{checkpoint.files.path(file)}: the records of "
                                                      f"{printable(a)} and {printable(b)} overlap"))
    return problems


def _config_problems(checkpoint: Checkpoint, config_dir=None) -> tuple[str | None, list[Problem], str | None]:
    """The config.json the model's weights are checked against (``config_dir``'s, else the one the checkpoint comes
    with: ``selection.config_folder``), the ways they do not fit it: shapes as transformers would build the
    model (``config``), and parts of that model they lack or tensors it has no place for (``missing``,
    ``unexpected``: ``dcptool.planning.completeness``), and what their completeness was checked against (or why
    it was not); (None, [], None) without a config."""
    from dcptool.planning import completeness, conversion, hf_config
    from dcptool.selection import config_folder, read_config
    from dcptool.storage import CheckpointFiles

    folder = config_dir or config_folder(checkpoint)
    if folder is None:
        return None, [], None
    where = str(CheckpointFiles(folder).path("config.json"))
    try:
        config = read_config(folder)
        tensors = conversion.hf_export_entries(checkpoint, config_dir=folder)[0]
    except (CheckpointError, UsageError) as exc:
        return where, [Problem("config", where, str(exc))], None
    problem = hf_config.misfit(config, {t.key: t.shape for t in tensors})
    if problem:
        return where, [Problem("config", where, f"{where} does not fit the weights: {problem}")], None
    found = completeness.find(config, [t.key for t in tensors])
    if found.not_checked:
        return where, [], f"not checked: {found.not_checked}"
    model = f"the model {where} describes ({found.source})"
    problems = [Problem("missing", names[0], f"the weights lack {completeness.missing_parts({part: names})} of {model}")
                for part, names in found.missing.items()]
    if found.unexpected:
        problems.append(Problem("unexpected", found.unexpected[0],
                                f"{completeness.unexpected_tensors(found.unexpected)} no place in {model}"))
    return where, problems, f"checked against {found.source}"
