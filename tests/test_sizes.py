"""Sizes: one parser for the command line and the API, and the same defaults in both."""

import doctest
import shlex

import numpy as np
import pytest
import typer
from conftest import dcptool
from safetensors.numpy import save_file

from dcptool import Reading, cli, format_options, sizes
from dcptool.errors import UsageError, options_as_flags
from dcptool.sizes import parse_size


def test_doctests_run():
    result = doctest.testmod(sizes)
    assert result.failed == 0 and result.attempted >= 3


@pytest.mark.parametrize(("value", "expected"), [
    (0, 0), (4096, 4096), ("4096", 4096), ("4096B", 4096),
    ("1KB", 10**3), ("256MB", 256 * 10**6), ("5GB", 5 * 10**9), ("2TB", 2 * 10**12),
    ("64KiB", 64 * 2**10), ("256MiB", 256 * 2**20), ("1GiB", 2**30), ("1TiB", 2**40),
    ("256mib", 256 * 2**20), (" 5 GB ", 5 * 10**9), ("1.5KB", 1500), ("0.5MiB", 2**19), (".5KB", 500),
    ("1.0000005KB", 1000),  # a fraction of a byte is rounded down
])
def test_sizes_are_read_in_decimal_and_binary_units(value, expected):
    assert parse_size(value, "max_memory") == expected


@pytest.mark.parametrize("value", ["12XB", "", "MB", ".", "-5MB", "5 G B", "1e3", "5K", -1, True, 1.5, None])
def test_anything_else_is_refused_naming_the_option(value):
    """Named as the API's keyword argument, or as the command line's flag while it runs a command."""
    with pytest.raises(UsageError) as refused:
        parse_size(value, "max_shard_size")
    assert str(refused.value) == f"max_shard_size={value!r}: not a size such as 256MB, 5GB or 256MiB"
    if value is True:  # a flag set (--overwrite): the command line gives sizes as text
        return
    with options_as_flags({"max_shard_size": "--max-shard-size"}), pytest.raises(UsageError) as refused:
        parse_size(value, "max_shard_size")
    assert str(refused.value) == f"--max-shard-size {shlex.quote(str(value))}: not a size such as 256MB, 5GB or 256MiB"


def test_the_command_line_names_the_option_it_refuses(tmp_path):
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    result = dcptool("convert", tmp_path / "model.safetensors", tmp_path / "out", "--to", "torch", "--max-memory", "12XB",
                     check=False)
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip() == "dcptool: error: --max-memory 12XB: not a size such as 256MB, 5GB or 256MiB"


def _cli_defaults(option: str) -> set:
    """The defaults of ``option`` in every command of the CLI that takes it."""
    group = typer.main.get_command(cli.app)
    return {parameter.default for command in group.commands.values() for parameter in command.params
            if option in parameter.opts}


def test_the_command_line_and_the_api_default_to_the_same_sizes():
    """The command line's defaults are those of the API's option objects (dcptool.options, the hf format's own)."""
    [memory] = {parse_size(text, "max_memory") for text in _cli_defaults("--max-memory")}
    assert memory == Reading().budget() == sizes.DEFAULT_MAX_MEMORY == 256 * 2**20
    # None: not given, so the hf format's own default (convert takes --max-shard-size only with --to hf)
    assert _cli_defaults("--max-shard-size") == {None}
    assert parse_size(format_options("hf").max_shard_size, "max_shard_size") == 5 * 10**9
