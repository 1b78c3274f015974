"""PyTorch Distributed Checkpoint (DCP): a folder with ``.metadata`` and ``__{rank}_{n}.distcp`` files.

Read offline with no process group (``reader``): ``.metadata`` goes through dcptool's restricted
unpickler, its runs of chunk and storage records as columns (``metadata``), so inspecting a hostile
checkpoint of thousands of ranks runs no code and makes no object per chunk. Each tensor chunk is a
``torch.save`` archive at a known offset of a ``.distcp`` file. Written (``writer``) as ``dcp.save``
lays it out on any mesh, ``.metadata`` streamed.
"""

from __future__ import annotations

from dcptool.converters.dcp.names import METADATA, NAME
from dcptool.converters.dcp.reader import detect, read
from dcptool.converters.dcp.writer import Writer
from dataclasses import dataclass

from dcptool.errors import UsageError, option
from dcptool.format_interface import Format, FormatOptions, Sharding

__all__ = ["FORMAT", "METADATA", "Dcp", "DcpOptions", "detect", "read"]

COMPRESSIONS = ("zstd",)


@dataclass(frozen=True, kw_only=True)
class DcpOptions(FormatOptions):
    """The dcp output's own options: ``--compress``.

    Args:
        compress: compress the records as torch's zstd extension does (``dcp.load`` reads them; writing needs
            the zstandard package).

    Example:
        >>> DcpOptions(compress="zstd").writer_options()
        {'compress': 'zstd'}
    """

    compress: str | None = None

    def check(self) -> None:
        if self.compress is not None and self.compress not in COMPRESSIONS:
            raise UsageError(f"{option('compress', self.compress)}: {option('to', NAME)} compresses with "
                             f"{', '.join(COMPRESSIONS)}")


class Dcp(Format):
    """A PyTorch Distributed Checkpoint folder (``.metadata`` and ``__R_0.distcp`` files), as ``dcp.save`` writes it."""

    name = NAME
    title = "PyTorch DCP"
    completes = (METADATA,)  # without it the folder is no checkpoint
    sharding = Sharding.MESH
    compressions = COMPRESSIONS
    dcp_loadable = True
    options = DcpOptions

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer


FORMAT = Dcp()
