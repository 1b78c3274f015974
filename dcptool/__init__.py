"""dcptool: inspect, convert, reshard and verify PyTorch distributed checkpoints (DCP, FSDP1, torch.save,
Hugging Face safetensors) offline and streaming, without torch.

The Python entry points are those of ``dcptool.api`` (see there), loaded on first use so that
``import dcptool`` and the command line start fast; nothing imports torch unless asked to.

>>> import dcptool
>>> ckpt = dcptool.open("checkpoints/step-1000")                        # doctest: +SKIP
>>> ckpt["model.norm.weight"], ckpt.read("model.norm.weight")[:4]      # doctest: +SKIP
(TensorSpec(dtype='float32', shape=(4096,), nbytes=16384, chunks=2), array([1., 1., 1., 1.], dtype=float32))
>>> dcptool.export_hf("checkpoints/step-1000", "hf-1000", config_dir="base-model")   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dcptool.errors import (CheckpointError, CheckpointNotFoundError, DcptoolError, MismatchError, OutputExistsError,
                            UnsafePickleError, UsageError)

if TYPE_CHECKING:
    from dcptool.api import (Reader, Region, TensorSpec, check, checksum, convert, export_hf, import_hf, inspect,  # noqa: A004
                             open, reshard, tensor_layout, verify)

# The library code behind the commands lives in modules named apart from them (dcptool.conversion,
# .resharding, .verification, .checksums), so that these names are the functions.
_API = ("open", "Reader", "TensorSpec", "Region", "inspect", "tensor_layout", "convert", "export_hf", "import_hf",
        "reshard", "verify", "checksum", "check")

__all__ = [*_API, "api", "DcptoolError", "CheckpointError", "CheckpointNotFoundError", "UnsafePickleError", "UsageError",
           "OutputExistsError", "MismatchError"]


def __getattr__(name: str):
    """``dcptool.open`` and the other entry points, imported from ``dcptool.api`` when first asked for."""
    if name in _API:
        from dcptool import api

        return getattr(api, name)
    if name == "api":  # ``import dcptool; dcptool.api.convert(...)`` without importing dcptool.api by hand
        import dcptool.api

        return dcptool.api
    raise AttributeError(f"module 'dcptool' has no attribute {name!r}")


def __dir__() -> list[str]:
    """``dir(dcptool)`` lists the entry points too, which are imported only when first asked for."""
    return sorted({*globals(), *_API, "api"})
