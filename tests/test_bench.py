"""Smoke test of scripts/bench.py: a tiny checkpoint saved by a real 4-process gloo job, one round,
two rows at a time (--jobs 2: quicker on a 2-core CI machine; the timings are not meant to mean anything).

Proves that the benchmark runs end to end and that results.json holds every row (each dcptool
command, each peer route, cp -r, export-hf of the MoE checkpoint in Archon names saved beside the
dense one and of the dense bytes in Megatron-Core's layout, and the readers of issue 13 on their own sources beside cp -r of each) with numeric fields.
No timing assertions: targets live in the benchmark, not in tests.
"""

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DCPTOOL_ROWS = {"export-hf", "export-hf-fp8", "export-hf-moe", "export-hf-megatron", "convert-torch", "reshard-dp4", "reshard-tp4",
                "export-hf-nofsync", "convert-torch-nofsync", "reshard-dp4-nofsync", "reshard-tp4-nofsync",
                "verify", "checksum", "inspect", "average3"}
PEER_ROWS = {"peer-export-hf", "peer-torch-save", "peer-reshard-dp4", "peer-reshard-tp4", "peer-verify",
             "sha256sum", "peer-inspect"}
# The readers of issue 13: dcptool row -> (cp -r of its source, peer or None where none exists).
READER_ROWS = {"export-hf-hf-dcp": ("cp-hf-dcp", "peer-consolidate"),
               "convert-torch-zstd": ("cp-zstd", "peer-torch-save-zstd"),
               "export-hf-accelerate": ("cp-accelerate", "peer-accelerate-merge"),
               "reshard-verl-w4": ("cp-verl", None),
               "dequantize-fp8": ("cp-fp8", "peer-dequantize"),
               "export-hf-lora-merge": ("cp-sync-lora", None)}
READER_EXTRA = {row for pair in READER_ROWS.values() for row in pair if row} | set(READER_ROWS)
NUMERIC = ("median_s", "min_s", "max_s", "peak_mb", "peak_mb_median", "peak_mb_min", "peak_mb_max",
           "ratio_to_cp", "ratio_to_peer", "size_bytes", "tensor_bytes", "tensors")


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--size", "2MB", "--rounds", "1",
         "--inspect-tensors", "40", "--jobs", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench.py exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"

    report = json.loads((out / "results.json").read_text())
    rows = {r["id"]: r for r in report["rows"]}
    assert set(rows) == DCPTOOL_ROWS | PEER_ROWS | {"cp", "cp-sync", "import-hf"} | READER_EXTRA
    assert len(report["rows"]) == len(rows)  # one size: one row each
    for row in rows.values():
        for key in NUMERIC if row["has_peer"] else set(NUMERIC) - {"ratio_to_peer"}:
            assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (row["id"], key, row[key])
        assert row["min_s"] <= row["median_s"] <= row["max_s"]
        assert row["peak_mb"] > 0 and len(row["times_s"]) == 1
        assert row["size"] == "2MB" and row["name"] and row["command"]
    for rid in DCPTOOL_ROWS - {"export-hf-fp8", "export-hf-moe", "average3", "export-hf-megatron"}:
        assert rows[rid]["kind"] == "dcptool" and rows[rid]["peer"] in PEER_ROWS, rid
    assert rows["average3"]["kind"] == "dcptool" and rows["average3"]["peer"] == "cp-sync"  # timed against a durable copy
    assert rows["cp"]["kind"] == "floor" and rows["cp"]["ratio_to_cp"] == 1.0
    # The durable floor (cp -r && sync) that issue 12's target compares the copy commands with.
    assert rows["cp-sync"]["kind"] == "floor" and rows["cp-sync"]["ratio_to_durable_cp"] == 1.0
    for rid in ("export-hf", "convert-torch", "reshard-dp4", "reshard-tp4", "import-hf"):
        assert math.isclose(rows[rid]["ratio_to_durable_cp"], rows[rid]["median_s"] / rows["cp-sync"]["median_s"])
        assert any(t["target"].startswith(f"{rid}: wall time <= 1.25x") for t in report["targets"]), rid
    assert rows["import-hf"]["kind"] == "dcptool" and not rows["import-hf"]["has_peer"]
    assert rows["checksum"]["peer"] == "sha256sum" and rows["export-hf"]["peer"] == "peer-export-hf"

    # Each reader row and its peer against cp -r of their own source folder (plain time ratios).
    for rid, (floor, peer) in READER_ROWS.items():
        row, cp = rows[rid], rows[floor]
        assert row["kind"] == "dcptool" and cp["kind"] == "floor" and row["floor"] == cp["floor"] == floor
        assert row["source"] == cp["source"] and row["source"]["size_bytes"] > 0
        assert math.isclose(row["ratio_to_cp"], row["median_s"] / cp["median_s"])
        assert row["peer"] == peer and row["has_peer"] == (peer is not None)
        if peer:
            assert rows[peer]["floor"] == floor and math.isclose(row["ratio_to_peer"],
                                                                  row["median_s"] / rows[peer]["median_s"])
    # The sources are what each reader is for: chunks of torch's HF-storage writer, the accelerate model part,
    # verl's optimizer carried to 4 ranks, float8 blocks dequantized with their scales left out.
    logs = out / "logs"
    assert "names: hf" in (logs / "export-hf-hf-dcp-2MB-r0.log").read_text()
    assert "trainer_state" in (logs / "export-hf-accelerate-2MB-r0.log").read_text()
    verl_log = (logs / "reshard-verl-w4-2MB-r0.log").read_text()  # weights, two moments and step per parameter
    written = int(re.search(r"\(fsdp1\): (\d+) tensors", verl_log).group(1))
    assert written >= 3 * rows["reshard-verl-w4"]["source"]["tensors"], verl_log
    fp8_log = (logs / "dequantize-fp8-2MB-r0.log").read_text()
    assert "float8 weights to bfloat16 (blocks of 128x128)" in fp8_log and "_scale_inv scales" in fp8_log, fp8_log
    lora_log = (logs / "export-hf-lora-merge-2MB-r0.log").read_text()  # every projection merged, alpha found beside it
    assert re.search(r"merged \d+ LoRA layers of default \(lora_alpha 32 from .*adapter_config.json\)", lora_log), lora_log

    # The quantized export against the plain one, of the same checkpoint.
    fp8 = rows["export-hf-fp8"]
    assert fp8["kind"] == "dcptool" and fp8["peer"] == "export-hf"
    assert any(t["target"].startswith("export-hf-fp8: wall time <= 1.5x") for t in report["targets"])
    assert re.search(r"quantized \d+ linear weights to float8_e4m3fn", (logs / "export-hf-fp8-2MB-r0.log").read_text())

    # The MoE row: its yardstick is the dense export, per tensor byte of the checkpoint each reads.
    moe, dense = rows["export-hf-moe"], rows["export-hf"]
    assert moe["kind"] == "dcptool" and moe["peer"] == "export-hf"
    assert moe["source"] == moe["moe_checkpoint"] and moe["source"]["model"].startswith("moe:")
    assert moe["input_tensor_bytes"] == moe["source"]["tensor_bytes"] != dense["input_tensor_bytes"]
    assert dense["input_tensor_bytes"] == dense["tensor_bytes"] and dense["source"] is None
    per_byte = (moe["median_s"] / moe["input_tensor_bytes"]) / (dense["median_s"] / dense["input_tensor_bytes"])
    assert math.isclose(moe["ratio_to_peer"], per_byte)
    assert report["settings"]["moe_shapes"]["2MB"]["model"] == "moe"
    goals = {t["target"].split(":")[0] + (" peak" if "peak" in t["target"] else "") for t in report["targets"]}
    assert {"export-hf-moe", "export-hf-moe peak"} <= goals
    # Archon names detected and mapped to HF's (a shared expert would have been refused), expert_bias dropped.
    log = (out / "logs" / "export-hf-moe-2MB-r0.log").read_text()
    assert "archon (qwen3_moe)" in log and "left out layers.1.moe.expert_bias" in log, log

    # The Megatron row: the dense checkpoint's bytes in Megatron's layout, against the dense export.
    megatron = rows["export-hf-megatron"]
    assert megatron["kind"] == "dcptool" and megatron["peer"] == "export-hf"
    assert megatron["input_tensor_bytes"] == dense["input_tensor_bytes"] and megatron["source"]["model"].startswith("megatron:")
    assert math.isclose(megatron["ratio_to_peer"], megatron["median_s"] / dense["median_s"])
    assert {"export-hf-megatron", "export-hf-megatron peak"} <= goals
    log = (out / "logs" / "export-hf-megatron-2MB-r0.log").read_text()
    assert "names: megatron (llama)" in log, log

    machine = report["machine"]
    assert machine["cpu_count"] >= 1 and machine["python"] and machine["torch"]
    assert report["settings"]["mesh"] == {"dp": 2, "tp": 2}
    assert any("--jobs 2" in note for note in report["notes"])  # flagged as not a measurement
    assert report["targets"] and all(isinstance(t["met"], bool) for t in report["targets"])
    assert "| dcptool export-hf |" in (out / "results.md").read_text()
    assert "| dcptool export-hf (Archon MoE -> HF per-expert) |" in (out / "results.md").read_text()

    if importlib.util.find_spec("matplotlib") is not None:
        png = out / "bench.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the chart needs the bench extra; everything else is written and the user is told
        assert "matplotlib is not installed" in proc.stdout


def test_moe_shape_is_qwen3_moe_in_archon_names():
    """The moe model: dense first layer, then router + grouped experts + expert_bias; no shared expert."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from benchmark.shapes import choose_shape

    shape = choose_shape("moe", 2 * 10**9)
    names = {name: (dims, dtype) for name, dims, dtype in shape.tensors()}
    assert not any("shared" in n for n in names) and "no shared expert" in shape.describe()
    assert {f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")} <= set(names)
    assert not any(n.startswith("layers.0.moe.") for n in names)
    E, M, H = shape.experts, shape.moe_intermediate, shape.hidden
    for i in range(shape.dense_layers, shape.layers):
        assert names[f"layers.{i}.moe.experts.w1"] == ((E, M, H), "bf16")
        assert names[f"layers.{i}.moe.experts.w2"] == ((E, H, M), "bf16")
        assert names[f"layers.{i}.moe.router.gate.weight"] == ((E, H), "bf16")
        assert names[f"layers.{i}.moe.expert_bias"] == ((E,), "f32")
        assert not any(n.startswith(f"layers.{i}.feed_forward") for n in names)
    dense = choose_shape("dense", 2 * 10**9)
    assert abs(shape.nbytes() / dense.nbytes() - 1) < 0.1  # the same size as the dense rows, near enough
