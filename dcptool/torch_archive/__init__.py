"""``torch.save`` archives without torch: where each tensor's bytes are, and how to write one.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` (the pickled object, with
storages as persistent ids), ``<prefix>/data/<key>`` (the raw bytes of each storage, 64-byte
aligned), ``byteorder`` and ``version``. DCP stores each tensor chunk as such an archive at an
offset inside a ``.distcp`` file; FSDP1 and full state dicts are whole files of it.

``reading``: ``Archive`` (its entries, its object, where a tensor's bytes are) and the chunk encoding
of archives; ``pickling``: pickles naming torch's classes, small (``dumps``) or streamed
(``PickleStream``); ``writing``: ``ArchiveLayout``, an archive laid out before its bytes are written.
"""

from dcptool.torch_archive.pickling import (Global, PickleStream, Reduced, StorageOut, Streamed, TensorOut, Unpicklable,
                                            dumps, new_object, torch_size)
from dcptool.torch_archive.reading import (TORCH_ARCHIVE, Archive, RawBytes, archive_prefix, chunk_bytes, chunk_label,
                                          record_name, row_major)
from dcptool.torch_archive.writing import ArchiveLayout, archive_bytes

__all__ = ["TORCH_ARCHIVE", "Archive", "ArchiveLayout", "Global", "PickleStream", "RawBytes", "Reduced", "StorageOut",
           "Streamed", "TensorOut", "Unpicklable", "archive_bytes", "archive_prefix", "chunk_bytes", "chunk_label", "dumps",
           "new_object", "record_name", "row_major", "torch_size"]
