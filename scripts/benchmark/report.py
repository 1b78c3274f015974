"""The report: machine info, one summary per row with its ratios, the table, the targets of issue 5 and
the chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

from benchmark import REPO
from benchmark.rows import Row
from benchmark.shapes import Shape, human

# Targets of issue 5 (on a 2 GB checkpoint on the 2-core CI machine).
TARGET_RATIO_TO_CP = 2.0
TARGET_RATIO_TO_DURABLE = 1.25  # issue 12: copy commands (with fsync) against cp -r && sync
TARGET_PEAK_MB = 512
TARGET_INSPECT_S = 1.0
TARGET_QUANTIZED_RATIO = 1.5  # export-hf --quantize fp8 against the plain export of the same checkpoint (issue 31)
TARGET_MOE_RATIO = 1.10  # export-hf of an Archon MoE checkpoint against the dense one, per tensor byte
TARGET_MEGATRON_RATIO = 1.10  # export-hf of the dense bytes in Megatron-Core's layout against the dense export


def machine_info() -> dict:
    """CPUs, memory, Python, torch, dcptool and the commit: what results.json records of the machine."""
    info = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_average_at_start": list(os.getloadavg())}
    try:
        import importlib.metadata as md
        info["torch"] = md.version("torch")
        info["dcptool"] = md.version("dcptool")
    except Exception:  # noqa: BLE001
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gb"] = round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True).stdout.strip()
        info["git_commit"] = commit
    except OSError:
        pass
    return info


def summarize(rows: list[Row], size: dict) -> list[dict]:
    """One result per row. The ratios to cp -r and to the peer are of time per tensor byte of the checkpoint
    each row reads: plain time ratios but for export-hf-moe, whose MoE checkpoint is near, not at, the
    dense checkpoint's size."""
    by_id = {r.id: r for r in rows}
    med = {r.id: statistics.median(r.times) for r in rows}
    nbytes = {r.id: (r.source or size)["tensor_bytes"] for r in rows}
    per_byte = {rid: med[rid] / nbytes[rid] for rid in med}
    out = []
    for r in rows:
        peaks_mb = [p / 1e6 for p in r.peaks]
        peer = r.peer if r.peer in med else None  # not run (--only)
        out.append({
            "id": r.id, "name": r.name, "kind": r.kind, "peer": peer, "has_peer": bool(r.peer), "peer_name": by_id[peer].name if peer else None,
            "command": " ".join(r.argv if len(r.argv) < 12 else r.argv[:11] + ["..."]),
            "median_s": med[r.id], "min_s": min(r.times), "max_s": max(r.times), "times_s": r.times,
            "cpu_s": statistics.median(r.cpus), "cpus_s": r.cpus, "failed_runs": r.failures,
            "peak_mb": statistics.median(peaks_mb), "peak_mb_median": statistics.median(peaks_mb),
            "peak_mb_min": min(peaks_mb), "peak_mb_max": max(peaks_mb), "peaks_mb": peaks_mb,
            "floor": r.floor,
            "ratio_to_cp": per_byte[r.id] / per_byte[r.floor] if r.floor in med else float("nan"),
            "ratio_to_durable_cp": per_byte[r.id] / per_byte["cp-sync"] if "cp-sync" in med else None,
            "ratio_to_peer": per_byte[r.id] / per_byte[peer] if peer else None,
            "input_tensor_bytes": nbytes[r.id], "source": r.source,
            **size,
        })
    return out


def table(results: list[dict]) -> str:
    """The markdown table of ``results`` (one size's rows)."""
    lines = ["| row | time s, median (min-max) | x cp -r | x cp -r && sync | x peer | peak MB, median (min-max) | CPU s "
             "| peer |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | "
            f"{r['ratio_to_cp']:.2f} | "
            f"{'-' if r['ratio_to_durable_cp'] is None or r['floor'] != 'cp' else format(r['ratio_to_durable_cp'], '.2f')} | "
            f"{'-' if r['peer'] is None else format(r['ratio_to_peer'], '.2f')} | "
            f"{r['peak_mb_median']:.0f} ({r['peak_mb_min']:.0f}-{r['peak_mb_max']:.0f}) | {r['cpu_s']:.2f} | "
            f"{'(itself)' if r['peer'] == r['id'] else r['peer_name'] or ('(not run)' if r['has_peer'] else '(none)')} |")
    return "\n".join(lines)


def targets(results: list[dict], main_size: str) -> list[dict]:
    """The targets of issue 5, evaluated on the rows of the main size (and memory over all sizes)."""
    rows = {r["id"]: r for r in results if r["size"] == main_size}
    out = []
    for rid in ("export-hf", "convert-torch", "reshard-dp4", "reshard-tp4"):
        if rid in rows:
            v = rows[rid]["ratio_to_cp"]
            out.append({"target": f"{rid}: wall time <= {TARGET_RATIO_TO_CP}x cp -r", "value": round(v, 2),
                        "met": v <= TARGET_RATIO_TO_CP})
    for rid in ("export-hf", "convert-torch", "reshard-dp4", "reshard-tp4", "import-hf"):
        if rid in rows and rows[rid]["ratio_to_durable_cp"] is not None:
            v = rows[rid]["ratio_to_durable_cp"]
            out.append({"target": f"{rid}: wall time <= {TARGET_RATIO_TO_DURABLE}x cp -r && sync (issue 12)",
                        "value": round(v, 2), "met": v <= TARGET_RATIO_TO_DURABLE})

    def per_byte_against_dense(rid: str, target: float, what: str) -> None:
        """The row's time per tensor byte against export-hf's (dense HF names), the same shape of work."""
        row, dense = rows[rid], rows["export-hf"]
        v = (row["median_s"] / row["input_tensor_bytes"]) / (dense["median_s"] / dense["input_tensor_bytes"])
        out.append({"target": f"{rid}: time per tensor byte <= {target}x export-hf's ({what})",
                    "value": round(v, 3), "met": v <= target})

    if "export-hf-fp8" in rows and "export-hf" in rows:
        v = rows["export-hf-fp8"]["median_s"] / rows["export-hf"]["median_s"]
        out.append({"target": f"export-hf-fp8: wall time <= {TARGET_QUANTIZED_RATIO}x export-hf's", "value": round(v, 2),
                    "met": v <= TARGET_QUANTIZED_RATIO})
    if "export-hf-moe" in rows and "export-hf" in rows:
        per_byte_against_dense("export-hf-moe", TARGET_MOE_RATIO,
                               "Archon grouped experts -> HF per-expert vs dense HF names")
    if "export-hf-megatron" in rows and "export-hf" in rows:
        per_byte_against_dense("export-hf-megatron", TARGET_MEGATRON_RATIO,
                               "Megatron-Core's stacked, fused tensors -> HF vs the same bytes in HF names")
        megatron, dense = rows["export-hf-megatron"], rows["export-hf"]
        v = megatron["peak_mb"] / dense["peak_mb"]
        out.append({"target": f"export-hf-megatron: peak memory <= {TARGET_MEGATRON_RATIO}x export-hf's (same budget)",
                    "value": round(v, 3), "met": v <= TARGET_MEGATRON_RATIO})
    for rid, r in rows.items():
        if r["kind"] == "dcptool" and rid != "inspect":
            out.append({"target": f"{rid}: peak memory <= {TARGET_PEAK_MB} MB", "value": round(r["peak_mb"]),
                        "met": r["peak_mb"] <= TARGET_PEAK_MB})
    sizes = sorted({r["size_bytes"] for r in results})
    if len(sizes) > 1:
        for rid in rows:
            series = {r["size_bytes"]: r["peak_mb"] for r in results if r["id"] == rid}
            if rows[rid]["kind"] == "dcptool" and len(series) > 1:
                growth = series[max(series)] / series[min(series)]
                out.append({"target": f"{rid}: peak memory flat ({human(min(series))} -> {human(max(series))})",
                            "value": round(growth, 2), "met": growth <= 1.25})
    if "inspect" in rows:
        v = rows["inspect"]["median_s"]
        out.append({"target": f"inspect of {rows['inspect'].get('inspect_tensors')} tensors < {TARGET_INSPECT_S}s",
                    "value": round(v, 2), "met": v < TARGET_INSPECT_S})
    if "checksum" in rows and "sha256sum" in rows:
        v = rows["checksum"]["median_s"] / rows["sha256sum"]["median_s"]
        out.append({"target": "checksum --write at least as fast as sha256sum (ratio <= 1)", "value": round(v, 2),
                    "met": v <= 1.0})
    return out


COLORS = {"floor": "#888888", "dcptool": "#1f77b4", "peer": "#ff7f0e"}


def chart(results: list[dict], main_size: str, path: Path, title: str) -> bool:
    """Draw bench.png (time and peak memory of the main size's rows; peak memory against size with several
    sizes); False, with a message, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (install it with: pip install -e '.[bench]')")
        return False
    rows = [r for r in results if r["size"] == main_size]
    sizes = sorted({r["size_bytes"] for r in results})
    panels = 3 if len(sizes) > 1 else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 0.38 * len(rows) + 2.2))
    names = [r["name"] for r in rows]
    y = list(range(len(rows)))[::-1]
    colors = [COLORS[r["kind"]] for r in rows]
    for ax, key, unit, label in ((axes[0], "s", "s", "wall time"), (axes[1], "mb", "MB", "peak memory (process tree RSS)")):
        if key == "s":
            med = [r["median_s"] for r in rows]
            lo = [r["median_s"] - r["min_s"] for r in rows]
            hi = [r["max_s"] - r["median_s"] for r in rows]
        else:
            med = [r["peak_mb_median"] for r in rows]
            lo = [r["peak_mb_median"] - r["peak_mb_min"] for r in rows]
            hi = [r["peak_mb_max"] - r["peak_mb_median"] for r in rows]
        ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=2)
        ax.set_yticks(y)
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(names), fontsize=8)
        ax.set_xlabel(f"{label}, {unit} (median, bars: min-max)")
        for yy, v, h in zip(y, med, hi):  # the median, right of the range bar
            ax.text(v + h, yy, f" {v:.1f}" if key == "s" else f" {v:.0f}", va="center", fontsize=7)
        if key == "s":
            from matplotlib.patches import Patch

            handles = [Patch(color=c, label=k if k != "peer" else "peer (users' route today)")
                       for k, c in COLORS.items()]
            cp = next((r["median_s"] for r in rows if r["id"] == "cp"), None)
            if cp:
                handles.append(ax.axvline(TARGET_RATIO_TO_CP * cp, color="green", ls="--", lw=1,
                                          label=f"target: {TARGET_RATIO_TO_CP}x cp -r"))
            ax.legend(handles=handles, fontsize=7, loc="lower right")
        else:
            ax.axvline(TARGET_PEAK_MB, color="green", ls="--", lw=1, label=f"target: {TARGET_PEAK_MB} MB")
            ax.legend(fontsize=7, loc="lower right")
    if panels == 3:
        ax = axes[2]
        for rid in dict.fromkeys(r["id"] for r in results):
            series = sorted((r["size_bytes"], r["peak_mb_median"], r["kind"], r["name"])
                            for r in results if r["id"] == rid)
            if "nofsync" in rid or rid in ("inspect", "peer-inspect"):
                continue
            kind = series[0][2]
            ax.plot([s[0] / 1e9 for s in series], [s[1] for s in series], marker="o" if kind == "dcptool" else "s",
                    ls="-" if kind == "dcptool" else ":", label=series[0][3], lw=1.2)
        ax.axhline(TARGET_PEAK_MB, color="green", ls="--", lw=1, label=f"target: {TARGET_PEAK_MB} MB")
        ax.set_yscale("log")
        ax.set_xlabel("checkpoint size, GB")
        ax.set_ylabel("peak memory, MB (log scale)")
        ax.set_title("peak memory vs checkpoint size (solid: dcptool, dotted: peers)", fontsize=9)
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def chart_title(settings: dict, machine: dict) -> str:
    """The chart's title: checkpoint, mesh, machine and rounds."""
    mesh = settings["mesh"]
    return (f"dcptool bench: {settings['main_size']} {settings['model']} bf16 checkpoint (dp={mesh['dp']}, "
            f"tp={mesh['tp']}), {machine['cpu_count']} CPUs, {machine.get('memory_gb', '?')} GB; warm cache, "
            f"{settings['rounds']} round(s)")


def write_report(out: Path, report: dict, shapes: dict[str, Shape], moe_shapes: dict[str, Shape]) -> None:
    """results.json (``report``: machine, notes, settings and rows, with the targets added here), results.md
    and bench.png in ``out``; the main size's table and the targets printed. ``shapes`` and ``moe_shapes``:
    the checkpoints' shapes by size."""
    settings, results = report["settings"], report["rows"]
    main_size, mesh, rounds = settings["main_size"], settings["mesh"], settings["rounds"]
    main_rows = [r for r in results if r["size"] == main_size]
    report["targets"] = targets(results, main_size)
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    md = [f"{main_size} {shapes[main_size].describe()}, saved by a {mesh['dp'] * mesh['tp']}-process gloo job "
          f"(dp={mesh['dp']}, tp={mesh['tp']}); {rounds} round(s)."]
    reader_info = {r["id"]: r["source"] for r in main_rows if r["kind"] == "floor" and r["source"]}
    if reader_info:
        md += ["", "Readers of issue 13, each against cp -r of its own source (docs/benchmarks.md says how each "
                   "source is made): " + "; ".join(f"{rid[3:]} {human(info['size_bytes'])} ({info['model']})"
                                                  for rid, info in reader_info.items()) + "."]
    if main_size in moe_shapes:
        md += ["", f"export-hf-moe: {moe_shapes[main_size].describe()} (Archon names), saved by the same job; "
                   "its ratios are per tensor byte."]
    md += ["", table(main_rows)]
    for other in settings["sizes"][:-1]:
        md += ["", f"{other}:", "", table([r for r in results if r["size"] == other])]
    md += ["", "| target (issue 5) | value | met |", "|---|---|---|"]
    md += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else 'no'} |" for t in report["targets"]]
    (out / "results.md").write_text("\n".join(md) + "\n")
    print(f"\n{main_size}:\n" + table(main_rows))
    print("\ntargets of issue 5:")
    for t in report["targets"]:
        print(f"  {'met ' if t['met'] else 'MISS'}  {t['target']}: {t['value']}")
    drew = chart(results, main_size, out / "bench.png", chart_title(settings, report["machine"]))
    print(f"\nwrote {out / 'results.json'}, {out / 'results.md'}" + (f", {out / 'bench.png'}" if drew else ""))
