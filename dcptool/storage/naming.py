"""How messages name files: as the user knows them, with the operation that failed.

An output is written under a temporary name (``storage.outputs.atomic_output``); while it is,
``showing`` makes messages name ``DESTINATION/FILE`` instead of the temporary's files, and
``annotate`` puts the file and the operation on an OSError, as the CLI prints it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_SHOWN: dict[str, str] = {}  # temporary -> destination, to name files in messages as the user knows them


@contextmanager
def showing(temporary: Path | str, destination: Path | str) -> Iterator[None]:
    """While writing: messages name ``destination/FILE`` instead of ``temporary/FILE``."""
    key = str(temporary)
    _SHOWN[key] = str(destination)
    try:
        yield
    finally:
        _SHOWN.pop(key, None)


def shown_path(path: Path | str) -> str:
    """``path`` as the user knows it: a file in a temporary output is named in its destination.

    >>> with showing("out/.step.dcptool-tmp-h-1-00000000", "out/step"):
    ...     shown_path("out/.step.dcptool-tmp-h-1-00000000/model.safetensors")
    'out/step/model.safetensors'
    """
    text = os.fspath(path)
    for temporary, destination in list(_SHOWN.items()):
        if text == temporary or text.startswith(temporary + os.sep):
            return destination + text[len(temporary):]
    return text


def annotate(exc: OSError, operation: str, path: Path | str, where: str = "") -> OSError:
    """Name the file and the operation in an OSError, as the CLI prints it (``distributed.describe_failure``)."""
    if getattr(exc, "dcptool_operation", None) is None:  # the innermost names it
        exc.filename = shown_path(path)
        exc.dcptool_operation = operation
        exc.dcptool_where = where
    return exc
