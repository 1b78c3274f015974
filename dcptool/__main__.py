"""``python -m dcptool`` and the ``dcptool`` command: a Ctrl-C while the CLI's modules are still
being imported ends with the same one line as one later on (``cli.main`` takes over from there)."""

import gc
import os
import sys


def run() -> None:
    # dcptool runs no linear algebra: numpy's OpenBLAS would start a spinning thread per core for nothing.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    gc.disable()  # imports make many objects and no garbage: collecting during them is wasted start-up
    try:
        from dcptool.cli import main
    except KeyboardInterrupt:
        print("dcptool: interrupted", file=sys.stderr)
        sys.exit(130)
    gc.freeze()  # the modules' objects live as long as the process: later collections need not walk them
    gc.enable()
    main()


if __name__ == "__main__":
    run()
