"""dcptool as a Python library: open a checkpoint and read its tensors, or run a command as a function.

Each function does what the ``dcptool`` command of the same name does, with the same options
(``--from`` is ``source_format``), through the same library code, and returns the report that the
command prints instead of printing it. Bad input raises the exceptions of ``dcptool.errors``:
``CheckpointError`` for a checkpoint that cannot be read, ``UsageError`` for options that cannot
work together (the command exits 2 for both). A check that finds a difference is not an error
here: look at ``report.equal`` (verify) or ``result.ok`` (checksum, ``verify(load_on=...)``).
Sizes (``max_memory``, ``max_shard_size``) are bytes or text such as ``"256MB"`` or ``"5GB"``.

Nothing here imports torch unless asked to (``read(..., as_torch=True)``, ``verify(load_on=...)``).

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
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from dcptool import dtypes, formats
from dcptool.conversion import Report
from dcptool.transfer import DEFAULT_MAX_MEMORY
from dcptool.core import Checkpoint, TensorInfo
from dcptool.errors import UsageError
from dcptool.storage import output_path, parse_size

if TYPE_CHECKING:
    import torch

    from dcptool.checksums import Result
    from dcptool.loadcheck import LoadReport
    from dcptool.resharding import ReshardReport
    from dcptool.verification import Report as VerifyReport

__all__ = ["open", "Reader", "TensorSpec", "Region", "convert", "export_hf", "import_hf", "reshard", "verify",
           "checksum"]

# A part of a tensor: a slice or index per leading dim (numpy's basic indexing, steps of 1), or the
# box ``(offsets, sizes)`` with one entry per dim.
Region = Union[slice, int, tuple[Union[slice, int], ...], tuple[Sequence[int], Sequence[int]]]
Size = Union[int, str]
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
            raise UsageError(f"{self.path}: {key!r} is {what} (keys: list(dcptool.open(...)))")
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


def convert(source: str | Path, destination: str | Path, to: str, *, source_format: str | None = None,
            dtype: str | None = None, include: str | None = None, exclude: str | None = None, world_size: int = 1,
            max_shard_size: Size = "5GB", adapter: str | None = None, config_dir: str | Path | None = None,
            keep_rank_state: bool = False, optim_form: str | None = None, model_values: str | None = None,
            max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False, fsync: bool = True) -> Report:
    """``dcptool convert``: write ``source`` as format ``to`` (dcp, torch, hf, fsdp1), every key as saved.

    For ``to="fsdp1"`` (verl's per-rank files): ``world_size``, ``keep_rank_state``, and the forms
    ``optim_form`` (named, flat, orig, fsdp2) and ``model_values`` (sharded-tensor, dtensor[:DEVICE]).

    ``report.left_out`` lists what the format cannot hold, ``report.notes`` what an adapter renamed or left out.

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> report = dcptool.convert(folder, f"{folder}/dcp", to="dcp")
    >>> report.format, report.tensors, report.bytes_written
    ('dcp', 1, 48)
    """
    from dcptool import conversion

    checkpoint = formats.open_checkpoint(source, source_format)
    planned = conversion.plan_convert(checkpoint, to, dtype=dtype, include=include, exclude=exclude, adapter=adapter,
                                      config_dir=config_dir, world_size=world_size,
                                      max_shard_size=_bytes(max_shard_size), keep_rank_state=keep_rank_state,
                                      optim_form=optim_form, model_values=model_values)
    return planned.write(output_path(destination), **_writing(max_memory, overwrite, fsync))


def export_hf(source: str | Path, destination: str | Path, *, config_dir: str | Path | None = None,
              prefix: str | None = None, source_format: str | None = None, dtype: str | None = None,
              include: str | None = None, exclude: str | None = None, max_shard_size: Size = "5GB",
              adapter: str = "auto", hf_experts: str = "per-expert", max_memory: Size = DEFAULT_MAX_MEMORY,
              overwrite: bool = False, fsync: bool = True) -> Report:
    """``dcptool export-hf``: the model weights as Hugging Face safetensors under HF names, with
    ``config_dir``'s config and tokenizer files. (Push the folder with ``huggingface_hub`` or the CLI.)

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"model.norm.weight": np.ones(3, np.float32)}, f"{folder}/model.safetensors")
    >>> report = dcptool.export_hf(folder, f"{folder}/export", dtype="bfloat16")
    >>> report.tensors, report.bytes_written
    (1, 6)
    """
    from dcptool import conversion

    checkpoint = formats.open_checkpoint(source, source_format)
    planned = conversion.plan_export_hf(checkpoint, config_dir=config_dir, prefix=prefix, dtype=dtype,
                                        include=include, exclude=exclude, adapter=adapter, hf_experts=hf_experts,
                                        max_shard_size=_bytes(max_shard_size))
    return planned.write(output_path(destination), **_writing(max_memory, overwrite, fsync))


def reshard(source: str | Path, destination: str | Path, *, dp: int | None = None, tp: int = 1, ep: int = 1,
            etp: int | str = 1, cp: int = 1, dp_replicate: int = 1, world_size: int | None = None, plan: str = "auto",
            to: str = "dcp", keep_rank_state: bool = False, adapter: str | None = None,
            config_dir: str | Path | None = None, source_format: str | None = None, dtype: str | None = None,
            optim_form: str | None = None, model_values: str | None = None,
            max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False,
            fsync: bool = True) -> ReshardReport | Report:
    """``dcptool reshard``: lay ``source`` out for a mesh, as a job on it saves with ``dcp.save``
    (``to="fsdp1"``: per-rank FSDP1 files, in the forms ``optim_form`` and ``model_values`` choose, as in
    ``convert``). Plan problems raise ``UsageError``; ``report.warnings`` says what was dropped or kept
    (entries of single data-parallel ranks).

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> report = dcptool.reshard(folder, f"{folder}/dp2", dp=2)
    >>> report.mesh.describe(), sorted(p.name for p in Path(folder, "dp2").iterdir())
    ('2 ranks: dp=2', ['.metadata', '__0_0.distcp', '__1_0.distcp'])
    """
    from dcptool import resharding

    return resharding.reshard(source, output_path(destination), dp=dp, tp=tp, ep=ep, etp=etp, cp=cp,
                              dp_replicate=dp_replicate, world_size=world_size, plan=plan, to=to,
                              keep_rank_state=keep_rank_state, adapter=adapter, config_dir=config_dir,
                              source_format=source_format, dtype=dtype, optim_form=optim_form,
                              model_values=model_values, **_writing(max_memory, overwrite, fsync))


def import_hf(source: str | Path, destination: str | Path, *, dp: int | None = None, tp: int = 1, ep: int = 1,
              etp: int | str = 1, cp: int = 1, dp_replicate: int = 1, world_size: int | None = None,
              plan: str = "auto", adapter: str = "hf", config_dir: str | Path | None = None, dtype: str | None = None,
              max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False, fsync: bool = True) -> ReshardReport:
    """``dcptool import-hf``: a Hugging Face folder as a DCP checkpoint that ``dcp.load`` reads, laid
    out for the mesh, under the names of the job that loads it (``adapter``: hf, archon, torchtitan).

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> dcptool.import_hf(folder, f"{folder}/dcp", dp=2).mesh.world
    2
    """
    from dcptool import adapters, resharding

    if adapter not in adapters.JOB_WRAPPERS:
        raise UsageError(f"--adapter {adapter}: choose one of {', '.join(adapters.JOB_WRAPPERS)}")
    return resharding.reshard(source, output_path(destination), dp=dp, tp=tp, ep=ep, etp=etp, cp=cp,
                              dp_replicate=dp_replicate, world_size=world_size, plan=plan, adapter=adapter,
                              wrapper=adapters.JOB_WRAPPERS[adapter], config_dir=config_dir, source_format="hf",
                              dtype=dtype, **_writing(max_memory, overwrite, fsync))


def verify(a: str | Path, b: str | Path | None = None, *, roundtrip: str | None = None, atol: float | None = None,
           rtol: float | None = None, include: str | None = None, exclude: str | None = None,
           prefix_a: str | None = None, prefix_b: str | None = None, from_a: str | None = None,
           from_b: str | None = None, adapter_a: str = "auto", adapter_b: str = "auto",
           load_on: str | Mapping[str, int] | None = None, nproc: int | None = None, backend: str = "auto",
           plan: str = "auto", timeout: float = 600.0, max_memory: Size = DEFAULT_MAX_MEMORY) -> VerifyReport | LoadReport:
    """``dcptool verify``: compare ``a`` with ``b`` (any formats and layouts), or with its own round
    trip through format ``roundtrip``; bitwise unless ``atol``/``rtol``. ``report.equal`` says whether
    they match, ``report.differences`` how not. With ``load_on`` (``"dp=2,tp=2"``): load ``a`` with
    torch's ``dcp.load`` in a real job on that mesh (needs torch) and return its ``LoadReport`` (``.ok``).

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> dcptool.convert(folder, f"{folder}.pt", to="torch").tensors
    1
    >>> dcptool.verify(folder, f"{folder}.pt").equal
    True
    >>> safetensors.numpy.save_file({"w": np.zeros((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> [(d.key, d.kind, d.count) for d in dcptool.verify(folder, f"{folder}.pt").differences]
    [('w', 'value', 12)]
    """
    from dcptool import loadcheck, verification

    verification.check_arguments(b, roundtrip, load_on, prefix_a, prefix_b, from_b)
    memory = _bytes(max_memory)
    if load_on:
        mesh = loadcheck.parse_mesh(load_on) if isinstance(load_on, str) else dict(load_on)
        return loadcheck.run(a, mesh, nproc=nproc, backend=backend, plan=plan, timeout=timeout, include=include,
                             exclude=exclude)
    if roundtrip:
        return verification.roundtrip(a, roundtrip, source_format=from_a, include=include, exclude=exclude,
                                      max_memory=memory, atol=atol, rtol=rtol)
    return verification.compare(a, b, format_a=from_a, format_b=from_b, prefix_a=prefix_a, prefix_b=prefix_b,
                                include=include, exclude=exclude, family_a=adapter_a, family_b=adapter_b,
                                atol=atol, rtol=rtol, max_memory=memory)


def checksum(path: str | Path, *, write: bool = False, check: bool = False, against: str | Path | None = None,
             manifest: str | Path | None = None, scan_nonfinite: bool = False, prefix: str | None = None,
             against_prefix: str | None = None, source_format: str | None = None, threads: int = 0,
             max_memory: Size = DEFAULT_MAX_MEMORY, overwrite: bool = False) -> Result:
    """``dcptool checksum``: ``write`` an integrity manifest (a BLAKE3 hash per file and per tensor),
    ``check`` the checkpoint against it, or check another checkpoint ``against`` it by tensor hashes.
    ``result.ok`` says whether everything matches, ``result.problems`` what does not.

    >>> import tempfile, numpy as np, safetensors.numpy, dcptool
    >>> folder = tempfile.mkdtemp()
    >>> safetensors.numpy.save_file({"w": np.ones((4, 3), np.float32)}, f"{folder}/model.safetensors")
    >>> dcptool.checksum(folder, write=True).tensors
    1
    >>> dcptool.checksum(folder, check=True).ok
    True
    """
    from dcptool import checksums

    return checksums.run(path, write=write, check=check, against=against, manifest=manifest,
                         source_format=source_format, scan_nonfinite=scan_nonfinite, prefix=prefix,
                         against_prefix=against_prefix, overwrite=overwrite, max_memory=_bytes(max_memory),
                         threads=threads or None)


def _bytes(size: Size) -> int:
    """A size given as bytes or as text (``"256MB"``)."""
    if isinstance(size, int):
        return size
    try:
        return parse_size(size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _writing(max_memory: Size, overwrite: bool, fsync: bool) -> dict[str, Any]:
    """The options of ``convert.write_checkpoint`` that every writing command takes."""
    return {"max_memory": _bytes(max_memory), "overwrite": overwrite, "fsync": fsync}


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
