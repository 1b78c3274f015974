#!/usr/bin/env python
"""Benchmark dcptool against the routes users take today, on synthetic LLM checkpoints.

What it does, per checkpoint size:

1. Saves a synthetic bf16 checkpoint shaped like a real LLM with a REAL multi-process
   gloo job under torchrun (default 4 processes on the mesh dp=2 x tp=2): the test
   harness's models (tests/harness/), FSDP2 ``fully_shard`` per layer plus TP
   ``parallelize_module`` as its jobs apply them, then ``dcp.save`` of the
   model state dict (model weights only: no optimizer state, to keep the setup quick).
   ``--model dense`` (default) uses Hugging Face Llama names (embed_tokens, q/k/v/o_proj,
   gate/up/down_proj, RMSNorm weights, lm_head); ``--model moe`` is Qwen3-MoE-like in AReaL
   Archon / torchtitan names: a dense first layer (feed_forward.w1/w2/w3), then layers with a
   router, routed experts grouped as ``[experts, out, in]`` (TP'd along their hidden dim, FSDP
   on dim 0) and the f32 ``expert_bias`` buffer; no shared expert (Qwen3-MoE has none).
   Hidden size and layer count are chosen to hit ``--size``.
   With ``--model dense`` the same job also saves a ``moe`` checkpoint of the same target size
   for the ``export-hf-moe`` row, and a small checkpoint of about ``--inspect-tensors``
   tensors for the ``inspect`` row.
2. Runs every row below as a separate process, ``--rounds`` times, the order of the rows
   reversed on every other round, and reports the median and range of the wall time and
   of the peak memory of the whole process tree (RSS of the process and all of its
   descendants summed, sampled every 20 ms from /proc, and never below the largest
   single process's max RSS from wait4).  Every input is read once right before each
   run, so all runs are warm-cache runs (dropping the page cache needs root).

Rows (id: what runs; the peer is the route users take today for the same job):

  cp                   cp -r of the checkpoint folder: the floor
  cp-sync              cp -r && sync: the floor of a copy that is on disk when it returns, as dcptool's
                       are unless --no-fsync (issue 12's target: copy commands within 1.25x of it)
  export-hf            dcptool export-hf SRC DST                 peer: peer-export-hf
  export-hf-fp8        dcptool export-hf SRC DST --quantize fp8  peer: export-hf
                       (every linear weight as float8 codes and float32 scales per 128x128
                       block, computed as they stream out)
  export-hf-megatron   dcptool export-hf MEGATRON_SRC DST        peer: export-hf
                       (the dense checkpoint's bytes in Megatron-Core's layout, made untimed by
                       import-hf --adapter megatron from its HF export: stacked layers, fused
                       qkv and gate/up taken apart as views; --model dense only)
  export-hf-moe        dcptool export-hf MOE_SRC DST             peer: export-hf
                       (Archon names, grouped experts -> HF names, one tensor per expert,
                       as views of the source's chunks; the dense export of the same size
                       is its yardstick; --model dense only: with --model moe every row
                       already runs on a MoE checkpoint)
  convert-torch        dcptool convert SRC DST --to torch        peer: peer-torch-save
  reshard-dp4          dcptool reshard SRC DST --dp 4 --tp 1     peer: peer-reshard-dp4
  reshard-tp4          dcptool reshard SRC DST --dp 1 --tp 4     peer: peer-reshard-tp4
  *-nofsync            export-hf, convert-torch and the reshards with --no-fsync (the cost
                       of durability)
  import-hf            dcptool import-hf HF DST --dp 2 --tp 2    peer: none (HF export -> DCP on a mesh)
  average3             dcptool average SRC HF SRC DST            peer: cp-sync (the mean of three checkpoints,
                       the DCP, its HF export and the DCP again, in float32, written as the DCP is laid out)
  verify               dcptool verify SRC HF --prefix-a auto     peer: peer-verify
                       (the checkpoint against its own HF export, made before timing;
                       --model moe: an export that keeps the Archon names, --adapter hf)
  checksum             dcptool checksum SRC --write --manifest F peer: sha256sum
  inspect              dcptool inspect SMALL (~2,000 tensors)    peer: peer-inspect
  peer-torch-save      torch.distributed.checkpoint.format_utils.dcp_to_torch_save
  peer-export-hf       the in-memory half of dcp_to_torch_save (_load_state_dict with
                       _EmptyStateDictLoadPlanner, no_dist=True: what conversion scripts
                       write to load a DCP without a process group), then
                       safetensors.torch.save_file
  peer-reshard-dp4/tp4 a 4-process torchrun job that builds the model on the new mesh
                       (meta device, to_empty), dcp.load's the checkpoint into it and
                       dcp.save's it
  peer-verify          the same full load, safetensors.torch.load_file, torch.equal per key
  sha256sum            sha256sum of the checkpoint's files
  peer-inspect         FileSystemReader(SRC).read_metadata(), printing every key

Reader rows (issue 13; --model dense), each on its own source of about --size on disk, timed
against cp -r of that folder (cp-hf-dcp, cp-zstd, ...; ratios are plain time ratios):

  export-hf-hf-dcp     export-hf of HuggingFaceStorageWriter(save_distributed=True) shards, saved
                       by the gloo job              peer: peer-consolidate (consolidate_safetensors_files)
  convert-torch-zstd   convert --to torch of dcp.save with the ZStandard extension, saved by the
                       gloo job                     peer: peer-torch-save-zstd (dcp_to_torch_save)
  export-hf-accelerate export-hf of checkpoint-500/ (pytorch_model_fsdp_0 = dcp.save({"model": ...})
                       as accelerate's save_fsdp_model, config.json) peer: peer-accelerate-merge
                       (accelerate's merge_fsdp_weights, what `accelerate merge-weights` runs)
  reshard-verl-w4      reshard --dp 4 --to fsdp1 of verl files at W=2 with AdamW state (the gloo
                       job's model + optimizer DCP converted by dcptool --to fsdp1) peer: none
  dequantize-fp8       convert --to hf --dequantize of float8_e4m3fn projections with
                       weight_scale_inv per 128 x 128 block (written by ``_fp8``)
                                                    peer: peer-dequantize (w.float() * scale, bf16)
  export-hf-lora-merge export-hf --lora merge of a peft model's DCP (the dense shape in peft's names, LoRA
                       r=16 on every projection, lora_alpha from adapter_config.json beside it; written by
                       ``_lora``), timed against cp-sync-lora: cp -r && sync of its own output
                                                    peer: none (peft's merge_and_unload needs the whole model)

Output (``--out``, default bench-out/): results.json (every row at every size: times,
peak memory, ratios to cp -r and to the peer per tensor byte of the checkpoint each row reads
(plain time ratios but for export-hf-moe), machine info, targets), results.md
(the table) and bench.png (time and peak memory; peak memory against size with --sizes).
The chart needs matplotlib: ``pip install -e '.[bench]'``; without it everything else is
still written and a message says so.

Examples::

    .venv/bin/python scripts/bench.py                       # 2GB, dp=2 x tp=2, 3 rounds
    .venv/bin/python scripts/bench.py --sizes 0.5GB,1GB,2GB,4GB --only 'cp|export-hf$|convert|reshard-dp4$'
    .venv/bin/python scripts/bench.py --size 4MB --rounds 1 --out /tmp/b   # smoke test (CI)
    .venv/bin/python scripts/bench.py --ranks 256,1024,4096 --rounds 1       # scale rows (scale.md)

``--ranks N,...`` runs only the scale rows, on checkpoints written by ``harness.synth_dcp`` as N
ranks of FSDP2 save them (``--scale-layers`` layers of narrow tensors, so every rank holds a chunk of
every tensor: 1,024 ranks x 80 layers is ~740k chunks, a 115 MB ``.metadata``): ``inspect``,
``reshard --dp 8``, ``export-hf``, ``convert --to torch`` and ``verify`` beside torch's ``read_metadata`` and
``dcp_to_torch_save`` of the same files, time and peak memory against N in scale.png. A change to how
records are read or checked shows there what the 2 GB rows (a few hundred chunks) cannot: a cost per chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from benchmark import REPO, workers
from benchmark.measure import SAMPLE_S, remove
from benchmark.report import chart, chart_title, machine_info, summarize, write_report
from benchmark.rows import (GLOO_LAYOUTS, checkpoint_info, lora_output, make_rows, megatron_source, reader_folder,
                            reader_rows, reader_shapes, reader_sources, run_row, save_checkpoints)
from benchmark.scale import scale_bench
from benchmark.shapes import Shape, choose_shape, human, inspect_shape, parse_size

# The saving job and the reshard peer build their models with the test harness (tests/harness/).
sys.path.insert(1, str(REPO / "tests"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("2GB"),
                   help="checkpoint size (bf16 weights), e.g. 2GB (10**9 bytes) or 512MB; default 2GB")
    p.add_argument("--sizes", default=None,
                   help="comma-separated sizes, e.g. 0.5GB,1GB,2GB,4GB: run every row at each size "
                        "(peak memory against size in the chart); the largest is the main size")
    p.add_argument("--model", choices=("dense", "moe"), default="dense",
                   help="dense: HF Llama names; moe: torchtitan names with grouped experts (default dense)")
    p.add_argument("--dp", type=int, default=2, help="FSDP2 degree of the saving job (default 2)")
    p.add_argument("--tp", type=int, default=2, help="TP degree of the saving job (default 2)")
    p.add_argument("--max-hidden", type=int, default=2048, help="widest hidden size to use (default 2048)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every row; the order is reversed "
                                                          "every other round (default 3)")
    p.add_argument("--only", default=None, help="run only the rows whose id matches this regular expression "
                                                "(cp always runs); ids are listed above")
    p.add_argument("--inspect-tensors", type=int, default=2000,
                   help="tensors of the small checkpoint for the inspect rows (0: no inspect rows)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out", help="results folder (default bench-out/)")
    p.add_argument("--work", type=Path, default=None,
                   help="where checkpoints and outputs go (default OUT/work); checkpoints already there "
                        "with the same shape and mesh are reused")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints in the work folder afterwards")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (default 1800)")
    p.add_argument("--jobs", type=int, default=1,
                   help="rows run at the same time (default 1). Above 1 the timings and peaks disturb each "
                        "other: only for smoke tests")
    p.add_argument("--ranks", default=None,
                   help="comma-separated rank counts, e.g. 256,1024,4096: run only the scale rows on synthetic "
                        "checkpoints of that many ranks (harness.synth_dcp), beside torch's read_metadata and "
                        "dcp_to_torch_save; writes OUT/scale.json, scale.md, scale.png")
    p.add_argument("--scale-layers", type=int, default=80, help="layers of the --ranks checkpoints (default 80)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: redraw OUT/bench.png from OUT/results.json")
    args = p.parse_args(argv)
    if args.dp * args.tp != 4:
        p.error("the reshard peers run 4 processes: use a 4-rank source mesh (dp*tp == 4)")
    args.size_list = ([parse_size(s) for s in args.sizes.split(",")] if args.sizes else [args.size])
    args.ranks = [int(n) for n in args.ranks.split(",")] if args.ranks else None
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench as the command line says; results in ``--out``."""
    args = parse_args(argv)
    out: Path = args.out.resolve()
    if args.ranks:
        return scale_bench(args)
    if args.replot:
        report = json.loads((out / "results.json").read_text())
        settings, machine = report["settings"], report["machine"]
        drew = chart(report["rows"], settings["main_size"], out / "bench.png", chart_title(settings, machine))
        return 0 if drew else 1
    work: Path = (args.work or out / "work").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    machine = machine_info()
    notes = [
        "model weights only (bf16), no optimizer state (but in the verl reader row's source)",
        "warm page cache: every input is read once right before each run (dropping the cache needs root)",
        f"peak memory: RSS of the process tree summed, sampled every {int(SAMPLE_S * 1000)} ms "
        "(shared libraries count once per process: torchrun rows count torch 5 times)",
        f"order of rows reversed every other round; {args.rounds} round(s)",
    ]
    if args.jobs > 1:
        notes.append(f"--jobs {args.jobs}: rows ran {args.jobs} at a time, so times and peaks disturb each other "
                     "(a smoke test, not a measurement)")
    print(f"machine: {machine.get('cpu_model', '?')}, {machine['cpu_count']} CPUs, "
          f"{machine.get('memory_gb', '?')} GB, Python {machine['python']}, torch {machine.get('torch', '?')}, "
          f"load average {machine['load_average_at_start'][0]:.1f}")
    for note in notes:
        print(f"note: {note}")
    # Installed packages carry their bytecode; a checkout run with PYTHONDONTWRITEBYTECODE may not, and
    # compiling dcptool's modules on every start would be timed as start-up.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "dcptool"), str(REPO / "converters")],
                   capture_output=True, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    sizes = sorted(args.size_list)
    small_shape = inspect_shape(args.inspect_tensors) if args.inspect_tensors > 0 else None
    results: list[dict] = []
    shapes, moe_shapes = {}, {}
    for target in sizes:
        size_results, shapes[human(target)], moe_shape = bench_size(args, target, work, logs, small_shape)
        results += size_results
        if moe_shape is not None:
            moe_shapes[human(target)] = moe_shape
    if small_shape and not args.keep:
        for path in work.glob("ckpt-inspect-*"):
            remove(path)
    settings = {"model": args.model, "mesh": {"dp": args.dp, "tp": args.tp}, "rounds": args.rounds,
                "sizes": [human(s) for s in sizes], "main_size": human(sizes[-1]),
                "shapes": {k: asdict(v) for k, v in shapes.items()},
                "moe_shapes": {k: asdict(v) for k, v in moe_shapes.items()},
                "inspect_shape": asdict(small_shape) if small_shape else None,
                "command": " ".join([Path(sys.executable).name, "scripts/bench.py", *(argv or sys.argv[1:])])}
    write_report(out, {"machine": machine, "notes": notes, "settings": settings, "rows": results}, shapes, moe_shapes)
    return 0


def bench_size(args, target: int, work: Path, logs: Path,
               small_shape: Shape | None) -> tuple[list[dict], Shape, Shape | None]:
    """Every wanted row at one checkpoint size, ``--rounds`` times: the checkpoints and sources it reads are
    made first where missing (and removed after, without ``--keep``). Returns the rows' summaries, the shape
    of the checkpoint and that of the MoE checkpoint saved beside a dense one (None without one)."""
    want = re.compile(args.only) if args.only else None
    shape = choose_shape(args.model, target, args.max_hidden)
    tag = f"{args.model}-{human(target)}-dp{args.dp}tp{args.tp}"
    src = work / f"ckpt-{tag}"
    small = work / f"ckpt-inspect-{small_shape.layers}l-dp{args.dp}tp{args.tp}" if small_shape else None
    print(f"\n== {human(target)}: {shape.describe()}", flush=True)
    jobs = [(src, shape)]
    moe_src = moe_shape = None
    # export-hf-moe: beside a dense checkpoint, a MoE one of the same size in Archon names (--model moe
    # already benchmarks every row on a MoE checkpoint: no second one).
    if args.model == "dense" and (want is None or bool(want.search("export-hf-moe"))):
        moe_shape = choose_shape("moe", target, args.max_hidden)
        moe_src = work / f"ckpt-moe-{human(target)}-dp{args.dp}tp{args.tp}"
        jobs.append((moe_src, moe_shape))
        print(f"   and {moe_shape.describe()}", flush=True)
    jobs += [(small, small_shape)] if small_shape else []
    # The readers of issue 13: accelerate's folder and verl's optimizer checkpoint come from the same job.
    readers = reader_shapes(shape, target, args.max_hidden, want) if args.model == "dense" else {}
    layouts = {reader_folder(reader, tag, work): reader for reader in GLOO_LAYOUTS if reader in readers}
    if "verl" in readers:
        layouts[work / f"ckpt-optim-{tag}"] = "optim"
    jobs += [(path, readers["verl" if layout == "optim" else layout]) for path, layout in layouts.items()]
    save_checkpoints(jobs, args.dp, args.tp, logs, layouts)
    hf = verify_export(src, shape, tag, work)
    megatron = megatron_source(hf, shape, tag, work) \
        if args.model == "dense" and (want is None or bool(want.search("export-hf-megatron"))) else None
    outdir = work / "out"
    remove(outdir)
    outdir.mkdir()
    moe_info = checkpoint_info(moe_src, moe_shape) if moe_src else None
    rows = [r for r in make_rows(src, hf, small, shape, outdir, len(small_shape.tensors()) if small_shape else 0,
                                 (moe_src, moe_info) if moe_src else None, megatron)
            if r.id in ("cp", "cp-sync") or want is None or want.search(r.id)]
    sources = reader_sources(readers, tag, work, logs)
    rows += [r for r in reader_rows(sources, outdir) if r.kind == "floor" or want is None or want.search(r.id)]
    size_info = {"size": human(target), "target_bytes": target, **checkpoint_info(src, shape),
                 "inspect_tensors": len(small_shape.tensors()) if small_shape else None,
                 "moe_checkpoint": moe_info}
    print(f"  checkpoint {src}: {human(size_info['size_bytes'])} in {size_info['files']} files", flush=True)
    if moe_info:
        print(f"  checkpoint {moe_src}: {human(moe_info['size_bytes'])} in {moe_info['files']} files", flush=True)
    for rnd in range(args.rounds):
        order = rows if rnd % 2 == 0 else rows[::-1]
        if args.jobs > 1:
            with ThreadPoolExecutor(args.jobs) as pool:
                list(pool.map(lambda row: run_row(row, rnd, args, logs, human(target)), order))
        else:
            for row in order:
                run_row(row, rnd, args, logs, human(target))
    results = summarize(rows, size_info)
    if not args.keep:
        for path in (src, hf) + ((moe_src,) if moe_src else ()) + ((megatron[0],) if megatron else ()):
            remove(path)
            remove(Path(f"{path}.done"))
        for reader in readers:  # the reader sources, and the gloo job's folders they were made from
            folder = reader_folder(reader, tag, work)
            for path in (folder, Path(f"{folder}.done"), lora_output(folder), work / f"ckpt-optim-{tag}",
                         work / f"ckpt-optim-{tag}.done", work / f"accelerate-{tag}"):
                remove(path)
    remove(outdir)
    return results, shape, moe_shape


def verify_export(src: Path, shape: Shape, tag: str, work: Path) -> Path:
    """The HF export that verify compares the checkpoint with (made once, not timed). A MoE checkpoint's
    keeps its Archon names (--adapter hf: no renaming, expert_bias kept), so that verify and its peer
    compare the same names on both sides, as with the dense model's HF names."""
    keep_names = ["--adapter", "hf"] if shape.model == "moe" else []
    hf = work / (f"hf-{tag}" + ("-archon-names" if keep_names else ""))
    if not Path(f"{hf}.done").is_file():
        remove(hf)
        subprocess.run([sys.executable, "-m", "dcptool", "export-hf", str(src), str(hf), "--no-fsync",
                        *keep_names], check=True, capture_output=True)
        Path(f"{hf}.done").write_text("")
    return hf


# The processes the bench starts of itself: ``bench.py _save ...`` and so on (see benchmark.workers).
WORKERS = {"_save": workers.worker_save, "_reshard": workers.worker_reshard, "_fp8": workers.make_fp8,
           "_lora": workers.make_lora, "_peer": workers.peer}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in WORKERS:
        sys.exit(WORKERS[sys.argv[1]](sys.argv[2:]))
    sys.exit(main())
