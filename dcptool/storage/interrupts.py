"""Ctrl-C in the command line: one line and exit 130 at any moment, and blocks it must not cut in half."""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) in the command line, raised by the handler that ``handle_interrupts`` installs.

    Not a KeyboardInterrupt, which click and typer turn into an exit of their own (and an empty
    line): this one passes through them to ``cli.main``, which prints one line and exits 130.
    Like KeyboardInterrupt, ``except Exception`` does not catch it.
    """


def handle_interrupts() -> Callable | int | None:
    """Make Ctrl-C raise ``Interrupted`` (from the main thread); returns the handler it replaces.

    Python runs the handler between any two instructions, also inside code whose exceptions it
    drops (a weakref callback of the import system, a ``__del__``), printing "Exception ignored":
    there, the interrupt is delivered again, to be raised at an instruction that can raise it.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if not getattr(sys.unraisablehook, "_dcptool", False):
        sys.unraisablehook = _redeliver_interrupt(sys.unraisablehook)
    return signal.signal(signal.SIGINT, raise_interrupted)


_redelivering = 0  # > 0 while handing back an interrupt that Python dropped


def _redeliver_interrupt(hook: Callable) -> Callable:
    def unraisable(info) -> None:
        global _redelivering
        if not isinstance(info.exc_value, Interrupted):
            hook(info)
            return
        _redelivering += 1
        try:
            _interrupt_again()
        finally:
            _redelivering -= 1

    unraisable._dcptool = True
    return unraisable


def _interrupt_again() -> None:
    """SIGINT to the main thread again, from another thread, once the code that dropped it has returned.

    A signal rather than ``_thread.interrupt_main``, which would run the handler at once, still in
    the hook; a signal also ends a blocking call at once. Should it come while still in the hook,
    ``raise_interrupted`` sends another.
    """
    timer = threading.Timer(0.005, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.daemon = True
    timer.start()


def interrupts_handled() -> bool:
    """Whether Ctrl-C raises ``Interrupted`` here (``handle_interrupts`` ran, in the command line)."""
    return signal.getsignal(signal.SIGINT) is raise_interrupted


def raise_interrupted(signum, frame) -> None:
    """The SIGINT handler of the command line: raise ``Interrupted``, unless Python would drop it here."""
    if _redelivering:  # in the hook, where it would be dropped again
        _interrupt_again()
        return
    raise Interrupted()


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Run a block that Ctrl-C must not cut in half: a SIGINT during it is acted on at its end.

    Also SIGTERM where Python handles it (torchrun stopping the job: ``distributed.quiet_other_ranks``).
    Only in the main thread, where Python runs signal handlers; elsewhere the block runs as it is.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
        previous = {number: handler for number, handler in previous.items() if callable(handler)}
    caught: list[tuple[int, object]] = []
    try:
        for number in previous:
            signal.signal(number, lambda signum, frame: caught.append((signum, frame)))
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if caught:
            number, frame = caught[0]
            previous[number](number, frame)
