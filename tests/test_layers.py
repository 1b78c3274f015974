"""The layers of the package (pyproject.toml's import-linter contracts, checked by scripts/lint_imports.sh in
scripts/test.sh) name every module, so that a new one cannot escape them."""

import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dcptool

ROOT = Path(__file__).resolve().parents[1]


def layer_modules() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [layers] = [contract["layers"] for contract in config["contracts"] if contract["type"] == "layers"]
    return {name for layer in layers for name in re.split(r"\s*[:|]\s*", layer)}


def test_every_module_of_the_package_is_in_a_layer():
    modules = {f"dcptool.{info.name}" for info in pkgutil.iter_modules(dcptool.__path__)} | {"dcptool.converters"}
    assert modules - layer_modules() == set()
    assert layer_modules() - modules == set()


def test_the_contracts_hold_and_a_violation_breaks_them(tmp_path):
    """lint-imports on the package as it is passes; on a copy where a basic module imports a format, it fails."""
    env = dict(os.environ, DCPTOOL_VENV=str(Path(sys.executable).parents[1]))
    lint = subprocess.run([ROOT / "scripts" / "lint_imports.sh"], capture_output=True, text=True, env=env)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    copy = tmp_path / "repo"
    for folder in ("dcptool", "converters", "scripts"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    with open(copy / "dcptool" / "errors.py", "a") as errors:
        errors.write("\nfrom dcptool import formats  # an upward import\n")
    broken = subprocess.run([copy / "scripts" / "lint_imports.sh"], capture_output=True, text=True, env=env)
    assert broken.returncode != 0 and "dcptool.errors -> dcptool.formats" in broken.stdout
