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
from dcptool.format_interface import Format, Layout

__all__ = ["FORMAT", "METADATA", "Dcp", "detect", "read"]


class Dcp(Format):
    """A PyTorch Distributed Checkpoint folder (``.metadata`` and ``__R_0.distcp`` files), as ``dcp.save`` writes it."""

    name = NAME
    title = "PyTorch DCP"
    completes = (METADATA,)  # without it the folder is no checkpoint
    layout = Layout.MESH
    compressions = ("zstd",)
    dcp_loadable = True
    options = ("compress",)

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer


FORMAT = Dcp()
