#!/usr/bin/env bash
# The main job on a demo checkpoint made here: a real 4-process gloo job saves an FSDP2 + TP model
# (dp=2, tp=2) as DCP; dcptool inspects it, exports it to Hugging Face safetensors, and checks
# the export against the full state dict the training job gathered itself; then lays the weights out
# in torchtitan names for a 2-rank job and compares them across the two naming families.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DCPTOOL_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"
export OMP_NUM_THREADS=1 PATH="$VENV/bin:$PATH"
OUT="${1:-demo-out}"
rm -rf "$OUT" && mkdir -p "$OUT"

echo "== a 4-process gloo job trains one step of a tiny Llama with FSDP2 (dp=2) + TP (tp=2) and saves DCP"
PYTHONPATH=tests "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m harness.gloo_jobs save-dcp "$OUT/step-1" --dp 2 --tp 2

echo "== dcptool inspect"
dcptool inspect "$OUT/step-1"

echo "== dcptool export-hf"
dcptool export-hf "$OUT/step-1" "$OUT/hf" --config-dir "$OUT/step-1.reference"

echo "== check: the export equals the full state dict the job gathered, and loads in transformers"
"$PY" - "$OUT" <<'PY'
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
out = sys.argv[1]
full = torch.load(f"{out}/step-1.reference/full.pt", weights_only=True)
exported = load_file(f"{out}/hf/model.safetensors")
assert exported.keys() <= full.keys() and exported, "exported keys differ"
for key, value in exported.items():
    assert torch.equal(value, full[key]), key
model = AutoModelForCausalLM.from_pretrained(f"{out}/hf")
print(f"{len(exported)} tensors equal bitwise; transformers loaded {type(model).__name__}")
PY

echo "== dcptool verify: the checkpoint against its export (the model part, bitwise; the optimizer and training state left out)"
dcptool verify "$OUT/step-1" "$OUT/hf"

echo "== the same weights for a torchtitan job on 2 ranks (its names, q/k rows in its RoPE order), and back"
dcptool import-hf "$OUT/hf" "$OUT/titan" --adapter torchtitan --dp 2
dcptool inspect "$OUT/titan" | tail -2
dcptool verify "$OUT/titan" "$OUT/hf" | tail -1
