"""The interface of a checkpoint format: what every module of ``dcptool/converters/`` implements.

A format module defines ``FORMAT``, an instance of a ``Format`` subclass; ``dcptool.formats`` finds
them by listing the package. Readers produce the format-neutral ``core.Checkpoint``; writers consume
``Output`` (tensors and objects as they go out) through the ``Writer`` protocol. A format's own options
are a ``FormatOptions`` dataclass it declares.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

from dcptool.engine.core import Checkpoint, OutObject, OutTensor, Piece
from dcptool.errors import UsageError, option
from dcptool.options import Options
from dcptool.safe_pickle import SafeGlobals
from dcptool.selection import out_tensors, select
from dcptool.storage import CheckpointFiles, OutputFiles


class Sharding(enum.Enum):
    """How a format's writer splits a checkpoint over ranks (``reshard`` asks this)."""

    NONE = "none"  # one file or one set of files for every rank (torch, hf)
    MESH = "mesh"  # a chunk per rank of any mesh, as ``dcp.save`` writes it (dcp, hf-dcp)
    DATA_PARALLEL = "data-parallel"  # one file per data-parallel rank (FSDP1's per-rank files)


class FormatOptions(Options):
    """Base of a format's own options: each format that takes any declares a frozen dataclass of them in its
    module (``Format.options``), built by name through ``dcptool.format_options("fsdp1", optim_form="flat")``
    (``formats.options``), which refuses what the format does not take.
    """

    def check(self) -> None:
        """Refuse values the format cannot take (a compression it does not have); by default none."""

    def writer_options(self) -> dict[str, Any]:
        """The options given, as its writer's keyword arguments."""
        return self.given()


@dataclass
class OutputRequest:
    """What a command asks of an output, whatever its format.

    ``world_size``: ranks of a per-rank output, and ``layout``: the chunks of each output tensor per rank, as
    ``reshard`` planned them (``(offsets, sizes, rank)`` per chunk); ``keep_rank_state``: keep state of single
    ranks of the source job; ``format_options``: the options of the output's own format (its ``options``).
    """

    dtype: str | None = None
    include: str | None = None
    exclude: str | None = None
    world_size: int | None = None
    layout: Callable[[OutTensor], list] | None = None
    keep_rank_state: bool = False
    format_options: FormatOptions | None = None


@dataclass
class Output:
    """What an output holds: its tensors and objects, the writer's options, and what planning says.

    ``why_left_out`` says why entries of the source are not in it (the summary's "left out" line);
    ``reasons`` gives the reason of particular keys; ``notes`` are lines for the user.
    """

    tensors: list[OutTensor]
    objects: list[OutObject]
    writer_options: dict[str, Any] = field(default_factory=dict)
    why_left_out: str = ""
    reasons: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class Writer(Protocol):
    """What ``Format.writer`` returns; ``dcptool.planning.conversion.write_checkpoint`` drives it.

    ``out`` is the ``storage.OutputFiles`` it writes; ``NEEDS_CRC`` whether its headers need each
    piece's CRC-32. ``plan`` gives the pieces it stores, ``files`` every output file with its planned
    bytes, ``place`` a piece's ``(file, offset)``; ``finish_files`` writes what is not piece data into
    the files this process wrote and returns what the index needs of them; ``finish_index`` writes the
    metadata or index from every writer's records and returns the entries the format cannot hold.
    """

    out: OutputFiles
    NEEDS_CRC: bool

    def plan(self, tensors: list[OutTensor], objects: list[OutObject]) -> list[Piece]: ...
    def files(self) -> dict[str, int]: ...
    def place(self, piece: Piece) -> tuple[str, int]: ...
    def finish_files(self, objects: list[OutObject], files: set[str], crcs: dict) -> dict: ...
    def finish_index(self, objects: list[OutObject], records: list[dict]) -> list[str]: ...


class Format(ABC):
    """One checkpoint format. Subclasses set the class attributes and give ``detect`` and ``read`` (the
    format module's functions, as ``detect = staticmethod(detect)``); a format dcptool writes sets
    ``writer_class`` (and overrides ``plan_output`` when its output holds something other than every
    entry as saved).

    >>> class Text(Format):
    ...     name = "text"
    ...     title = "plain text"
    ...     detect = staticmethod(lambda files: False)
    ...     read = staticmethod(lambda files: None)
    >>> Text().writable, Text().sharding.value
    (False, 'none')
    """

    name: ClassVar[str]
    title: ClassVar[str]  # what it is, in a few words (``dcptool --help`` lists every format's)
    writes_folder: ClassVar[bool] = True  # its output is a folder, else one file
    completes: ClassVar[tuple[str, ...]] = ()  # files uploaded last: without them the output is no checkpoint
    # Where its outputs keep the model's config (config.json, generation config, tokenizer files) for later commands:
    # a folder inside the output, "" for the output folder itself; None where the output is one file.
    config_home: ClassVar[str | None] = ""
    # Formats whose folders this one's are a kind of (a Megatron torch_dist folder is a DCP folder): when both
    # recognize a checkpoint, this one reads it.
    refines: ClassVar[tuple[str, ...]] = ()
    writer_class: ClassVar[Callable[..., Writer] | None] = None  # made as writer_class(destination, **options)
    sharding: ClassVar[Sharding] = Sharding.NONE
    compressions: ClassVar[tuple[str, ...]] = ()
    # torch's ``dcp.load`` with its ``FileSystemReader`` reads it (``verify --load-on`` runs that load).
    dcp_loadable: ClassVar[bool] = False
    # Its own options (a ``FormatOptions`` dataclass), if it takes any.
    options: ClassVar[type[FormatOptions] | None] = None
    # The classes its pickles may hold beyond torch's (its engine's enums and configs, read as data): the registry
    # lets the restricted unpickler take them when it loads the format.
    safe_globals: ClassVar[SafeGlobals] = SafeGlobals()

    @abstractmethod
    def detect(self, files: CheckpointFiles) -> bool:
        """Whether the files look like this format (cheap: names and magic bytes, no parsing)."""

    @abstractmethod
    def read(self, files: CheckpointFiles) -> Checkpoint:
        """The format-neutral description of the checkpoint; a broken one raises ``CheckpointError``."""

    def problems(self, checkpoint: Checkpoint) -> list[tuple[str, str]]:
        """``(name, what is wrong)`` of what a loader would trip on that ``read`` does not refuse (``dcptool
        check``): by default nothing."""
        return []

    @property
    def writable(self) -> bool:
        return self.writer_class is not None

    def writer(self, destination: Path, **writer_options) -> Writer:
        """A writer of this format into ``destination`` (a temporary folder or file, committed later)."""
        if self.writer_class is None:
            raise UsageError(f"{option('to', self.name)}: dcptool reads {self.name} checkpoints but does not write them")
        return self.writer_class(destination, **writer_options)

    def plan_output(self, checkpoint: Checkpoint, request: OutputRequest) -> Output:
        """What an output of this format holds of ``checkpoint``: by default every entry as saved, selected
        by ``include`` / ``exclude`` and cast to ``dtype``, with the request's options as writer options."""
        named = select(checkpoint.tensors, request.include, request.exclude)
        if not named:
            raise UsageError(f"{checkpoint.root}: no tensor matches the {option('include')}/{option('exclude')} filters")
        objects = [OutObject(key, obj.path, obj, checkpoint)
                   for key, obj in select(checkpoint.objects, request.include, request.exclude).items()]
        why = f"not selected by {option('include')}/{option('exclude')}" if request.include or request.exclude else ""
        return Output(out_tensors(named, request.dtype, keep_paths=True), objects, self.writer_options(request),
                      why_left_out=why)

    def writer_options(self, request: OutputRequest) -> dict[str, Any]:
        """The request's options this format takes, as its writer's keyword arguments."""
        chosen = request.format_options.writer_options() if request.format_options is not None else {}
        if request.layout is not None and self.sharding is Sharding.MESH:  # a reshard's chunks, rank by rank
            chosen.update(layout=request.layout, world_size=request.world_size)
        return chosen
