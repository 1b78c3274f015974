"""dcptool: inspect, convert, reshard and verify PyTorch distributed checkpoints (DCP, FSDP1, torch.save,
Hugging Face safetensors) offline and streaming, without torch.

The Python entry points are those of ``dcptool.api`` (see there): the commands as functions and the option
objects they take (``dcptool.options``), loaded on first use so that ``import dcptool`` and the command line
start fast; nothing imports torch unless asked to.

>>> import dcptool
>>> ckpt = dcptool.open("checkpoints/step-1000")                        # doctest: +SKIP
>>> ckpt["model.norm.weight"], ckpt.read("model.norm.weight")[:4]      # doctest: +SKIP
(TensorSpec(dtype='float32', shape=(4096,), nbytes=16384, chunks=2), array([1., 1., 1., 1.], dtype=float32))
>>> dcptool.export_hf("checkpoints/step-1000", "hf-1000", config_dir="base-model")   # doctest: +SKIP
>>> dcptool.reshard("step-1000", "step-1000-tp4", mesh=dcptool.MeshOptions(tp=4),      # doctest: +SKIP
...                 writing=dcptool.Writing(overwrite=True))
"""

from __future__ import annotations

import _signal  # signal's C half, loaded by the interpreter itself: importing it runs nothing
import sys


def _started_as_the_command() -> bool:
    """Whether the ``dcptool`` command is starting: its console script, or ``python -m dcptool`` (which
    imports the package while it looks for its ``__main__``), rather than a program importing dcptool."""
    if sys.argv[:1] == ["-m"]:
        args = sys.orig_argv
        return any(arg.startswith("-") and not arg.startswith("--")
                   and (arg.endswith("mdcptool") or (arg.endswith("m") and following == "dcptool"))
                   for arg, following in zip(args, [*args[1:], ""]))
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is None and (getattr(main, "__file__", None) or "").endswith("/dcptool")


def _exit_when_interrupted(signum, frame) -> None:
    """Ctrl-C while the command starts (before ``cli.main`` handles it): one line and exit 130 at once.

    Nothing has been written yet, and exiting from here cannot be cut short by code that catches
    exceptions while it imports (a KeyboardInterrupt would be, or print a traceback).
    """
    import os  # loaded at start-up: no import runs

    try:
        os.write(2, b"dcptool: interrupted\n")
    except OSError:
        pass
    os._exit(130)


def _handle_interrupts_at_start() -> None:
    """Ctrl-C from now until the command line takes over ends in one line (``_exit_when_interrupted``)."""
    _signal.signal(_signal.SIGINT, _exit_when_interrupted)


# Before anything else is imported: the command's start-up is mostly imports, this package's first.
if _started_as_the_command():
    _handle_interrupts_at_start()

from typing import TYPE_CHECKING

from dcptool.errors import (CheckpointError, CheckpointNotFoundError, DcptoolError, IncompleteModelError, MismatchError,
                            OutputExistsError, UnsafePickleError, UsageError)

if TYPE_CHECKING:
    from dcptool.api import (Completeness, HubPush, LoadOn, Lora, MeshOptions, Quantize, Reader, Reading,  # noqa: A004
                             Region, Selection, Side, TensorSpec, Tolerance, Writing, average, check, checksum, convert,
                             diff, export_hf, family_options, format_options, import_hf, inspect, open, reshard,
                             tensor_layout, verify)

# The library code behind the commands lives in modules named apart from them (dcptool.planning.conversion,
# .resharding, .verification, .checksums), so that these names are the functions.
__all__ = ["open", "Reader", "TensorSpec", "Region", "inspect", "tensor_layout", "convert", "export_hf", "import_hf",
           "reshard", "verify", "checksum", "check", "average", "diff", "format_options", "family_options", "Reading",
           "Writing", "Selection", "MeshOptions", "Completeness", "Lora", "Quantize", "HubPush", "Tolerance", "Side",
           "LoadOn", "api", "DcptoolError", "CheckpointError", "CheckpointNotFoundError", "UnsafePickleError",
           "UsageError", "IncompleteModelError", "OutputExistsError", "MismatchError"]


def __getattr__(name: str):
    """``dcptool.open`` and the other entry points, imported from ``dcptool.api`` when first asked for
    (the errors are imported above: only the names of ``dcptool.api`` come here)."""
    if name == "api":  # ``import dcptool; dcptool.api.convert(...)`` without importing dcptool.api by hand
        import dcptool.api

        return dcptool.api
    if name in __all__:
        from dcptool import api

        return getattr(api, name)
    raise AttributeError(f"module 'dcptool' has no attribute {name!r}")


def __dir__() -> list[str]:
    """``dir(dcptool)`` lists the entry points too, which are imported only when first asked for."""
    return sorted({*globals(), *__all__})
