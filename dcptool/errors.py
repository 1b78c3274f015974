"""Errors of dcptool, and the checks of names and sizes read from files that raise them.

Every error dcptool raises on purpose is a ``DcptoolError``, and each also subclasses the builtin
that fits it, so that code knowing nothing of dcptool catches it as it would Python's own. Catch:

- ``CheckpointNotFoundError`` (a ``CheckpointError`` and a ``FileNotFoundError``): nothing at the
  path given as a checkpoint.
- ``CheckpointError`` (a ``ValueError``): a checkpoint that cannot be read, broken or unsupported;
  ``UnsafePickleError`` is the one whose pickle names a global off dcptool's allowlist.
- ``OutputExistsError`` (a ``UsageError`` and a ``FileExistsError``): the output is already there
  and ``overwrite`` was not given.
- ``UsageError`` (a ``ValueError``): options that cannot work together.
- ``IncompleteModelError`` (a ``UsageError``): an output that lacks parts of the model its config describes,
  or holds tensors that model has no place for, and no option accepts it.
- ``MismatchError``: a check found a difference (the commands raise it; the API returns reports).
- ``DcptoolError``: any of them.

``path`` names the file or folder an error is about and ``key`` the tensor, where one is known
(None otherwise); the message says the same in words. The CLI exits with ``exit_code``: 1 for
``MismatchError``, 2 for the others.

A message names an option as the caller gave it (``option``): a Python caller by the keyword argument or
the field of the option object it passed (``pass writing.overwrite=True to replace it``: ``dcptool.options``),
the command line's user by its flag (``pass --overwrite``). Messages name options by a key (``overwrite``,
``tp``); the command being run says how its caller spells each (``options_as_keywords``, ``options_as_flags``).

>>> import dcptool
>>> try:
...     dcptool.open("no-such-step")
... except FileNotFoundError as exc:
...     print(exc.path, "|", exc)
no-such-step | no-such-step: no such file or folder
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class DcptoolError(Exception):
    """Base class of every error dcptool raises on purpose; ``path`` and ``key`` say what it is about."""

    exit_code = 2
    # The message alone, also for the subclasses that are OSErrors: OSError's own text shows errno and filename.
    __str__ = BaseException.__str__

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        super().__init__(message)
        self.path, self.key = path, key


class CheckpointError(DcptoolError, ValueError):
    """A checkpoint (or an argument naming one) is unusable: missing, broken, unsafe or unsupported.

    The message is one line that names the file and says what is wrong, e.g.
    ``ckpt/.metadata: not a DCP metadata file (truncated pickle)``.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file or folder at the path given as a checkpoint (``path`` is that path)."""


class UnsafePickleError(CheckpointError):
    """A pickle asked for a global that is not on dcptool's allowlist; nothing was executed."""


class UsageError(DcptoolError, ValueError):
    """Options that cannot work together, e.g. ``svg`` without a tensor to draw."""


class IncompleteModelError(UsageError):
    """An output lacks parts of the model its config describes (which ``from_pretrained`` would fill with random
    weights), or holds tensors that model has no place for; ``missing``: the missing tensors' names by part
    (``vision``, ``mtp``, ``lm_head`` ...), ``unexpected``: the names it has no place for."""

    def __init__(self, message: str, *, missing: dict[str, list[str]], unexpected: list[str],
                 path: str | None = None):
        super().__init__(message, path=path)
        self.missing, self.unexpected = missing, unexpected


class OutputExistsError(UsageError, FileExistsError):
    """The output path is taken and ``overwrite`` was not given (``path`` is the output)."""


class MismatchError(DcptoolError):
    """A check found a difference (exit code 1)."""

    exit_code = 1


# Options named in messages: by a key, shown as the flag while the command line runs a command, else as the
# Python caller passed it while an API command runs, else as the key itself.
_NO_VALUE = object()
_flags: dict[str, str] = {}  # key -> flag, while the command line runs a command
_keywords: dict[str, str] = {}  # key -> the API's keyword or field of an option object, while an API command runs


def option(name: str, value=_NO_VALUE) -> str:
    """The option of key ``name``, with ``value`` if given, as a message names it: the flag while the command
    line runs (``options_as_flags``), else the API's keyword or option field (``options_as_keywords``), as
    ``keyword=value``. A flag ``--no-X`` stands for the value False.

    >>> option("max_memory", "12XB"), option("overwrite", True), option("include")
    ("max_memory='12XB'", 'overwrite=True', 'include')
    >>> with options_as_keywords({"max_memory": "reading.max_memory", "tp": "mesh.tp"}):
    ...     option("max_memory", "12XB"), option("tp", 3), option("tp")
    ("reading.max_memory='12XB'", 'mesh.tp=3', 'mesh.tp')
    >>> with options_as_flags({"max_memory": "--max-memory", "overwrite": "--overwrite", "include": "--include",
    ...                        "fsync": "--no-fsync"}):
    ...     option("max_memory", "12XB"), option("overwrite", True), option("include", "^model"), option("fsync", False)
    ('--max-memory 12XB', '--overwrite', "--include '^model'", '--no-fsync')
    """
    flag = _flags.get(name)
    if flag is None:
        shown = _keywords.get(name, name)
        return shown if value is _NO_VALUE else f"{shown}={value!r}"
    if value is _NO_VALUE or value is True or (value is False and flag.startswith("--no-")):
        return flag
    return f"{flag} {shlex.quote(str(value))}"


@contextmanager
def options_as_flags(flags: Mapping[str, str]) -> Iterator[None]:
    """Messages made meanwhile name options by these flags (key -> flag), as the command line takes them."""
    with _naming(_flags, flags):
        yield


@contextmanager
def options_as_keywords(keywords: Mapping[str, str]) -> Iterator[None]:
    """Messages made meanwhile name options as a Python caller passes them (key -> keyword or option field,
    ``tp`` -> ``mesh.tp``), unless the command line runs the command (its flags win)."""
    with _naming(_keywords, keywords):
        yield


@contextmanager
def _naming(table: dict[str, str], names: Mapping[str, str]) -> Iterator[None]:
    previous = dict(table)
    table.clear()
    table.update(names)
    try:
        yield
    finally:
        table.clear()
        table.update(previous)


# Checks of what a file says, shared by the readers: every name and size read from a file goes
# through them before it is used, and every message quotes names through ``printable``.

MAX_DIMS = 64  # torch's limit on a tensor's dimensions
SIZE_LIMIT = 2**63  # sizes, element and byte counts: what torch's int64 and the formats can hold


def printable(text, limit: int = 200) -> str:
    """``text`` safe for a one-line message: non-printable characters (newlines, NUL, lone surrogates)
    escaped as ``\\n``, ``\\x00``, ``\\ud800``, and cut to about ``limit`` characters.

    >>> printable("a\\ud800b\\n")
    'a\\\\ud800b\\\\n'
    """
    text = text if isinstance(text, str) else str(text)
    if len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def utf8_problem(name) -> str | None:
    """Why ``name`` cannot be a tensor name or file name (None when it can): not a string, or lone surrogates."""
    if not isinstance(name, str):
        return f"is {json_kind(name)}, not a string"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return f"{printable(name)!s} is not valid UTF-8 text (it holds a lone surrogate)"
    return None


def shape_problem(shape, itemsize: int = 1) -> str | None:
    """Why ``shape`` (a list or tuple read from a file) cannot be a tensor's shape, or None when it can:
    at most ``MAX_DIMS`` integers, each in ``[0, 2**63)``, with ``numel * itemsize < 2**63``.

    >>> shape_problem([0, 2**70, 2**70])
    'has dimension 2**70 (each must be below 2**63)'
    >>> shape_problem([2**40, 2**40], itemsize=2)
    'holds 2**80 elements of 2 bytes (at most 2**63 bytes)'
    """
    if len(shape) > MAX_DIMS:
        return f"has {len(shape)} dimensions (at most {MAX_DIMS})"
    numel = 1
    for n in shape:
        if type(n) is not int:
            return f"has a dimension that is a {type(n).__name__}, not an integer"
        if not 0 <= n < SIZE_LIMIT:
            return f"has dimension {_magnitude(n)} (each must be below 2**63)"
        numel *= n
    if numel * itemsize >= SIZE_LIMIT:
        return f"holds {_magnitude(numel)} elements of {itemsize} bytes (at most 2**63 bytes)"
    return None


def _magnitude(n: int) -> str:
    """A number as it reads best in a message: ``2**70`` for large powers of two, ``about 2**99`` for huge ones."""
    if n >= 2**32 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if abs(n) < 10**30:
        return str(n)
    return f"{'-' if n < 0 else ''}about 2**{abs(n).bit_length() - 1}"


def json_kind(value) -> str:
    """What a parsed value is, with its article, as JSON names it ("an object", "an array", "a string",
    "a number", "a boolean", "null"); other values by their Python type ("a Record")."""
    if value is None:
        return "null"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return with_article(names.get(type(value), type(value).__name__))


def with_article(noun: str) -> str:
    """``noun`` after "a" or "an" as its first letter asks: ``an object``, ``a string``."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """A count and its noun, singular for one: ``counted(1, "data file")`` is ``1 data file``, ``counted(2_048, "entry", "entries")`` ``2,048 entries``."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def parse_json(data: bytes, where) -> object:
    """JSON read from a file; CheckpointError (naming ``where``) for text that is not JSON or nests too deeply."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise CheckpointError(f"{where}: not valid JSON ({printable(str(exc), 120)})") from None


def file_name_problem(name) -> str | None:
    """Why ``name``, a file name read from a checkpoint's own index or metadata, cannot name one of its
    files (None when it can): not a string, empty, a NUL byte, or text that is not UTF-8."""
    if not isinstance(name, str):
        return f"is {json_kind(name)}, not a file name"
    if not name:
        return "is an empty file name"
    if "\x00" in name:
        return f"{printable(name)!s} holds a NUL byte"
    return utf8_problem(name)
