"""The ``dcptool`` command line. Bad input exits 2 with one line naming the file; ``--debug`` shows tracebacks.

``main`` runs it: global flags moved to where click takes them (``_arranged``), then the command,
then the exit policy (an exception becomes an exit code and one line). The app and its global
options are in ``app``, what is printed in ``render``, shared options in ``options``, and each
command in a module of its own, which registers it on the app when imported.
"""

from __future__ import annotations

import re
import sys
import traceback

import typer

from dcptool import errors, families, formats
# Imported in the order `dcptool --help` lists the commands: each module registers its own.
from dcptool.cli import inspect, convert, export_hf, reshard, average, verify, diff, checksum, check  # noqa: F401, I001
from dcptool.cli.app import app
from dcptool.cli.render import settings

# Options of the whole program that may also follow the command name (moved before it), and
# command options that may also precede it (moved after it, for the commands that have them).
GLOBAL_FLAGS = ("--debug", "--quiet", "-q")
COMMAND_FLAGS_FIRST = ("--json",)


def _arranged(group: typer.core.TyperGroup, argv: list[str]) -> list[str]:
    """``argv`` with GLOBAL_FLAGS moved before the command name and COMMAND_FLAGS_FIRST after it.

    Option values are skipped by the command's own options (``--include -q`` keeps ``-q`` as the
    regular expression), and nothing after ``--`` moves.

    >>> _arranged(typer.main.get_command(app), ["--json", "inspect", "x", "--debug"])
    ['--debug', 'inspect', '--json', 'x']
    """
    at = next((i for i, arg in enumerate(argv) if arg in group.commands), None)
    if at is None:
        return argv
    command = group.commands[argv[at]]
    takes_value = {name for param in command.params if param.param_type_name == "option" and not param.is_flag
                   for name in param.opts}
    before, after, rest = list(argv[:at]), [], argv[at + 1:]
    i = 0
    while i < len(rest):
        arg = rest[i]
        if arg == "--":
            after += rest[i:]
            break
        if arg in GLOBAL_FLAGS:
            before.append(arg)
        else:
            after.append(arg)
            if arg in takes_value and i + 1 < len(rest):
                after.append(rest[i + 1])
                i += 1
        i += 1
    first = [arg for arg in before if arg in COMMAND_FLAGS_FIRST]
    return [arg for arg in before if arg not in COMMAND_FLAGS_FIRST] + [argv[at]] + first + after


def _command() -> typer.core.TyperGroup:
    """The click command of ``app``, its flags shown without a ``<bool>`` type in help, and its options of
    choices with a word (``--to FORMAT``) and the choices in their descriptions, which help at 80 columns
    shows whole (a metavar ``<dcp|fsdp1|hf|hf-dcp|torch>`` leaves descriptions a column too narrow)."""
    command = typer.main.get_command(app)
    for each in [command, *command.commands.values()]:
        help_option = each.get_help_option(command.context_class(each, help_option_names=["-h", "--help"]))
        for param in [*each.params, help_option]:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
            elif getattr(param.type, "choices", None) and param.param_type_name == "option":
                param.metavar = param.metavar or _choice_word(param.type.choices, param.name)
                param.help = _with_choices(param.help or "", param.type.choices)
    return command


def flags(group: typer.core.TyperGroup) -> dict[str, str]:
    """The flag of each option of the commands, by the key messages name it by (``errors.option``): the API's keyword
    (``family``: ``--adapter``) or the key of an option object's field (``format``: ``--from``, ``prefix_a``: ``--prefix-a``)."""
    return {param.name: next(opt for opt in param.opts if opt.startswith("--")) for command in group.commands.values()
            for param in command.params if param.param_type_name == "option"}


def _choice_word(choices, name: str) -> str:
    """What an option of ``choices`` takes, in a word: FORMAT, FAMILY, else its name's last (``FORM`` for optim_form)."""
    if set(choices) <= set(formats.names()):
        return "FORMAT"
    if set(choices) <= {"auto", *families.names()}:
        return "FAMILY"
    return name.rpartition("_")[2].upper()


def _with_choices(text: str, choices) -> str:
    """``text`` ending with the choices it does not already name each of (``Choices: a, b, c.``)."""
    named = all(re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", text) for choice in choices)
    return text if named else f"{text} Choices: {', '.join(choices)}.".lstrip()


# typer runs on its own copy of click, whose usage errors all derive from its ClickException.
CLICK_ERRORS = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
CLICK_ABORTS = typer.Abort


def main(argv: list[str] | None = None) -> None:
    """Run the command line; exits 0, 1 (a check found a difference), 2 (bad input, with one line
    naming the file), 3 (a bug in dcptool: please report it) or 130 (interrupted, with one line)."""
    import atexit
    import os
    import signal

    from dcptool import storage

    handling = storage.handle_interrupts() is not None  # Ctrl-C from here on: one line and exit 130, click or not
    if handling:  # ignored once the interpreter exits, past the last Python code that could act on it
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    error = None
    try:
        from dcptool.engine import distributed

        distributed.quiet_other_ranks()  # under torchrun only rank 0 prints, errors of every rank included
        command = _command()
        args = _arranged(command, sys.argv[1:] if argv is None else argv)
        with errors.options_as_flags(flags(command)):  # messages name --overwrite, not overwrite=True
            code = command.main(args=args, prog_name="dcptool", standalone_mode=False)
        if code == 130:  # typer's exit for a KeyboardInterrupt raised by other means than Ctrl-C
            print(f"dcptool: {distributed.describe_failure(KeyboardInterrupt())[1]}", file=sys.stderr)
    except CLICK_ERRORS as exc:  # one line, as every other refusal
        context = getattr(exc, "ctx", None)
        hint = f" (see {context.command_path} -h)" if context is not None else ""
        message = exc.format_message().replace("Value error, ", "")  # typer's prefix for a refused choice
        if message:
            print(f"dcptool: error: {message}{hint}", file=sys.stderr)
        else:  # no arguments: click shows the help
            exc.show()
        code = exc.exit_code
    except CLICK_ABORTS:
        from dcptool.engine import distributed

        print(f"dcptool: {distributed.describe_failure(KeyboardInterrupt())[1]}", file=sys.stderr)
        code = 130
    except SystemExit:
        raise
    except BaseException as exc:  # DcptoolError, OSError, Ctrl-C, and bugs (exit 3); under torchrun the other ranks stop too
        from dcptool.engine import distributed  # again: a Ctrl-C may have cut the first import short

        code, message = distributed.describe_failure(exc)
        if settings["debug"] and code != 130:
            traceback.print_exc()
        if code == distributed.EXIT_INTERNAL:
            hint = "a bug in dcptool: please report it, with the traceback above" if settings["debug"] else distributed.BUG_HINT
            print(f"dcptool: {message} ({hint})", file=sys.stderr)
        else:
            print(f"dcptool: {'' if code == 130 else 'error: '}{message}", file=sys.stderr)
        error = exc
    code = code if isinstance(code, int) else 0
    if handling:  # the outcome is decided and told: from now on Ctrl-C ends the process at once, with it
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: Python reports it at exit, as it would have
                pass
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
        if signal.getsignal(signal.SIGTERM) is storage.raise_interrupted:  # torchrun stopping the job, likewise
            signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))
    from dcptool.engine import distributed

    distributed.leave(code, error)
    del error  # its traceback holds a failed writer's open files: close them now, not during interpreter shutdown
    sys.exit(code)
