"""``python -m dcptool`` and the ``dcptool`` command: a Ctrl-C while the CLI's modules are still
being imported ends with the same one line as one later on (``dcptool/__init__.py`` handles it from
the package's first line, ``cli.main`` takes over from there)."""

import gc
import os

import dcptool


def run() -> None:
    # dcptool runs no linear algebra: numpy's OpenBLAS would start a spinning thread per core for nothing.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    gc.disable()  # imports make many objects and no garbage: collecting during them is wasted start-up
    dcptool._handle_interrupts_at_start()  # already, unless started in a way the package did not see as the command
    from dcptool.cli import main

    gc.freeze()  # the modules' objects live as long as the process: later collections need not walk them
    gc.enable()
    main()


if __name__ == "__main__":
    run()
