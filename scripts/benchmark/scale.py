"""The scale rows (``--ranks``): dcptool and torch's own readers on synthetic checkpoints of many ranks."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from benchmark import REPO
from benchmark.measure import measure, remove, tail, warm
from benchmark.report import machine_info

# The test harness (tests/harness/) on the path of a process the bench starts.
HARNESS_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests"),
                                                                        os.environ.get("PYTHONPATH")])))

# id: (what runs, kind); SRC is the synthetic checkpoint of N ranks, OUT a fresh output folder.
SCALE_ROWS = {
    "inspect": (["-m", "dcptool", "inspect", "{src}"], "dcptool"),
    "reshard-dp8": (["-m", "dcptool", "reshard", "{src}", "{out}", "--dp", "8", "--no-fsync"], "dcptool"),
    "export-hf": (["-m", "dcptool", "export-hf", "{src}", "{out}", "--no-fsync"], "dcptool"),
    "convert-torch": (["-m", "dcptool", "convert", "{src}", "{out}", "--to", "torch", "--no-fsync"], "dcptool"),
    "verify": (["-m", "dcptool", "verify", "{src}", "{hf}"], "dcptool"),  # against its HF export
    "peer-read-metadata": (["-c", "from torch.distributed.checkpoint import FileSystemReader as R; "
                            "R('{src}').read_metadata()"], "peer"),
    "peer-torch-save": (["-c", "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                         "f('{src}', '{out}')"], "peer"),
}


def scale_bench(args) -> int:
    """Rows of ``SCALE_ROWS`` on checkpoints that ``harness.synth_dcp`` writes as N ranks of FSDP2 save
    them (Llama names, ``--scale-layers`` layers, narrow tensors of N rows: every rank holds a chunk of
    every tensor); results in OUT/scale.json, scale.md and scale.png (time and peak memory against N)."""
    out = args.out.resolve()
    work = (args.work or out / "work").resolve()
    logs = out / "logs"
    for folder in (out, work, logs):
        folder.mkdir(parents=True, exist_ok=True)
    results = []
    for ranks in args.ranks:
        src, target = work / f"synth-{ranks}r-{args.scale_layers}l", work / "scale-out"
        if not Path(f"{src}.done").is_file():
            remove(src)
            subprocess.run([sys.executable, "-m", "harness.synth_dcp", str(src), "--ranks", str(ranks),
                            "--layers", str(args.scale_layers)], check=True, cwd=REPO, env=HARNESS_ENV)
            Path(f"{src}.done").write_text("")
        hf = work / f"{src.name}-hf"  # what verify compares the checkpoint with: made once, not timed
        if not Path(f"{hf}.done").is_file():
            remove(hf)
            subprocess.run([sys.executable, "-m", "dcptool", "export-hf", str(src), str(hf), "--no-fsync"], check=True,
                           capture_output=True)
            Path(f"{hf}.done").write_text("")
        metadata_mb = (src / ".metadata").stat().st_size / 2**20
        for rid, (argv, kind) in SCALE_ROWS.items():
            if args.only and not re.search(args.only, rid):
                continue
            times, cpus, peaks = [], [], []
            for rnd in range(args.rounds):
                remove(target)
                warm([src])
                command = [sys.executable] + [a.format(src=src, out=target, hf=hf) for a in argv]
                wall, cpu, peak, code = measure(command, logs / f"scale-{rid}-{ranks}-{rnd}.log", args.timeout)
                if code != 0:
                    print(f"  {rid} at {ranks} ranks exited {code}:\n{tail(logs / f'scale-{rid}-{ranks}-{rnd}.log')}")
                times.append(wall)
                cpus.append(cpu)
                peaks.append(peak / 2**20)
            row = {"id": rid, "kind": kind, "ranks": ranks, "metadata_mb": round(metadata_mb, 1),
                   "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                   "cpu_s": statistics.median(cpus), "peak_mb": statistics.median(peaks)}
            print(f"  {ranks:>5} ranks  {rid:<20} {row['median_s']:8.1f} s  (CPU {row['cpu_s']:.1f} s)  "
                  f"{row['peak_mb']:8.0f} MB", flush=True)
            results.append(row)
        remove(target)
        if not args.keep:
            for path in (src, hf):
                remove(path)
                Path(f"{path}.done").unlink(missing_ok=True)
    (out / "scale.json").write_text(json.dumps({"machine": machine_info(), "layers": args.scale_layers,
                                                "rounds": args.rounds, "rows": results}, indent=1) + "\n")
    lines = ["| ranks | .metadata MB | row | time s (median) | CPU s | peak MB |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['ranks']} | {r['metadata_mb']} | {r['id']} | {r['median_s']:.1f} | {r['cpu_s']:.1f} | "
              f"{r['peak_mb']:.0f} |" for r in results]
    (out / "scale.md").write_text("\n".join(lines) + "\n")
    scale_chart(results, out / "scale.png", f"{args.scale_layers} layers, narrow tensors; "
                                             f"{machine_info().get('cpu_count')} CPUs")
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}")
    return 0


def scale_chart(results: list[dict], path: Path, title: str) -> bool:
    """Time and peak memory of every scale row against the rank count (solid: dcptool, dotted: torch)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (install it with: pip install -e '.[bench]')")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, label in ((axes[0], "median_s", "wall time, s"), (axes[1], "peak_mb", "peak memory, MB")):
        for rid in dict.fromkeys(r["id"] for r in results):
            series = sorted((r["ranks"], r[key], r["kind"]) for r in results if r["id"] == rid)
            dcp = series[0][2] == "dcptool"
            ax.plot([s[0] for s in series], [s[1] for s in series], marker="o" if dcp else "s",
                    ls="-" if dcp else ":", color=None, label=rid, lw=1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks that saved the checkpoint")
        ax.set_ylabel(label + " (log scale)")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
