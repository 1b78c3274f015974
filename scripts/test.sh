#!/usr/bin/env bash
# Set up a virtual environment (CPU torch, pinned so pip takes the local wheel instead of CUDA builds)
# and run the whole test suite: real multi-process gloo jobs on CPU, no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DCPTOOL_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test,torch]"   # tests/test_install.py builds the wheel and installs it in fresh venvs
# megatron-core saves the Megatron checkpoints the tests read (tests/harness/megatron.py). It declares
# Python >= 3.12 but ships a cp311 wheel that runs; its own dependencies are left out (CUDA, TE, apex).
"$PY" -m pip install -q numpy 'packaging>=24.2' einops psutil triton
"$PY" -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2"
# torchtitan's own models and checkpoint code are oracles (tests/test_torchtitan_oracle.py, test_adapters.py);
# the parts they use import tyro and spmd_types only (its datasets, wandb, tensorboard serve training).
"$PY" -m pip install -q --no-deps "torchtitan==0.3.0" tyro docstring-parser "spmd_types==0.2.3"
# compressed-tensors reads export-hf --quant-format compressed-tensors back (tests/test_quantize.py); torch and
# transformers are the suite's own.
"$PY" -m pip install -q loguru "pydantic>=2"
"$PY" -m pip install -q --no-deps "compressed-tensors==0.20.0"
"$VENV/bin/lint-imports" --no-cache   # the layers of the package (pyproject.toml [tool.importlinter])
export OMP_NUM_THREADS=1
exec "$PY" -m pytest -q "$@"
