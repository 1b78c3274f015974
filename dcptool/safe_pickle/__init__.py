"""A restricted unpickler for the pickles inside checkpoints, which never imports torch or runs their code.

Checkpoints come from other people's jobs, and ``pickle.load`` runs whatever a pickle names
(pytorch/pytorch#189308). This unpickler resolves only the globals in ``allowlist.ALLOWED`` and maps
each to a small stand-in: torch's record classes become ``Record`` objects with the same
attribute names, dtypes become their names, tensors inside ``torch.save`` archives become
``TensorRef`` descriptions of where their bytes are, numpy arrays and scalars of numeric dtypes
(RNG state) become numpy values made from their checked bytes. Any other global is refused with
``UnsafePickleError`` before anything is called. A format whose pickles hold classes of their own declares
them (``SafeGlobals``), and the format registry adds them (``add_safe_globals``): this package knows no format.

It is its own small pickle machine (``machine``, not ``pickle.Unpickler``), so that a pickle of N
bytes costs O(N) memory and time whatever it says: memo indices, string and byte lengths are checked
against the pickle's size before anything is allocated; the calls it allows, BUILD and hashing of
keys are charged to a work budget proportional to N (``calls``); dict and set keys are hashed only
when shallow, and never more than ``MAX_SAME_HASH`` distinct keys with one hash go into one
container (hash flooding). The result is checked before it is returned (``machine``): no cycles, at
most ``MAX_LEVELS`` levels of nesting, and at most a budget of objects when shared containers are
counted at every place they appear, so that code walking it (flattening, comparing, pickling it
again) stays linear and within Python's recursion limit too.

A caller that expects a million records of a few classes declares them (``RecordRun``, ``runs``):
runs of them are then read as columns, at C speed rather than an object per record, and stand in
the result as whatever the caller makes of those columns.

>>> load_bytes(pickle.dumps({"a": 1}), "x.pkl")
{'a': 1}
>>> load_bytes(pickle.dumps(print), "x.pkl")
Traceback (most recent call last):
dcptool.errors.UnsafePickleError: x.pkl: refuses to unpickle builtins.print, which is not a checkpoint type (nothing was executed)
"""

from __future__ import annotations

import gc
import pickle  # noqa: F401 (the doctests)
import struct
from typing import Any

from dcptool.errors import CheckpointError, printable
from dcptool.safe_pickle.allowlist import (Bad, Record, SafeGlobals, StorageRef, SubclassRef, TensorRef,
                                           add_safe_globals, record)
from dcptool.safe_pickle.machine import Machine
from dcptool.safe_pickle.runs import DIMS, INT, TEXT, Columns, RecordLayout, RecordRun

__all__ = ["DIMS", "INT", "TEXT", "Columns", "Record", "RecordLayout", "RecordRun", "SafeGlobals", "StorageRef",
           "SubclassRef", "TensorRef", "add_safe_globals", "load_bytes", "record"]


def load_bytes(data: bytes, source: str, runs: tuple[RecordRun, ...] = ()) -> Any:
    """Unpickle ``data`` with the allowlist; ``source`` names the file in error messages.

    ``runs``: runs of records the caller expects by the hundred thousand, read as columns and pushed as
    what their ``stand_in`` makes of them (DCP's ``.metadata`` reader passes its chunk and storage records).
    """
    machine = Machine(bytes(data), source, runs)
    collecting = gc.isenabled()
    gc.disable()  # the result holds no cycles (checked), and collections while building it cost a tenth of the time
    try:
        result = machine.run()
        if machine.shells:
            raise Bad("holds a numpy array without its data")
        machine.check(result)
        return result
    except CheckpointError as exc:
        text = str(exc)
        if text.startswith(source):
            raise
        raise type(exc)(f"{source}: {printable(text, 300)}") from None
    except Bad as exc:
        raise CheckpointError(f"{source}: not a valid checkpoint pickle ({printable(str(exc), 200)})") from None
    except struct.error:  # an opcode's argument cut off by the end
        raise CheckpointError(f"{source}: unreadable pickle (truncated: an argument runs past the end)") from None
    except (IndexError, KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError,
            MemoryError) as exc:  # a malformed pickle: stack underflow, wrong types, bad text
        message = printable(f"{type(exc).__name__}: {exc}", 160)
        raise CheckpointError(f"{source}: unreadable pickle ({message})") from None
    finally:
        machine.hashing.clear()
        machine.hashes.clear()
        if collecting:
            gc.enable()

