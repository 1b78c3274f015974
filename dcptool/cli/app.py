"""The typer app every command registers on, and its global options (--debug, --quiet, --version)."""

from __future__ import annotations

import os
import sys

import typer

from dcptool import formats
from dcptool.cli.render import EscapingStream, settings


def _formats_line() -> str:
    """Every format of the registry, by the name --from and --to take and what it is; those only read said so."""
    listed = [f"{fmt.name} ({fmt.title}{'' if fmt.writable else '; read only'})" for fmt in formats.all_formats().values()]
    return f"Formats (as --from and --to name them): {', '.join(sorted(listed))}."


app = typer.Typer(
    name="dcptool",
    help=f"Inspect, convert, reshard and verify PyTorch distributed checkpoints offline.\n\n{_formats_line()}",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"dcptool {version('dcptool')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("dcptool (not installed: no version recorded)")
        raise typer.Exit()


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks of errors (also after the command name)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars (also after the command name)."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
) -> None:
    settings["debug"], settings["quiet"] = debug, quiet
    if quiet or not sys.stderr.isatty():  # huggingface_hub's bars (hub downloads, uploads), like ours; read at its import
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if not isinstance(sys.stdout, EscapingStream):
        sys.stdout, sys.stderr = EscapingStream(sys.stdout), EscapingStream(sys.stderr)
