"""Errors of dcptool. The CLI maps them to exit codes: ``CheckpointError`` -> 2, ``MismatchError`` -> 1."""

from __future__ import annotations


class DcptoolError(Exception):
    """Base class of every error dcptool raises on purpose."""

    exit_code = 2


class CheckpointError(DcptoolError):
    """A checkpoint (or an argument naming one) is unusable: missing, broken, unsafe or unsupported.

    The message is one line that names the file and says what is wrong, e.g.
    ``ckpt/.metadata: not a DCP metadata file (truncated pickle)``.
    """


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global that is not on dcptool's allowlist; nothing was executed."""


class UsageError(DcptoolError):
    """Arguments that cannot work together, e.g. an output folder that already exists."""


class MismatchError(DcptoolError):
    """A check found a difference (exit code 1)."""

    exit_code = 1
