"""Reading a checkpoint's tensors from Python: ``dcptool.open`` and the ``Reader`` it returns.

>>> import tempfile, numpy as np, safetensors.numpy, dcptool
>>> folder = tempfile.mkdtemp()
>>> safetensors.numpy.save_file({"w": np.arange(12, dtype=np.float32).reshape(4, 3)}, f"{folder}/model.safetensors")
>>> dcptool.open(folder).read("w", (slice(1, 3),))
array([[3., 4., 5.],
       [6., 7., 8.]], dtype=float32)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import numpy as np

from dcptool import dtypes, formats
from dcptool.engine.core import Checkpoint, TensorInfo
from dcptool.errors import UsageError

if TYPE_CHECKING:
    import torch

# A part of a tensor: a slice or index per leading dim (numpy's basic indexing, steps of 1), or the
# box ``(offsets, sizes)`` with one entry per dim.
Region = Union[slice, int, tuple[Union[slice, int], ...], tuple[Sequence[int], Sequence[int]]]
READ_BUFFER = 16 * 2**20  # the most bytes one file read of ``Reader.read`` asks for


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype (torch's name: ``"bfloat16"``), global shape, size in bytes, and the chunks it is saved in."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunks: int


class Reader(Mapping[str, TensorSpec]):
    """An open checkpoint: a mapping of tensor keys (nested keys joined with ``.``) to ``TensorSpec``,
    and ``read`` for their values. Made by ``dcptool.open``; close it, or use it in a ``with`` block.

    ``format`` is the format read, ``objects`` the keys of non-tensor entries (step counters,
    scheduler state: not read, as they are pickles), ``info`` what the format records (world size...).
    """

    def __init__(self, checkpoint: Checkpoint):
        self._checkpoint = checkpoint
        self.path = str(checkpoint.root)
        self.format = checkpoint.format
        self.objects = list(checkpoint.objects)
        self.info = dict(checkpoint.info)

    def __getitem__(self, key: str) -> TensorSpec:
        tensor = self._checkpoint.tensors[key]
        return TensorSpec(tensor.dtype, tensor.shape, tensor.nbytes, len(tensor.chunks))

    def __iter__(self) -> Iterator[str]:
        return iter(self._checkpoint.tensors)

    def __len__(self) -> int:
        return len(self._checkpoint.tensors)

    def __repr__(self) -> str:
        return f"<dcptool.Reader {self.path} ({self.format}): {len(self)} tensors>"

    def read(self, key: str, region: Region | None = None, *, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """The values of tensor ``key``, or of a region of it, assembled from every chunk it overlaps.

        ``region`` is a slice or index per leading dim (``(slice(0, 2), 5)``: an integer drops its
        dim, as in numpy; steps other than 1 are refused) or ``(offsets, sizes)`` with one entry per
        dim. Only the region's bytes are read and held, so a slice of a tensor larger than memory works.

        Returns a numpy array; bfloat16 and float8 need ``ml_dtypes`` for that (numpy has no such
        types). With ``as_torch=True``: a torch tensor of the saved dtype (needs ``dcptool[torch]``).

        >>> import tempfile, numpy as np, safetensors.numpy, dcptool
        >>> folder = tempfile.mkdtemp()
        >>> safetensors.numpy.save_file({"w": np.arange(12, dtype=np.int64).reshape(4, 3)}, f"{folder}/model.safetensors")
        >>> with dcptool.open(folder) as ckpt:
        ...     ckpt["w"], ckpt.read("w", (slice(2, None), 1)), ckpt.read("w", ((1, 1), (1, 2)))
        (TensorSpec(dtype='int64', shape=(4, 3), nbytes=96, chunks=1), array([ 7, 10]), array([[4, 5]]))
        """
        tensor = self._checkpoint.tensors.get(key)
        if tensor is None:
            what = "a non-tensor entry" if key in self._checkpoint.objects else "not in it"
            raise UsageError(f"{self.path}: {key!r} is {what} (keys: list(dcptool.open(...)))", path=self.path, key=key)
        offsets, sizes, dropped = _box(tensor, region, f"{self.path}: {key}")
        itemsize = dtypes.dtype(tensor.dtype).itemsize
        raw = np.empty(sizes, dtype=dtypes.raw_view_type(itemsize))
        scratch = memoryview(bytearray(min(READ_BUFFER, max(raw.nbytes, 2**16))))
        self._checkpoint.read_region(tensor, offsets, sizes, raw, scratch)
        raw = raw.reshape([n for dim, n in enumerate(sizes) if dim not in dropped])
        return _torch_tensor(raw, tensor.dtype) if as_torch else _numpy_array(raw, tensor.dtype, f"{self.path}: {key}")

    def close(self) -> None:
        """Close the files read so far (a Reader keeps them open for the next read)."""
        self._checkpoint.files.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open(path: str | Path, format: str | None = None) -> Reader:  # noqa: A001 - dcptool.open, as builtins.open opens a file
    """Open the checkpoint at ``path`` (a folder or file of any format dcptool reads, a URL, or a
    Hugging Face hub repo id); ``format`` (dcp, fsdp1, torch, hf, ...) is detected when left out.
    Only metadata is read here; values are read by ``Reader.read``.

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((2, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> ckpt = dcptool.open(folder)
    >>> ckpt.format, list(ckpt), ckpt["w"].shape
    ('hf', ['w'], (2, 3))
    """
    return Reader(formats.open_checkpoint(path, format))


def _box(tensor: TensorInfo, region: Region | None, where: str) -> tuple[tuple[int, ...], tuple[int, ...], set[int]]:
    """``region`` of ``tensor`` as ``(offsets, sizes)`` and the dims an integer index drops."""
    shape = tensor.shape
    if region is None:
        return (0,) * len(shape), shape, set()
    if isinstance(region, (tuple, list)) and len(region) == 2 and all(isinstance(p, (tuple, list)) for p in region):
        offsets, sizes = (tuple(int(n) for n in part) for part in region)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise UsageError(f"{where}: region offsets {list(offsets)}, sizes {list(sizes)} do not fit its shape "
                             f"{list(shape)}")
        return offsets, sizes, set()
    index = region if isinstance(region, tuple) else (region,)
    if len(index) > len(shape):
        raise UsageError(f"{where}: region has {len(index)} entries for a tensor of {len(shape)} dims")
    offsets, sizes, dropped = [], [], set()
    for dim, length in enumerate(shape):
        item = index[dim] if dim < len(index) else slice(None)
        if isinstance(item, slice):
            start, stop, step = item.indices(length)
            if step != 1:
                raise UsageError(f"{where}: region steps other than 1 are not read; read the range and slice the array")
            offsets.append(start)
            sizes.append(max(0, stop - start))
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            position = int(item) + (length if item < 0 else 0)
            if not 0 <= position < length:
                raise UsageError(f"{where}: index {item} is out of range for dim {dim} of size {length}")
            offsets.append(position)
            sizes.append(1)
            dropped.add(dim)
        else:
            raise UsageError(f"{where}: a region is slices and integers, or (offsets, sizes); got {item!r}")
    return tuple(offsets), tuple(sizes), dropped


def _numpy_array(raw: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """The raw elements as numpy's type of ``dtype``; bfloat16 and float8 through ml_dtypes."""
    numpy_type = dtypes.dtype(dtype).numpy
    if numpy_type is not None:
        return raw.view(numpy_type)
    try:
        import ml_dtypes
    except ImportError:
        raise UsageError(f"{where} is {dtype}, which numpy has no type for: pip install ml_dtypes, "
                         "or read it with as_torch=True") from None
    if not hasattr(ml_dtypes, dtype):
        raise UsageError(f"{where} is {dtype}, which this ml_dtypes {ml_dtypes.__version__} lacks: upgrade it, "
                         "or read it with as_torch=True")
    return raw.view(getattr(ml_dtypes, dtype))


def _torch_tensor(raw: np.ndarray, dtype: str) -> torch.Tensor:
    """The raw elements as a torch tensor of ``dtype`` (sharing the array's memory)."""
    try:
        import torch
    except ImportError:
        raise UsageError("as_torch=True needs torch: pip install 'dcptool[torch]'") from None
    # torch has a signed integer type of every width: viewing it as the saved dtype restores the bits.
    return torch.from_numpy(raw.view(f"i{raw.itemsize}")).view(getattr(torch, dtype))
