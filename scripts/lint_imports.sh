#!/usr/bin/env bash
# Check the layers of the package (pyproject.toml's [tool.importlinter] contracts) with import-linter.
# import-linter reads the package from disk, and converters/ installs as dcptool.converters (pyproject's
# package-dir), so the package is first laid out as installed: links in a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(realpath "${DCPTOOL_VENV:-.venv}")/bin/python"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir "$STAGE/dcptool"
for entry in dcptool/*; do ln -s "$PWD/$entry" "$STAGE/dcptool/"; done
ln -s "$PWD/converters" "$STAGE/dcptool/converters"
CONFIG="$PWD/pyproject.toml"
cd "$STAGE"
PYTHONPATH="$STAGE" "$(dirname "$PY")/lint-imports" "$CONFIG"
