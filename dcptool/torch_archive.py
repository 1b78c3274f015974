"""``torch.save`` archives without torch: where each tensor's bytes are, and how to write one.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the pickled object, with
storages as persistent ids), ``<prefix>/data/<key>`` (the raw bytes of each storage, 64-byte
aligned), ``byteorder`` and ``version``. DCP stores each tensor chunk as such an archive at an
offset inside a ``.distcp`` file; FSDP1 and full state dicts are whole files of it.
"""

from __future__ import annotations

import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from dcptool import safe_pickle
from dcptool.errors import CheckpointError
from dcptool.storage import CheckpointFiles

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header, 30 bytes


@dataclass(frozen=True)
class RawBytes:
    """Elements stored at a byte offset of a file, laid out with ``strides`` (in elements)."""

    file: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @property
    def span(self) -> int:
        """Bytes from the first to one past the last element (what one read must cover)."""
        if any(s == 0 for s in self.shape):
            return 0
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        return (last + 1) * self.itemsize


class Archive:
    """One ``torch.save`` archive at ``[offset, offset+length)`` of a checkpoint file."""

    def __init__(self, files: CheckpointFiles, relative: str, offset: int = 0, length: int | None = None):
        self.files, self.relative, self.offset = files, relative, offset
        self.length = files.size(relative) - offset if length is None else length
        self.where = str(files.path(relative)) + (f" (record at byte {offset})" if offset else "")
        try:
            with zipfile.ZipFile(files.window(relative, offset, self.length)) as archive:
                infos = archive.infolist()
        except zipfile.BadZipFile as exc:
            raise CheckpointError(f"{self.where}: not a torch.save archive ({exc})") from None
        self._entries = {info.filename: info for info in infos}
        pickles = sorted((n for n in self._entries if n.endswith("data.pkl")), key=len)
        if not pickles:
            raise CheckpointError(f"{self.where}: not a torch.save archive (no data.pkl)")
        self.prefix = pickles[0][: -len("data.pkl")]

    def _data_offset(self, name: str) -> tuple[int, int]:
        """Absolute file offset and size of a stored (uncompressed) zip entry."""
        info = self._entries.get(self.prefix + name)
        if info is None:
            raise CheckpointError(f"{self.where}: archive has no entry {name!r}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.where}: entry {name!r} is compressed; torch.save never compresses")
        header = self.files.read(self.relative, self.offset + info.header_offset, _LOCAL_HEADER.size)
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != b"PK\x03\x04":
            raise CheckpointError(f"{self.where}: corrupt zip entry {name!r}")
        name_length, extra_length = fields[-2], fields[-1]
        start = self.offset + info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        return start, info.file_size

    def load(self) -> Any:
        """The archived object, with tensors as ``safe_pickle.TensorRef`` (no tensor bytes are read)."""
        start, size = self._data_offset("data.pkl")
        return safe_pickle.load_bytes(self.files.read(self.relative, start, size), f"{self.where}/data.pkl")

    def raw_bytes(self, tensor: safe_pickle.TensorRef) -> RawBytes:
        """Where the elements of ``tensor`` are in the file, checked against the storage's size."""
        start, size = self._data_offset(f"data/{tensor.storage.key}")
        itemsize = tensor.dtype.itemsize
        raw = RawBytes(self.relative, start + tensor.storage_offset * itemsize, tensor.shape, tensor.stride, itemsize)
        if tensor.storage_offset * itemsize + raw.span > size or size < tensor.storage.numel * itemsize:
            raise CheckpointError(f"{self.where}: tensor bytes lie outside storage data/{tensor.storage.key}")
        return raw
