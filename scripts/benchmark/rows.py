"""The rows of the bench: each command and the peer it is timed against, the sources of the reader rows,
the saving job that makes the checkpoints, and one timed run of a row."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmark import REPO, SCRIPT
from benchmark.measure import dir_bytes, measure, remove, tail, warm
from benchmark.shapes import Shape, choose_shape, llama_config, moe_config


@dataclass
class Row:
    """One line of the report: a command, what it reads and writes, and what each timed run of it measured."""

    id: str
    name: str
    kind: str           # floor | dcptool | peer
    peer: str           # id of the peer row (itself for peers and the floor)
    argv: list[str]
    output: Path | None
    inputs: list[Path]
    times: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    failures: int = 0
    peaks: list[int] = field(default_factory=list)
    source: dict | None = None  # the checkpoint it reads when not the size's main one (export-hf-moe, readers)
    floor: str = "cp"  # id of the cp -r row of the folder it reads


def make_rows(src: Path, hf: Path, small: Path | None, shape: Shape, outdir: Path, small_tensors: int = 0,
              moe: tuple[Path, dict] | None = None, megatron: tuple[Path, dict] | None = None) -> list[Row]:
    """Every row; ``moe``: (folder, size info) of the MoE checkpoint saved beside a dense one, for export-hf-moe;
    ``megatron``: that of the dense checkpoint's bytes in Megatron-Core's layout, for export-hf-megatron."""
    py = sys.executable
    dcptool = [py, "-m", "dcptool"]
    shape_json = json.dumps(asdict(shape))
    # The model's config: the TP rows split attention, which dcptool does only knowing the head counts.
    config = outdir / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "config.json").write_text(json.dumps(llama_config(shape) if shape.model == "dense" else moe_config(shape)))
    heads = ["--config-dir", str(config)]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(SCRIPT)]
    rows = [Row("cp", "cp -r", "floor", "cp", ["cp", "-r", str(src), str(outdir / "cp")], outdir / "cp", [src]),
            # What dcptool's commands promise by default: the copy is on disk when the command returns.
            Row("cp-sync", "cp -r && sync", "floor", "cp-sync",
                ["sh", "-c", 'cp -r "$0" "$1" && sync', str(src), str(outdir / "cp-sync")], outdir / "cp-sync", [src]),
            Row("import-hf", "dcptool import-hf --dp 2 --tp 2 (HF -> DCP)", "dcptool", "",
                dcptool + ["import-hf", str(hf), str(outdir / "imported"), "--dp", "2", "--tp", "2", *heads],
                outdir / "imported", [hf])]
    for fsync in ("", "-nofsync"):
        extra = ["--no-fsync"] if fsync else []
        label = " --no-fsync" if fsync else ""
        rows += [
            Row(f"export-hf{fsync}", f"dcptool export-hf{label}", "dcptool", "peer-export-hf",
                dcptool + ["export-hf", str(src), str(outdir / f"hf{fsync}")] + extra, outdir / f"hf{fsync}", [src]),
            Row(f"convert-torch{fsync}", f"dcptool convert --to torch{label}", "dcptool", "peer-torch-save",
                dcptool + ["convert", str(src), str(outdir / f"model{fsync}.pt"), "--to", "torch"] + extra,
                outdir / f"model{fsync}.pt", [src]),
            Row(f"reshard-dp4{fsync}", f"dcptool reshard --dp 4 --tp 1{label}", "dcptool", "peer-reshard-dp4",
                dcptool + ["reshard", str(src), str(outdir / f"dp4{fsync}"), "--dp", "4", "--tp", "1"] + extra,
                outdir / f"dp4{fsync}", [src]),
            Row(f"reshard-tp4{fsync}", f"dcptool reshard --dp 1 --tp 4{label}", "dcptool", "peer-reshard-tp4",
                dcptool + ["reshard", str(src), str(outdir / f"tp4{fsync}"), "--dp", "1", "--tp", "4", *heads] + extra,
                outdir / f"tp4{fsync}", [src]),
        ]
    # Quantized as it streams out: every linear weight read, its 128x128 blocks' scales and codes computed.
    rows.append(Row("export-hf-fp8", "dcptool export-hf --quantize fp8 (128x128 blocks)", "dcptool", "export-hf",
                    dcptool + ["export-hf", str(src), str(outdir / "hf-fp8"), "--quantize", "fp8", *heads],
                    outdir / "hf-fp8", [src]))
    if moe is not None:
        moe_src, moe_info = moe
        rows.append(Row("export-hf-moe", "dcptool export-hf (Archon MoE -> HF per-expert)", "dcptool", "export-hf",
                        dcptool + ["export-hf", str(moe_src), str(outdir / "hf-moe")], outdir / "hf-moe", [moe_src],
                        source=moe_info))
    # Souping: the checkpoint, its HF export and the checkpoint again averaged (three float32 sums per element),
    # written as the first is laid out; its yardstick is cp -r && sync of a folder of the output's size.
    rows.append(Row("average3", "dcptool average of 3 (DCP, its HF export, DCP) -> DCP", "dcptool", "cp-sync",
                    dcptool + ["average", str(src), str(hf), str(src), str(outdir / "average3")],
                    outdir / "average3", [src, hf]))
    if megatron is not None:
        megatron_src, megatron_info = megatron
        rows.append(Row("export-hf-megatron", "dcptool export-hf (Megatron-Core layout -> HF)", "dcptool", "export-hf",
                        dcptool + ["export-hf", str(megatron_src), str(outdir / "hf-megatron"), *heads],
                        outdir / "hf-megatron", [megatron_src], source=megatron_info))
    manifest = outdir / "manifest.json"
    rows += [
        Row("verify", "dcptool verify (DCP vs its HF export)", "dcptool", "peer-verify",
            dcptool + ["verify", str(src), str(hf), "--prefix-a", "auto"], None, [src, hf]),
        Row("checksum", "dcptool checksum --write", "dcptool", "sha256sum",
            dcptool + ["checksum", str(src), "--write", "--manifest", str(manifest)], manifest, [src]),
        Row("peer-torch-save", "torch format_utils.dcp_to_torch_save", "peer", "peer-torch-save",
            [py, str(SCRIPT), "_peer", "torch-save", str(src), str(outdir / "peer.pt")], outdir / "peer.pt", [src]),
        Row("peer-export-hf", "torch DCP full load + safetensors save_file", "peer", "peer-export-hf",
            [py, str(SCRIPT), "_peer", "export-hf", str(src), str(outdir / "peer-hf")], outdir / "peer-hf", [src]),
        Row("peer-reshard-dp4", "torchrun x4 dcp.load + dcp.save (dp=4)", "peer", "peer-reshard-dp4",
            torchrun + ["_reshard", str(src), str(outdir / "peer-dp4"), shape_json, "--dp", "4", "--tp", "1"],
            outdir / "peer-dp4", [src]),
        Row("peer-reshard-tp4", "torchrun x4 dcp.load + dcp.save (tp=4)", "peer", "peer-reshard-tp4",
            torchrun + ["_reshard", str(src), str(outdir / "peer-tp4"), shape_json, "--dp", "1", "--tp", "4"],
            outdir / "peer-tp4", [src]),
        Row("peer-verify", "torch full load + safetensors load_file + torch.equal", "peer", "peer-verify",
            [py, str(SCRIPT), "_peer", "verify", str(src), str(hf)], None, [src, hf]),
        Row("sha256sum", "sha256sum of the files", "peer", "sha256sum",
            ["sha256sum"] + [str(f) for f in sorted(src.iterdir()) if f.is_file()], None, [src]),
    ]
    if small is not None:
        rows += [
            Row("inspect", f"dcptool inspect ({small_tensors:,} tensors)", "dcptool", "peer-inspect",
                dcptool + ["inspect", str(small)], None, [small]),
            Row("peer-inspect", f"torch FileSystemReader.read_metadata ({small_tensors:,} tensors)", "peer",
                "peer-inspect",
                [py, str(SCRIPT), "_peer", "inspect", str(small)], None, [small]),
        ]
    # Each dcptool row next to its peer (in the table, the chart and the order of a round).
    order = ["cp", "cp-sync", "export-hf", "export-hf-fp8", "export-hf-moe", "export-hf-megatron", "export-hf-nofsync", "peer-export-hf", "convert-torch",
             "convert-torch-nofsync", "peer-torch-save", "reshard-dp4", "reshard-dp4-nofsync", "peer-reshard-dp4",
             "reshard-tp4", "reshard-tp4-nofsync", "peer-reshard-tp4", "import-hf", "average3", "verify", "peer-verify", "checksum",
             "sha256sum", "inspect", "peer-inspect"]
    return sorted(rows, key=lambda r: order.index(r.id))


# The readers of issue 13, each on its own source folder (made by reader_sources) beside the cp -r of that
# folder: (reader, floor id, dcptool row id, name, dcptool arguments, peer id, peer name, peer argv after
# ``bench.py _peer``). {src} is the source folder, {out} the output; an empty peer id: no peer exists.
READER_ROWS = [
    ("hf-dcp", "cp-hf-dcp", "export-hf-hf-dcp", "dcptool export-hf (torch HF-storage DCP)",
     ["export-hf", "{src}", "{out}"], "peer-consolidate", "torch consolidate_safetensors_files",
     ["consolidate", "{src}", "{out}"]),
    ("zstd", "cp-zstd", "convert-torch-zstd", "dcptool convert --to torch (zstd DCP)",
     ["convert", "{src}", "{out}.pt", "--to", "torch"], "peer-torch-save-zstd",
     "torch format_utils.dcp_to_torch_save (zstd DCP)", ["torch-save", "{src}", "{out}.pt"]),
    ("accelerate", "cp-accelerate", "export-hf-accelerate", "dcptool export-hf (accelerate checkpoint-N)",
     ["export-hf", "{src}", "{out}"], "peer-accelerate-merge", "accelerate merge_fsdp_weights (merge-weights)",
     ["accelerate-merge", "{src}", "{out}"]),
    ("verl", "cp-verl", "reshard-verl-w4", "dcptool reshard --to fsdp1 (verl + optimizer, W=2 -> 4)",
     ["reshard", "{src}", "{out}", "--dp", "4", "--to", "fsdp1"], "", "", []),
    ("fp8", "cp-fp8", "dequantize-fp8", "dcptool convert --dequantize (FP8 blocks -> bf16)",
     ["convert", "{src}", "{out}", "--to", "hf", "--dequantize"], "peer-dequantize",
     "torch loop: w.float() * scale per block -> bf16", ["dequantize", "{src}", "{out}"]),
    # timed against cp -r && sync of its own output (made untimed beside the source: ``floor_of``)
    ("lora", "cp-sync-lora", "export-hf-lora-merge", "dcptool export-hf --lora merge (peft LoRA r=16, every projection)",
     ["export-hf", "{src}", "{out}", "--lora", "merge"], "", "", []),
]


def reader_rows(sources: dict[str, tuple[Path, dict]], outdir: Path) -> list[Row]:
    """Rows of READER_ROWS whose source was made: cp -r of the folder, the dcptool command and its peer."""
    py = sys.executable
    rows = []
    for reader, floor, rid, name, argv, peer_id, peer_name, peer_argv in READER_ROWS:
        if reader not in sources:
            continue
        src, info = sources[reader]

        def fill(args: list[str], out: str) -> list[str]:
            return [a.format(src=src, out=outdir / out) for a in args]

        def output(args: list[str], out: str) -> Path:
            return outdir / (f"{out}.pt" if "{out}.pt" in args else out)

        if "floor_of" in info:  # the durable copy of the row's own output
            copied = Path(info["floor_of"])
            rows.append(Row(floor, f"cp -r && sync ({reader} output)", "floor", floor,
                            ["sh", "-c", 'cp -r "$0" "$1" && sync', str(copied), str(outdir / floor)],
                            outdir / floor, [copied], source=info, floor=floor))
        else:
            rows.append(Row(floor, f"cp -r ({reader} source)", "floor", floor,
                            ["cp", "-r", str(src), str(outdir / floor)], outdir / floor, [src], source=info,
                            floor=floor))
        rows.append(Row(rid, name, "dcptool", peer_id, [py, "-m", "dcptool"] + fill(argv, rid),
                        output(argv, rid), [src], source=info, floor=floor))
        if peer_id:
            rows.append(Row(peer_id, peer_name, "peer", peer_id, [py, str(SCRIPT), "_peer"] + fill(peer_argv, peer_id),
                            output(peer_argv, peer_id), [src], source=info, floor=floor))
    return rows


GLOO_LAYOUTS = ("hf-dcp", "zstd", "accelerate")  # reader sources that the saving job writes (worker_save)


def reader_folder(reader: str, tag: str, work: Path) -> Path:
    """Where the source of a reader row lives (accelerate's: a Trainer's ``checkpoint-N`` folder)."""
    return work / (f"accelerate-{tag}/checkpoint-500" if reader == "accelerate" else f"{reader}-{tag}")


def reader_shapes(shape: Shape, target: int, max_hidden: int, only: re.Pattern | None) -> dict[str, Shape]:
    """The shape of each reader source that a wanted row reads, sized like the main checkpoint on disk:
    verl's holds AdamW's two moments beside the weights (a third of the size in weights), FP8's
    projections take 1 byte an element (twice the elements)."""
    shapes = {"hf-dcp": shape, "zstd": shape, "accelerate": shape,
              "verl": choose_shape("dense", target // 3, max_hidden),
              "fp8": choose_shape("dense", 2 * target, max_hidden), "lora": shape}
    return {reader: shapes[reader] for reader, _, rid, *_, peer_id, _, _ in READER_ROWS
            if only is None or only.search(rid) or (peer_id and only.search(peer_id))}


def reader_sources(shapes: dict[str, Shape], tag: str, work: Path, logs: Path) -> dict:
    """The sources of the reader rows (``shapes``: reader_shapes), made once, untimed: ``{reader: (folder, info)}``.

    The gloo job (``save_checkpoints``) saved the hf-dcp, zstd and accelerate ones with torch's own writers
    (GLOO_LAYOUTS); verl's is the job's optimizer checkpoint (layout ``optim``) converted by dcptool
    ``--to fsdp1 --world-size 2`` (the files verl's FSDP1 save writes, less the small extra_state); fp8's
    is written directly (``_fp8``)."""
    made = {}
    for reader, shape in shapes.items():
        folder, spec = reader_folder(reader, tag, work), json.dumps(asdict(shape))
        done = Path(f"{folder}.done")  # holds the shape it was made for
        if reader not in GLOO_LAYOUTS and not (done.is_file() and done.read_text() == spec):
            remove(folder)
            if reader == "verl":
                argv = [sys.executable, "-m", "dcptool", "convert", str(work / f"ckpt-optim-{tag}"), str(folder),
                        "--to", "fsdp1", "--world-size", "2", "--no-fsync"]
            else:
                argv = [sys.executable, str(SCRIPT), f"_{reader}", str(folder), spec]
            t0 = time.perf_counter()
            log = logs / f"make-{reader}.log"
            with open(log, "wb") as out:
                if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO).returncode != 0:
                    sys.exit(f"making the {reader} source failed; see {log}:\n" + tail(log))
            done.write_text(spec)
            print(f"  made the {reader} source {folder.name} in {time.perf_counter() - t0:.1f}s", flush=True)
        size = dir_bytes(folder)
        # Ratios of rows on one source are plain time ratios: its bytes on disk stand for its tensor bytes.
        made[reader] = (folder, {"size_bytes": size, "tensor_bytes": size, "files": len(list(folder.rglob("*"))),
                                 "tensors": len(shape.tensors()), "model": f"{reader}: {shape.describe()}"})
        if reader == "lora":  # its floor copies the merged export, made here untimed
            merged = lora_output(folder)
            if not merged.is_dir():
                subprocess.run([sys.executable, "-m", "dcptool", "export-hf", str(folder), str(merged), "--lora",
                                "merge", "--no-fsync"], check=True, capture_output=True, cwd=REPO)
            made[reader][1]["floor_of"] = str(merged)
    return made


def lora_output(folder: Path) -> Path:
    """Where the LoRA source's merged export lies, whose durable copy is the LoRA row's floor."""
    return Path(f"{folder}-merged")


def megatron_source(hf: Path, shape: Shape, tag: str, work: Path) -> tuple[Path, dict]:
    """The dense checkpoint's bytes in Megatron-Core's layout (made once, not timed): its HF export imported
    with ``--adapter megatron`` (layers stacked, q/k/v grouped per query group, gate and up fused, the
    norms fused into linear_qkv / linear_fc1; the bench's vocabularies are multiples of 128: no padding rows)."""
    folder, config = work / f"megatron-{tag}", work / f"config-{tag}"
    if not Path(f"{folder}.done").is_file():
        remove(folder)
        config.mkdir(parents=True, exist_ok=True)
        (config / "config.json").write_text(json.dumps(llama_config(shape)))
        subprocess.run([sys.executable, "-m", "dcptool", "import-hf", str(hf), str(folder), "--adapter", "megatron",
                        "--config-dir", str(config), "--no-fsync"], check=True, capture_output=True, cwd=REPO)
        Path(f"{folder}.done").write_text("")
    size = dir_bytes(folder)
    return folder, {"size_bytes": size, "tensor_bytes": shape.nbytes(), "files": len(list(folder.iterdir())),
                    "tensors": len(shape.tensors()), "model": f"megatron: {shape.describe()}"}


def checkpoint_info(path: Path, shape: Shape) -> dict:
    """Size and shape of a saved checkpoint, as results.json records them."""
    return {"size_bytes": dir_bytes(path), "tensor_bytes": shape.nbytes(), "tensors": len(shape.tensors()),
            "files": len(list(path.iterdir())), "model": shape.describe()}


def save_checkpoints(jobs: list[tuple[Path, Shape]], dp: int, tp: int, logdir: Path,
                     layouts: dict[Path, str] | None = None) -> None:
    """One torchrun job saves every (folder, shape) that is not there yet (a .done marker beside it), as
    ``layouts[folder]`` says (``model`` by default; ``accelerate``, ``optim``: see worker_save)."""
    def spec(path: Path, shape: Shape) -> str:
        layout = (layouts or {}).get(path, "model")
        return json.dumps(asdict(shape) | ({"layout": layout} if layout != "model" else {}))

    todo = [(p, s) for p, s in jobs if not Path(f"{p}.done").is_file()
            or Path(f"{p}.done").read_text() != spec(p, s) + f" dp={dp} tp={tp}"]
    if not todo:
        return
    for path, _ in todo:
        remove(path)
        remove(Path(f"{path}.done"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(dp * tp),
            str(SCRIPT), "_save"]
    for path, shape in todo:
        argv += [str(path), spec(path, shape)]
    argv += ["--dp", str(dp), "--tp", str(tp)]
    log = logdir / f"save-{todo[0][0].name}.log"
    t0 = time.perf_counter()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    if rc != 0:
        sys.exit(f"saving the checkpoints failed (exit {rc}); see {log}:\n" + tail(log))
    for path, shape in todo:
        Path(f"{path}.done").write_text(spec(path, shape) + f" dp={dp} tp={tp}")
    print(f"  saved {', '.join(p.name for p, _ in todo)} with a {dp * tp}-process gloo job "
          f"(dp={dp}, tp={tp}) in {time.perf_counter() - t0:.1f}s", flush=True)


def run_row(row: Row, rnd: int, args, logs: Path, size: str) -> None:
    """One timed run of a row, warm cache; its output is removed before and after."""
    log = logs / f"{row.id}-{size}-r{rnd}.log"
    for attempt in (0, 1):
        if row.output is not None:
            remove(row.output)
        warm(row.inputs)
        if args.jobs == 1:
            os.sync()  # no writeback of the previous row's output during this one
        secs, cpu, peak, rc = measure(row.argv, log, args.timeout)
        if rc == 0 or row.kind == "dcptool" or attempt == 1:
            break
        row.failures += 1  # the users' routes get one more try (counted in the JSON)
        failed = log.with_name(log.stem + "-failed.log")
        log.rename(failed)
        print(f"  {row.name} failed (exit {rc}, see {failed}); running it once more", flush=True)
    if rc != 0:
        print(f"{row.name} failed (exit {rc}): {' '.join(row.argv)}\n{tail(log)}", file=sys.stderr, flush=True)
        os._exit(1)  # also from a --jobs worker thread
    row.times.append(secs)
    row.cpus.append(cpu)
    row.peaks.append(peak)
    print(f"  round {rnd + 1}/{args.rounds}  {row.name:58s} {secs:7.2f}s  (CPU {cpu:6.2f}s)  {peak / 1e6:7.0f} MB",
          flush=True)
    if row.output is not None:
        remove(row.output)
