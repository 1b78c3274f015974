"""docs/cli.md is what the command line prints: scripts/cli_reference.py regenerates it, and it must not differ."""

from __future__ import annotations

import difflib
import importlib.util

from conftest import ROOT


def _reference_script():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_up_to_date():
    script = _reference_script()
    written = script.PAGE.read_text() if script.PAGE.exists() else ""
    expected = script.render()
    if written != expected:
        diff = "".join(list(difflib.unified_diff(written.splitlines(True), expected.splitlines(True),
                                                 "docs/cli.md", "the command line's --help", n=1))[:40])
        raise AssertionError(f"docs/cli.md differs from the command line's help: run `{script.REGENERATE}` "
                             f"and commit it\n{diff}")

