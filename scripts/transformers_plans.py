#!/usr/bin/env python3
"""Write dcptool/models/transformers_plans.json: the TP and EP plans of every model the installed transformers knows.

Run it after upgrading transformers:

    python scripts/transformers_plans.py            # rewrites the snapshot
    python scripts/transformers_plans.py --check    # exit 1 when the snapshot is not this transformers' plans

For each model type transformers registers, its causal LM (else image-text-to-text, else base) model is built
from the config class's defaults on the meta device, and the plans the model resolves (``tp_plan``,
``ep_plan``: names relative to the class, ``*`` for layer numbers) are recorded with its persistent buffers,
as ``dcptool.models.transformers_plans.read_model`` reads them. Model types with neither plan are left out
(dcptool then knows no plan for them, as transformers has none). The file names the transformers version it
was written from; dcptool reads it when transformers is not installed, or is this very version.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dcptool.models import transformers_plans


def collect() -> tuple[dict, list[str]]:
    """The snapshot's content, and the model types that could not be built (with why)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    models, failed = {}, []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            with transformers_plans._quiet(transformers):
                found = transformers_plans.read_model(transformers, model_type)
        except Exception as exc:  # noqa: BLE001 (a model needing packages or arguments this install lacks)
            failed.append(f"{model_type}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        if found is not None and (found.tp or found.ep):
            models[model_type] = found.as_json()
    return {"transformers": transformers.__version__, "written_by": "scripts/transformers_plans.py",
            "models": models}, failed


def text(snapshot: dict) -> str:
    return json.dumps(snapshot, indent=1, sort_keys=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the snapshot differs from this transformers'")
    args = parser.parse_args()
    snapshot, failed = collect()
    for line in failed:
        print(f"not built: {line}", file=sys.stderr)
    written = transformers_plans.SNAPSHOT
    if args.check:
        if not written.is_file() or written.read_text() != text(snapshot):
            print(f"{written} is not the plans of transformers {snapshot['transformers']}: "
                  "run python scripts/transformers_plans.py", file=sys.stderr)
            return 1
        return 0
    written.write_text(text(snapshot))
    print(f"{written}: {len(snapshot['models'])} model types of transformers {snapshot['transformers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
