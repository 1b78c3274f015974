"""What DCP calls things: the format, the files of a checkpoint folder, and the modules of torch's record classes."""

from __future__ import annotations

import re

NAME = "dcp"
METADATA = ".metadata"  # torch's Metadata, pickled: every entry, its chunks and where their records are
METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # Metadata, TensorStorageMetadata, MetadataIndex...
FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"  # _StorageInfo: a record's file, offset and length
DATA_FILE = re.compile(r"__(\d+)_(\d+)\.distcp$")


def data_file(rank: int) -> str:
    """The data file ``dcp.save`` writes on ``rank``: ``__3_0.distcp``."""
    return f"__{rank}_0.distcp"


def saving_rank(file: str) -> int | None:
    """The rank whose ``dcp.save`` wrote a data file (``__3_0.distcp`` -> 3)."""
    match = DATA_FILE.match(file)
    return int(match.group(1)) if match else None
