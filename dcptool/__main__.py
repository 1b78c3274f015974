"""``python -m dcptool`` and the ``dcptool`` command: a Ctrl-C while the CLI's modules are still
being imported ends with the same one line as one later on (``cli.main`` takes over from there)."""

import sys


def run() -> None:
    try:
        from dcptool.cli import main
    except KeyboardInterrupt:
        print("dcptool: interrupted", file=sys.stderr)
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
