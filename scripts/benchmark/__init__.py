"""The parts of ``scripts/bench.py``: the model shapes it saves, the torch side of its runs (the saving job,
the peers), measuring a process tree, the rows, the report and the scale rows."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench.py"  # what every process of the bench runs: peers and torchrun workers too
