"""Renames in one step: put a new output in place without replacing what appeared there, or swap it
with the output it replaces, with the system's calls where it has them and fallbacks where not.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from functools import cache
from pathlib import Path
from typing import Callable


def rename_noreplace(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` unless something is at ``target`` (``FileExistsError``), in one step.

    ``renameat2(RENAME_NOREPLACE)`` on Linux (``renamex_np(RENAME_EXCL)`` on macOS); where the system
    or the filesystem lacks it, a file is linked at ``target`` (which fails if anything is there) and
    unlinked at ``source``, and a folder is renamed: ``rename`` does not replace a folder that is
    not empty, nor a file, and outputs are never empty folders.
    """
    if rename2(source, target, exchange=False):
        return
    if not source.is_dir():
        try:
            os.link(source, target, follow_symlinks=False)
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK):
                raise
            if os.path.lexists(target):  # no hard links here: check, then rename
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
            os.rename(source, target)
            return
        os.unlink(source)
        return
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    try:
        os.rename(source, target)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        raise


_AT_FDCWD = -100
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # <linux/fs.h>
_RENAME_SWAP, _RENAME_EXCL = 2, 4  # macOS <stdio.h>
_SYS_RENAMEAT2 = {"x86_64": 316, "amd64": 316, "aarch64": 276, "arm64": 276, "riscv64": 276, "ppc64le": 357,
                  "s390x": 347, "i686": 353, "i386": 353}
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


@cache
def _renameat2() -> Callable[[bytes, bytes, bool], int] | None:
    """A call ``(source, target, exchange) -> 0 or -1`` (errno set) for the system's rename with flags; None without."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if sys.platform == "darwin":
        function = getattr(libc, "renamex_np", None)
        if function is None:
            return None
        function.argtypes, function.restype = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint], ctypes.c_int
        return lambda source, target, exchange: function(source, target, _RENAME_SWAP if exchange else _RENAME_EXCL)
    if not sys.platform.startswith("linux"):
        return None
    function = getattr(libc, "renameat2", None)  # glibc 2.28 and later, musl 1.2.2
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        return lambda source, target, exchange: function(
            _AT_FDCWD, source, _AT_FDCWD, target, _RENAME_EXCHANGE if exchange else _RENAME_NOREPLACE)
    number, syscall = _SYS_RENAMEAT2.get(platform.machine().lower()), getattr(libc, "syscall", None)
    if number is None or syscall is None:
        return None
    syscall.restype = ctypes.c_long
    return lambda source, target, exchange: syscall(
        ctypes.c_long(number), ctypes.c_int(_AT_FDCWD), ctypes.c_char_p(source), ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(target), ctypes.c_uint(_RENAME_EXCHANGE if exchange else _RENAME_NOREPLACE))


def rename2(source: Path, target: Path, exchange: bool) -> bool:
    """Rename without replacing (or, with ``exchange``, swap the two); False where unsupported.

    Raises ``FileExistsError`` when not replacing and ``target`` exists, ``FileNotFoundError``
    when exchanging and it does not, and the other OSErrors as they come.
    """
    function = _renameat2()
    if function is None:
        return False
    if function(os.fsencode(source), os.fsencode(target), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(source), None, str(target))
