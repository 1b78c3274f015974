"""Reading tensors' global values region by region through fixed buffers: what every check and computation that
reads values (verify, diff, average, checksum, stats) reads with.

``dcptool.engine.transfer`` copies the pieces a writer asks for; a ``RegionReader`` reads a ``TensorInfo``'s values in
row-major slabs and says where each starts (comparisons report the first differing index). ``buffer_size``
shares a memory budget between readers.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dcptool import dtypes
from dcptool.engine import transfer
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.sizes import check_memory_budget
from dcptool.torch_archive.records import record_checks

# Elements handled at once by comparisons and scans: bounds their temporaries (a few MB), beside the budget.
BLOCK = 1 << 16


class RegionReader:
    """A tensor's global values as row-major slabs, read into halves of one reused ``buffer``.

    ``dcptool.engine.transfer`` does the same for the pieces a writer asks for; this one reads a
    ``TensorInfo`` and says where each slab starts (comparisons report the first differing index).

    >>> reader = RegionReader(checkpoint, bytearray(2**20))                      # doctest: +SKIP
    >>> for offsets, values in reader.slabs(checkpoint.tensors["model.norm.weight"]): ...   # doctest: +SKIP
    """

    def __init__(self, checkpoint: Checkpoint, buffer: bytearray):
        half = len(buffer) // 2
        self.checkpoint = checkpoint
        self.slab_buffer = memoryview(buffer)[:half]
        self.read_buffer = memoryview(buffer)[half:]

    def max_elements(self, tensor: TensorInfo) -> int:
        return max(1, len(self.slab_buffer) // dtypes.dtype(tensor.dtype).itemsize)

    def slabs(self, tensor: TensorInfo, max_elements: int | None = None) -> Iterator[tuple[tuple[int, ...], np.ndarray]]:
        """``(offsets, values)`` in row-major order; ``values`` is an unsigned view, valid until the next slab."""
        for offsets, sizes in transfer.slabs(tensor.shape, max_elements or self.max_elements(tensor)):
            # Records' CRC-32s are taken from the bytes as they are read (``passing``), not by reading them again.
            yield offsets, self.checkpoint.region_in(tensor, offsets, sizes, self.slab_buffer, self.read_buffer,
                                                     passing=True)
        checks = record_checks(self.checkpoint.files)
        if checks is not None:
            checks.finish(tensor.key)  # the tensor's records the slabs read only in part


def buffer_size(max_memory: int, tensors, readers: int = 1) -> int:
    """Bytes for each of ``readers`` ``RegionReader``s sharing ``max_memory``: no more than the largest of
    ``tensors`` needs, since fresh memory costs time to touch."""
    check_memory_budget(max_memory)
    largest = max((t.nbytes for t in tensors), default=0)
    return min(max_memory // readers, max(2 * largest, 2**15))
