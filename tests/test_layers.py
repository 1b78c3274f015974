"""The layers of the package (pyproject.toml's import-linter contracts, checked by `lint-imports` in
scripts/test.sh) name every module, so that a new one cannot escape them."""

import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def layered() -> dict[str, set[str]]:
    """Each layers contract's package (``dcptool``, or the container it lays out) -> the modules it names."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    named = {}
    for contract in config["contracts"]:
        if contract["type"] == "layers":
            [package] = contract.get("containers", ["dcptool"])
            prefix = "" if package == "dcptool" else f"{package}."
            named[package] = {prefix + name for layer in contract["layers"] for name in re.split(r"\s*[:|]\s*", layer)}
    return named


def test_every_module_of_the_package_is_in_a_layer():
    """The package's layers name each of its modules and packages; a package laid out in layers of its own
    names each of its modules there."""
    for package, names in layered().items():
        path = ROOT / package.replace(".", "/")
        modules = {f"{package}.{info.name}" for info in pkgutil.iter_modules([str(path)])}
        if package == "dcptool":
            modules.add("dcptool.converters")  # the link to converters/: pkgutil does not list it
        assert modules == names, package


def lint_imports(repo: Path) -> subprocess.CompletedProcess:
    """import-linter on the package at ``repo`` (its pyproject.toml's contracts), no cache."""
    env = dict(os.environ, PYTHONPATH=str(repo))
    return subprocess.run([Path(sys.executable).parent / "lint-imports", "--no-cache"], cwd=repo, env=env,
                          capture_output=True, text=True)


def test_the_contracts_hold_and_a_violation_breaks_them(tmp_path):
    """lint-imports on the package as it is passes; on a copy where a basic module imports a format, it fails."""
    lint = lint_imports(ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    copy = tmp_path / "repo"
    for folder in ("dcptool", "converters"):
        shutil.copytree(ROOT / folder, copy / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy)
    with open(copy / "dcptool" / "errors.py", "a") as errors:
        errors.write("\nfrom dcptool import formats  # an upward import\n")
    broken = lint_imports(copy)
    assert broken.returncode != 0 and "dcptool.errors -> dcptool.formats" in broken.stdout
