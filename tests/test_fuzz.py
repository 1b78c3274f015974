"""Seeded fuzzing of every header dcptool reads, through the real command line.

Small checkpoints of each format are mutated a few hundred ways (``SEED`` makes the corpus the same on
every run): DCP ``.metadata`` pickles and the zip records of ``.distcp`` files, safetensors headers,
``model.safetensors.index.json``, ``fsdp_config.json``, the pickles of FSDP1 per-rank files
(ShardedTensor and DTensor values) and a plain ``torch.save`` file. Mutations are byte-level (a
byte changed, a 4- or 8-byte field set to an extreme, a cut, a slice repeated or dropped),
opcode-aware for pickles (a memo index or length set to an extreme, an opcode replaced) and
data-aware for JSON (valid JSON of the wrong kind, 100,000-deep nesting, hostile shapes, offsets,
names and world sizes). Each mutant goes through ``inspect`` and ``convert``, every fourth also
through ``verify`` against itself, each run in its own process under a 2 GB address-space limit
and a 300 s alarm. Every run must exit 0 (the mutant still reads) or 2 with exactly one line on
stderr; never 1 (a mutant differs from itself), 3 (a bug), a signal, a traceback or a hang. On
exit 2 nothing may be left at the output path, and no mutant may be modified.

The runs (these and those of the targeted cases below) are forked, two at a time, from one server
process that has dcptool imported once (``ForkServer`` of tests/jobs.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickletools
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import ForkServer

ROOT = Path(__file__).resolve().parents[1]
SEED = 20241122
MEMORY_LIMIT = 2 * 2**30  # bytes of address space for each run
TIMEOUT = 300  # seconds before a run counts as a hang (generous: CI machines are loaded)
VERIFY_EVERY = 4  # verify runs on every fourth mutant (inspect and convert on all)
AT_ONCE = 2  # runs forked at a time (a CI machine has two cores)


# ---------------------------------------------------------------------------------------------
# Mutations (deterministic: each takes the random generator of its case)

EXTREMES_4 = [b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80", b"\x00\xca\x9a\x3b", b"\x00\x00\x00\x00"]
EXTREMES_8 = [b"\xff" * 8, b"\xff" * 7 + b"\x7f", b"\x00" * 7 + b"\x80", b"\x00\x00\x00\x00\x01\x00\x00\x00"]
SPECIAL_BYTES = [0x00, 0xFF, 0x7F, 0x80, 0x0A, 0x28, 0x2E, 0x94, 0x68, 0x71, 0x72, 0x8B, 0x8E, 0x58]


def mutate_bytes(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None,
                 same_length: bool = False) -> tuple[bytes, str]:
    """One generic mutation of ``data[lo:hi]``: a byte changed, a 4- or 8-byte field set to an extreme,
    or (unless ``same_length``) the data cut, or a slice repeated or dropped."""
    hi = len(data) if hi is None else hi
    kinds = ["flip", "special", "u32", "u64"] + ([] if same_length else ["truncate", "repeat", "drop"])
    kind = rng.choice(kinds)
    pos = rng.randrange(lo, max(lo + 1, hi))
    buf = bytearray(data)
    if kind == "flip":
        buf[pos] ^= 1 << rng.randrange(8)
    elif kind == "special":
        buf[pos] = rng.choice(SPECIAL_BYTES)
    elif kind in ("u32", "u64"):
        value = rng.choice(EXTREMES_4 if kind == "u32" else EXTREMES_8)
        end = min(pos + len(value), hi)
        buf[pos:end] = value[: end - pos]
    elif kind == "truncate":
        del buf[pos:]
    elif kind == "repeat":
        size = rng.randrange(1, 64)
        buf[pos:pos] = data[pos:pos + size]
    else:
        del buf[pos:pos + rng.randrange(1, 64)]
    return bytes(buf), f"{kind}@{pos}"


_COUNTED = {-2: 1, -3: 4, -4: 4, -5: 8}  # pickletools' length-prefixed arguments: bytes of the length


def mutate_pickle(rng: random.Random, data: bytes, start: int = 0, size: int | None = None) -> tuple[bytes, str]:
    """One opcode-aware mutation of the pickle at ``data[start:start+size]``, keeping its length: an
    argument (memo index, length, integer) set to an extreme, or an opcode replaced by another."""
    size = len(data) - start if size is None else size
    ops = list(pickletools.genops(data[start:start + size]))
    op, _, pos = rng.choice(ops)
    buf = bytearray(data)
    at = start + pos
    width = op.arg.n if op.arg and op.arg.n > 0 else _COUNTED.get(op.arg.n if op.arg else 0, 0)
    if width and rng.random() < 0.7:
        extremes = {1: [b"\xff", b"\x80", b"\x00"], 2: [b"\xff\xff", b"\x00\x80"], 4: EXTREMES_4, 8: EXTREMES_8}[width]
        value = rng.choice(extremes)
        buf[at + 1:at + 1 + width] = value
        return bytes(buf), f"{op.name}-arg={value.hex()}@{pos}"
    code = rng.choice(pickletools.opcodes).code.encode("latin1")
    buf[at] = code[0]
    return bytes(buf), f"{op.name}->{code.hex()}@{pos}"


def pickle_regions(data: bytes) -> list[tuple[int, int]]:
    """``(start, size)`` of every ``data.pkl`` in the zip records of ``data`` (torch.save archives, DCP records)."""
    regions, pos = [], data.find(b"PK\x03\x04")
    while pos >= 0 and pos + 30 <= len(data):
        fields = struct.unpack_from("<4s2B4HL2L2H", data, pos)
        name_length, extra_length = fields[10], fields[11]
        name = data[pos + 30:pos + 30 + name_length]
        start = pos + 30 + name_length + extra_length
        if name.endswith(b"data.pkl"):  # its length: up to its STOP (local headers may not say)
            ends = [at + 1 for op, _, at in pickletools.genops(data[start:]) if op.name == "STOP"]
            regions.append((start, ends[0]))
        pos = data.find(b"PK\x03\x04", pos + 4)
    return regions


def zip_structure(data: bytes) -> list[int]:
    """Offsets of the zip headers and directories in ``data``."""
    found = []
    for signature in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"):
        pos = data.find(signature)
        while pos >= 0:
            found.append(pos)
            pos = data.find(signature, pos + 1)
    return found


def mutate_archive(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A mutation of a file of torch.save zip records: inside a data.pkl (opcode-aware or not), or
    in the zip headers and directory, or the file cut short."""
    choice = rng.random()
    regions = pickle_regions(data)
    if choice < 0.5 and regions:
        start, size = rng.choice(regions)
        if rng.random() < 0.7:
            mutated, what = mutate_pickle(rng, data, start, size)
        else:
            mutated, what = mutate_bytes(rng, data, start, start + size, same_length=True)
        return mutated, f"data.pkl@{start}:{what}"
    if choice < 0.9:
        pos = min(rng.choice(zip_structure(data)) + rng.randrange(0, 46), len(data) - 1)
        mutated, what = mutate_bytes(rng, data, pos, pos + 1, same_length=True)
        return mutated, f"zip:{what}"
    return mutate_bytes(rng, data)


DEEP_LIST = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 100_000 + "1" + "}" * 100_000
HOSTILE_JSON = [[], "x", 3, None, True, 1.5, {}, [1, 2], {"a": None}, 10**30, -1]


def json_text(value) -> str:
    return value if isinstance(value, str) and value in (DEEP_LIST, DEEP_OBJECT) else json.dumps(value)


def mutate_header(rng: random.Random, header: dict) -> tuple[str, str]:
    """A safetensors header, changed as data (still JSON): the JSON text and what was done."""
    names = [k for k in header if k != "__metadata__"]
    kind = rng.choice(["whole", "entry", "field", "field", "field", "key", "metadata", "overlap", "missing"])
    header = json.loads(json.dumps(header))
    if kind == "whole":
        value = rng.choice(HOSTILE_JSON + [DEEP_LIST, DEEP_OBJECT])
        return json_text(value), f"header={json_text(value)[:20]}"
    name = rng.choice(names)
    if kind == "entry":
        header[name] = rng.choice(HOSTILE_JSON + [[[[[]]]]])
    elif kind == "field":
        field = rng.choice(["dtype", "shape", "data_offsets"])
        values = {
            "dtype": ["F128", "", 3, None, ["F32"], "f32", "U64", "BOOL"],
            "shape": [[0, 2**70, 2**70], [1] * 1000, [-1], [2**63], [2**62, 4], "x", None, [1.5], [[2]], [],
                      [10**6, 10**6], [True], [2**64 - 1]],
            "data_offsets": [[0, 2**64], [5, 1], [-4, 0], [0], [0, 1, 2], None, "0", [0.0, 4.0], [2**63, 2**63],
                             [0, 10**6], [1, 5]],
        }[field]
        header[name][field] = rng.choice(values)
        kind = f"{field}={json.dumps(header[name][field])[:30]}"
    elif kind == "key":
        new_name = rng.choice(["\ud800", "a\udfffb", "a\x00b", "line\nbreak", "", "x" * 5000, "__metadata__"])
        header[new_name] = header.pop(name)
        kind = f"key={new_name[:10]!r}"
    elif kind == "metadata":
        header["__metadata__"] = rng.choice([[], "x", {"a": 1}, {"a": None}, None, {"a": {"b": "c"}}])
    elif kind == "overlap" and len(names) > 1:
        other = rng.choice([n for n in names if n != name])
        header[other]["data_offsets"] = list(header[name]["data_offsets"])
    else:
        del header[name][rng.choice(["dtype", "shape", "data_offsets"])]
    return json.dumps(header), kind


def rebuild_safetensors(original: bytes, header_text: str) -> bytes:
    (length,) = struct.unpack_from("<Q", original)
    encoded = header_text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(encoded)) + encoded + original[8 + length:]


def mutate_index(rng: random.Random, index: dict) -> tuple[str, str]:
    """A ``model.safetensors.index.json`` changed as data: the JSON text and what was done."""
    index = json.loads(json.dumps(index))
    kind = rng.choice(["whole", "weight_map", "value", "value", "value", "key", "metadata"])
    if kind == "whole":
        value = rng.choice(HOSTILE_JSON + [DEEP_LIST, DEEP_OBJECT])
        return json_text(value), f"index={json_text(value)[:20]}"
    if kind == "weight_map":
        value = rng.choice(HOSTILE_JSON + [DEEP_LIST])
        if value is DEEP_LIST:
            return json.dumps(index)[:-1] + ', "weight_map": ' + DEEP_LIST + "}", "weight_map=deep"
        index["weight_map"] = value
        return json.dumps(index), f"weight_map={json.dumps(value)[:20]}"
    name = rng.choice(sorted(index["weight_map"]))
    if kind == "value":
        value = rng.choice([3, None, [], ["model-00001-of-00002.safetensors"], {}, "a\x00b.safetensors",
                            "../outside.safetensors", "/etc/hostname", "", "\ud800.safetensors", "missing.safetensors",
                            "model-00002-of-00002.safetensors", True, 1.5, "."])
        index["weight_map"][name] = value
        return json.dumps(index), f"value={json.dumps(value)[:30]}"
    if kind == "key":
        index["weight_map"][rng.choice(["\ud800", "", "a\nb"])] = index["weight_map"].pop(name)
        return json.dumps(index), "key"
    index["metadata"] = rng.choice([[], "x", None, {"total_size": "x"}, {"total_size": -1}])
    return json.dumps(index), f"metadata={json.dumps(index['metadata'])}"


def mutate_config(rng: random.Random, config: dict) -> tuple[str, str]:
    """An ``fsdp_config.json`` changed as data: the JSON text and what was done."""
    if rng.random() < 0.2:
        value = rng.choice(HOSTILE_JSON + [DEEP_LIST, DEEP_OBJECT])
        return json_text(value), f"config={json_text(value)[:20]}"
    config = dict(config)
    config["world_size"] = rng.choice([10**9, 10**18, 2**64, 10**400, -1, 0, "2", 2.5, True, None, [], {}, 3, 1, 2])
    text = json.dumps(config) if config["world_size"] != 10**400 else json.dumps(config).replace(str(10**400), "1e400")
    return text, f"world_size={json.dumps(config['world_size'])[:20]}"


# ---------------------------------------------------------------------------------------------
# The base checkpoints and the corpus


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """One small checkpoint of each format, made by torch, safetensors and dcptool's own fsdp1 writer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from harness.conversions import convert_checkpoint

    root = tmp_path_factory.mktemp("fuzz-bases")
    state = {"model": {"w": torch.arange(24.0).reshape(4, 6), "b": torch.ones(6, dtype=torch.bfloat16),
                       "n": torch.tensor([1, 2, 3])},
             "step": 3, "note": {"lr": 0.5, "name": "run"}}
    dcp.save(state, checkpoint_id=root / "dcp", no_dist=True)
    (root / "hf").mkdir()
    save_file({"a": torch.arange(6.0), "b": torch.ones(2, 3, dtype=torch.float16), "c": torch.zeros(0)},
              root / "hf" / "model.safetensors", metadata={"format": "pt"})
    (root / "hf2").mkdir()
    save_file({"a": torch.ones(4)}, root / "hf2" / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"b": torch.zeros(2, 2)}, root / "hf2" / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (root / "hf2" / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map}))
    (root / "hf-dcp").mkdir()  # torch's HuggingFaceStorageWriter: rows 0-2 and 3-4 of w on two ranks
    for rank, (start, rows) in enumerate(((0, 3), (3, 2)), start=1):
        sharding = {"w": {"saved_offsets": [start, 0]}, "b": {"saved_offsets": [0]}}
        save_file({"w": torch.arange(start * 4.0, (start + rows) * 4.0).reshape(rows, 4), "b": torch.ones(2)},
                  root / "hf-dcp" / f"shard-{rank:05d}-model-00001-of-00001.safetensors",
                  metadata={"DCP_SHARDING_INFO": json.dumps(sharding), "DCP_VERSION": "1.0", "format": "pt"})
    (root / "torch").mkdir()
    torch.save({"model": {"w": torch.arange(10.0).reshape(5, 2), "pos": torch.arange(3)}, "step": 7,
                "groups": [{"lr": 0.1, "params": [0, 1]}]}, root / "torch" / "full.pt")
    convert_checkpoint(root / "torch" / "full.pt", root / "fsdp1", to="fsdp1", world_size=2)
    (root / "fsdp1-dtensor").mkdir()
    subprocess.run([sys.executable, "-c", DTENSOR_SAVE, str(root / "fsdp1-dtensor")], check=True, timeout=300,
                   env=dict(os.environ, PYTHONWARNINGS="ignore"))
    return root


# FSDP1 given a device mesh saves DTensor values: a one-rank gloo group in a child makes such a file.
DTENSOR_SAVE = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
state = {"embed.weight": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]),
         "norm.weight": distribute_tensor(torch.ones(3), mesh, [Replicate()]), "scale": torch.tensor(0.5),
         "note": {"step": 3}}
torch.save(state, sys.argv[1] + "/model_world_size_1_rank_0.pt")
open(sys.argv[1] + "/fsdp_config.json", "w").write(json.dumps({"FSDP_version": 1, "world_size": 1}))
dist.destroy_process_group()
"""


# (kind, mutants): where each kind's mutations go; the counts add up to the corpus.
CORPUS = {"dcp-metadata": 70, "dcp-distcp": 45, "safetensors": 70, "index": 40, "fsdp-config": 30,
          "fsdp1-pickle": 60, "fsdp1-dtensor-pickle": 40, "torch-save": 25, "hf-dcp": 30}
CONVERT_TO = {"dcp": "torch", "hf": "dcp", "fsdp1": "hf", "torch": "fsdp1", "hf-dcp": "torch"}
HOSTILE_OFFSETS = [[0], [0, 0, 0], [-1, 0], [2**63, 0], [1.5, 0], "0,0", None, [3, 0], [0, 4], [True, 0], {}]


def mutate_sharding(rng: random.Random, header: dict) -> tuple[str, str]:
    """A header of torch's HF-storage DCP with its DCP_SHARDING_INFO changed as data."""
    header = json.loads(json.dumps(header))
    info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
    kind = rng.choice(["whole", "entry", "offsets", "offsets", "missing"])
    name = rng.choice(sorted(info))
    if kind == "whole":
        value = json_text(rng.choice(HOSTILE_JSON + [DEEP_OBJECT])) if rng.random() < 0.8 else "{not json"
        header["__metadata__"]["DCP_SHARDING_INFO"] = value
        return json.dumps(header), f"sharding={value[:20]}"
    if kind == "entry":
        info[name] = rng.choice(HOSTILE_JSON)
    elif kind == "offsets":
        info[name]["saved_offsets"] = rng.choice(HOSTILE_OFFSETS)
    else:
        del info[name]
    header["__metadata__"]["DCP_SHARDING_INFO"] = json.dumps(info)
    return json.dumps(header), f"sharding {kind} of {name}"


def make_case(kind: str, rng: random.Random, bases: Path, folder: Path) -> tuple[Path, str, str]:
    """Copy the base checkpoint of ``kind`` to ``folder`` and mutate it: ``(path to open, format, what)``."""
    if kind.startswith("dcp"):
        shutil.copytree(bases / "dcp", folder)
        if kind == "dcp-metadata":
            target = folder / ".metadata"
            data = target.read_bytes()
            mutated, what = mutate_pickle(rng, data) if rng.random() < 0.6 else mutate_bytes(rng, data)
        else:
            target = folder / "__0_0.distcp"
            mutated, what = mutate_archive(rng, target.read_bytes())
        target.write_bytes(mutated)
        return folder, "dcp", f"{target.name}:{what}"
    if kind == "safetensors":
        shutil.copytree(bases / "hf", folder)
        target = folder / "model.safetensors"
        data = target.read_bytes()
        (length,) = struct.unpack_from("<Q", data)
        if rng.random() < 0.6:
            text, what = mutate_header(rng, json.loads(data[8:8 + length]))
            mutated = rebuild_safetensors(data, text)
        else:
            mutated, what = mutate_bytes(rng, data, 0, 8 + length)
        target.write_bytes(mutated)
        return target, "hf", what
    if kind == "hf-dcp":
        shutil.copytree(bases / "hf-dcp", folder)
        target = folder / f"shard-{rng.randrange(1, 3):05d}-model-00001-of-00001.safetensors"
        data = target.read_bytes()
        (length,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8:8 + length])
        text, what = mutate_sharding(rng, header) if rng.random() < 0.7 else mutate_header(rng, header)
        target.write_bytes(rebuild_safetensors(data, text))
        return folder, "hf-dcp", f"{target.name}:{what}"
    if kind == "index":
        shutil.copytree(bases / "hf2", folder)
        target = folder / "model.safetensors.index.json"
        if rng.random() < 0.7:
            text, what = mutate_index(rng, json.loads(target.read_text()))
            target.write_bytes(text.encode("utf-8", "surrogatepass"))
        else:
            mutated, what = mutate_bytes(rng, target.read_bytes())
            target.write_bytes(mutated)
        return folder, "hf", what
    if kind == "fsdp-config":
        shutil.copytree(bases / "fsdp1", folder)
        target = folder / "fsdp_config.json"
        if rng.random() < 0.75:
            text, what = mutate_config(rng, json.loads(target.read_text()))
            target.write_text(text)
        else:
            mutated, what = mutate_bytes(rng, target.read_bytes())
            target.write_bytes(mutated)
        return folder, "fsdp1", what
    if kind == "fsdp1-dtensor-pickle":
        shutil.copytree(bases / "fsdp1-dtensor", folder)
        target = folder / "model_world_size_1_rank_0.pt"
        mutated, what = mutate_archive(rng, target.read_bytes())
        target.write_bytes(mutated)
        return folder, "fsdp1", f"{target.name}:{what}"
    if kind == "fsdp1-pickle":
        shutil.copytree(bases / "fsdp1", folder)
        target = folder / f"model_world_size_2_rank_{rng.randrange(2)}.pt"
        mutated, what = mutate_archive(rng, target.read_bytes())
        target.write_bytes(mutated)
        return folder, "fsdp1", f"{target.name}:{what}"
    shutil.copytree(bases / "torch", folder)
    target = folder / "full.pt"
    mutated, what = mutate_archive(rng, target.read_bytes())
    target.write_bytes(mutated)
    return target, "torch", what


def digest(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    hasher = hashlib.sha256()
    for file in files:
        hasher.update(str(file.relative_to(path.parent)).encode() + b"\0" + file.read_bytes())
    return hasher.hexdigest()


@pytest.fixture(scope="module")
def forked_runs(bases, tmp_path_factory):
    scratch = tmp_path_factory.mktemp("warmup")
    warmup = [["--quiet", "inspect", str(bases / "dcp")], ["--quiet", "verify", str(bases / "dcp"), str(bases / "hf2")]]
    warmup += [["--quiet", "convert", str(bases / name), str(scratch / name), "--to", to, "--no-fsync"]
               for name, to in (("dcp", "hf"), ("hf", "dcp"), ("fsdp1", "torch"), ("fsdp1-dtensor", "hf"),
                                ("torch", "fsdp1"))]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MALLOC_ARENA_MAX="2",
               PYTHONWARNINGS="ignore")
    runs = ForkServer(tmp_path_factory.mktemp("fork-server"), warmup, memory_limit=MEMORY_LIMIT, timeout=TIMEOUT,
                      at_once=AT_ONCE, env=env, cwd=str(ROOT))
    yield runs
    runs.close()


def check_run(job: dict, result: subprocess.CompletedProcess) -> str | None:
    """What is wrong with one run, or None."""
    code, stderr = result.returncode, result.stderr
    lines = stderr.strip().splitlines()
    if code not in (0, 2):
        return f"exit {code}: {stderr.strip()[-600:] or result.stdout[-300:]}"
    if "Traceback" in stderr:
        return f"traceback on exit {code}: {stderr[-600:]}"
    if code == 2:
        if len(lines) != 1:
            return f"{len(lines)} lines on stderr: {stderr[-600:]}"
        if job["out"] and (Path(job["out"]).exists() or any(Path(job["out"]).parent.iterdir())):
            return f"exit 2 but something was written next to {job['out']}: {sorted(Path(job['out']).parent.iterdir())}"
    elif job["out"] and not Path(job["out"]).exists():  # a convert that succeeded
        return "exit 0 but no output"
    return None


def test_fuzzed_headers_exit_0_or_2_with_one_line(bases, forked_runs, tmp_path):
    rng = random.Random(SEED)
    jobs, cases = [], []
    number = 0
    for kind, count in CORPUS.items():
        for _ in range(count):
            case_rng = random.Random(rng.getrandbits(64))
            folder = tmp_path / f"case{number:04d}-{kind}"
            path, fmt, what = make_case(kind, case_rng, bases, folder)
            cases.append((path, digest(path), f"case {number} ({kind}, {what})"))
            out_parent = tmp_path / f"out{number:04d}"
            out_parent.mkdir()
            out = out_parent / ("out.pt" if CONVERT_TO[fmt] == "torch" else "out")
            to = CONVERT_TO[fmt]
            commands = [["inspect", str(path)] + (["--json"] if number % 2 else []),
                        ["convert", str(path), str(out), "--to", to, "--no-fsync"]
                        + (["--world-size", "2"] if to == "fsdp1" else [])]
            if number % VERIFY_EVERY == 0:
                commands.append(["verify", str(path), str(path)])
            for argv in commands:
                jobs.append({"argv": ["--quiet", *argv], "out": str(out) if argv[0] == "convert" else None,
                             "case": cases[-1][2]})
            number += 1
    assert number == sum(CORPUS.values())

    results = forked_runs.run([job["argv"] for job in jobs])
    assert len(results) == len(jobs)
    problems = []
    for job, result in zip(jobs, results):
        problem = check_run(job, result)
        if problem:
            problems.append(f"{job['case']}: dcptool {' '.join(job['argv'][1:2])}: {problem}")
    for path, before, name in cases:
        if digest(path) != before:
            problems.append(f"{name}: the source was modified")
    refused = sum(1 for r in results if r.returncode == 2)
    assert not problems, f"{len(problems)} of {len(jobs)} runs went wrong:\n" + "\n".join(problems[:25])
    assert refused > len(jobs) // 4, "the corpus should break many checkpoints"  # it does bite


# ---------------------------------------------------------------------------------------------
# Targeted cases: each input that broke before (a traceback and exit 1, tens of GB, a hang)


def refused(runs: ForkServer, path: Path, *names: str, tmp_path: Path, command: str = "convert") -> str:
    """Exit 2 with one line naming ``names``, no traceback, nothing written, the source unchanged (the real
    command line, forked by the fuzz runs' server, under their limits)."""
    before = digest(path)
    out = tmp_path / "refused-out"
    args = ["convert", path, out, "--to", "torch", "--no-fsync"] if command == "convert" else ["inspect", path]
    [result] = runs.run([[*map(str, args)]])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "dcptool-tmp" in p.name]
    assert digest(path) == before
    return lines[0]


def safetensors_file(path: Path, header_text: str, data: bytes = b"\0" * 16) -> Path:
    encoded = header_text.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    return path


@pytest.mark.parametrize("header, kind", [("[1, 2]", "an array"), ('"x"', "a string"), ("3", "a number"),
                                          ("null", "null")])
def test_safetensors_header_that_is_not_an_object(tmp_path, header, kind):
    from dcptool.errors import CheckpointError
    from dcptool.formats import open_checkpoint

    path = safetensors_file(tmp_path / "model.safetensors", header)
    with pytest.raises(CheckpointError, match=f"model.safetensors: safetensors header is {kind}, not an object"):
        open_checkpoint(path)


def test_safetensors_header_cases_through_the_command_line(forked_runs, tmp_path):
    line = refused(forked_runs, safetensors_file(tmp_path / "model.safetensors", "[1, 2]"), "model.safetensors",
                   "header", tmp_path=tmp_path)
    assert "an array, not an object" in line


def hf_dcp_header(sharding, dtype: str = "F32") -> str:
    """A header of torch's HuggingFaceStorageWriter: one 2x2 tensor ``w`` and its DCP sharding info."""
    info = sharding if isinstance(sharding, str) else json.dumps(sharding)
    return json.dumps({"w": {"dtype": dtype, "shape": [2, 2], "data_offsets": [0, 16 if dtype == "F32" else 8]},
                       "__metadata__": {"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0", "format": "pt"}})


@pytest.mark.parametrize("headers, said", [
    ([hf_dcp_header("{not json")], "DCP_SHARDING_INFO"),
    ([hf_dcp_header([1])], "DCP_SHARDING_INFO is an array, not an object"),
    ([hf_dcp_header({})], "DCP_SHARDING_INFO['w'] is missing"),
    ([hf_dcp_header({"w": {"saved_offsets": [0]}})], "saved_offsets has 1 dims, the tensor 2"),
    ([hf_dcp_header({"w": {"saved_offsets": [-1, 0]}})], "saved_offsets"),
    ([hf_dcp_header({"w": {"saved_offsets": "0,0"}})], "saved_offsets is a string"),
    ([hf_dcp_header({"w": {"saved_offsets": [2, 0]}})], "a chunk is missing"),
    ([hf_dcp_header({"w": {"saved_offsets": [0, 0]}})] * 2, "overlap"),
    ([hf_dcp_header({"w": {"saved_offsets": [0, 0]}}), hf_dcp_header({"w": {"saved_offsets": [2, 0]}}, "F16")],
     "is float16 here but float32"),
])
def test_hf_dcp_bad_sharding_info_is_refused(forked_runs, tmp_path, headers, said):
    folder = tmp_path / "hf-dcp"
    folder.mkdir()
    for rank, header in enumerate(headers, start=1):
        safetensors_file(folder / f"shard-{rank:05d}-model-00001-of-00001.safetensors", header)
    line = refused(forked_runs, folder, said, tmp_path=tmp_path)
    assert ".safetensors" in line or "hf-dcp" in line


@pytest.mark.parametrize("where", ["header", "index", "fsdp_config"])
def test_json_nested_100000_deep(forked_runs, bases, tmp_path, where):
    deep = DEEP_LIST
    if where == "header":
        path = safetensors_file(tmp_path / "model.safetensors", '{"a": ' + deep + "}")
        name = "model.safetensors"
    elif where == "index":
        path = tmp_path / "hf"
        shutil.copytree(bases / "hf2", path)
        (path / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
        name = "model.safetensors.index.json"
    else:
        path = tmp_path / "fsdp1"
        shutil.copytree(bases / "fsdp1", path)
        (path / "fsdp_config.json").write_text('{"world_size": ' + deep + "}")
        name = "fsdp_config.json"
    assert "nested too deeply" in refused(forked_runs, path, name, tmp_path=tmp_path)


def test_tensor_name_with_a_lone_surrogate_is_named_printably(forked_runs, tmp_path):
    path = safetensors_file(tmp_path / "model.safetensors",
                            json.dumps({"a\ud800b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}))
    line = refused(forked_runs, path, "model.safetensors", "a\\ud800b", tmp_path=tmp_path, command="inspect")
    assert "not valid UTF-8" in line


@pytest.mark.parametrize("weight_map, says", [
    ({"a": 3, "b": "model-00002-of-00002.safetensors"}, "weight_map['a'] is a number, not a file name"),
    ({"a": None, "b": "model-00002-of-00002.safetensors"}, "weight_map['a'] is null, not a file name"),
    ({"a": ["model-00001-of-00002.safetensors"]}, "weight_map['a'] is an array, not a file name"),
    ({"a": {}}, "weight_map['a'] is an object, not a file name"),
    (["model-00001-of-00002.safetensors"], "weight_map is an array, not an object"),
    ("model-00001-of-00002.safetensors", "weight_map is a string, not an object"),
    (None, "weight_map is missing"),
    ({"a": "model-00001-of-00002.safetensors\x00.txt"}, "holds a NUL byte"),
    ({"a": "\ud800.safetensors"}, "not valid UTF-8"),
    ({"a": ""}, "is an empty file name"),
])
def test_index_weight_map_checked_as_data(bases, tmp_path, weight_map, says):
    from dcptool.errors import CheckpointError
    from dcptool.formats import open_checkpoint

    path = tmp_path / "hf"
    shutil.copytree(bases / "hf2", path)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: ") as raised:
        open_checkpoint(path)
    assert says in str(raised.value)


def test_index_file_name_with_a_nul_byte_through_the_command_line(forked_runs, bases, tmp_path):
    path = tmp_path / "hf"
    shutil.copytree(bases / "hf2", path)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "x\x00y.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    line = refused(forked_runs, path, "model.safetensors.index.json", "x\\x00y.safetensors", tmp_path=tmp_path)
    assert "NUL" in line


def test_world_size_of_a_billion_is_checked_against_the_files(forked_runs, bases, tmp_path):
    path = tmp_path / "fsdp1"
    shutil.copytree(bases / "fsdp1", path)
    (path / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": 10**9}))
    line = refused(forked_runs, path, "model_world_size_1000000000_rank_0.pt: missing", tmp_path=tmp_path)
    assert "fsdp_config.json says world size 1000000000" in line and "1,000,000,000 missing" in line
    # The same world size from the file names alone (no config): named as the first missing rank.
    (path / "fsdp_config.json").unlink()
    for rank in range(2):
        (path / f"model_world_size_2_rank_{rank}.pt").rename(path / f"model_world_size_1000000000_rank_{rank}.pt")
    line = refused(forked_runs, path, "model_world_size_1000000000_rank_2.pt", tmp_path=tmp_path)
    assert "999,999,998 missing" in line


def crafted_rank_file(folder: Path, pickled: bytes) -> Path:
    """A one-rank FSDP1 folder whose model file holds ``pickled`` as its data.pkl."""
    from dcptool.torch_archive import ArchiveLayout

    folder.mkdir()
    layout = ArchiveLayout(pickled, "model_world_size_1_rank_0")
    archive = bytearray(layout.close())
    for offset, data in layout.segments({}):
        archive[offset:offset + len(data)] = data
    (folder / "model_world_size_1_rank_0.pt").write_bytes(bytes(archive))
    return folder


@pytest.mark.parametrize("pickled, says", [
    (b"\x80\x02}r\x00\x00\x00\xf0.", "memo index 4,026,531,840 is beyond"),  # LONG_BINPUT in the billions
    (b"\x80\x04\x8e" + struct.pack("<Q", 40 * 2**30) + b"x.", "needs 42,949,672,960 bytes"),  # BINBYTES8
    (b"\x80\x05\x96" + struct.pack("<Q", 40 * 2**30) + b"x.", "needs 42,949,672,960 bytes"),  # BYTEARRAY8
    (b"\x80\x02X\xff\xff\xff\xffx.", "needs 4,294,967,295 bytes"),  # BINUNICODE
    (b"\x80\x02\x8b\xff\xff\xff\x7fx.", "an integer of 2,147,483,647 bytes"),  # LONG4
])
def test_flipped_lengths_in_an_fsdp1_pickle_allocate_nothing(forked_runs, tmp_path, pickled, says):
    path = crafted_rank_file(tmp_path / "fsdp1", pickled)
    line = refused(forked_runs, path, "model_world_size_1_rank_0.pt", "data.pkl", tmp_path=tmp_path)
    assert says in line


def test_a_flipped_byte_in_a_real_fsdp1_pickle(forked_runs, bases, tmp_path):
    """A BINPUT turned into LONG_BINPUT: the next four bytes become a memo index in the billions."""
    path = tmp_path / "fsdp1"
    shutil.copytree(bases / "fsdp1", path)
    target = path / "model_world_size_2_rank_0.pt"
    data = bytearray(target.read_bytes())
    start, size = pickle_regions(bytes(data))[0]
    ops = [(op, pos) for op, _, pos in pickletools.genops(bytes(data[start:start + size]))]
    for (op, pos), (_, after) in zip(ops, ops[1:]):
        if op.name == "BINPUT" and struct.unpack_from("<I", data, start + pos + 1)[0] > 2**30:
            data[start + pos] = ord("r")  # LONG_BINPUT
            break
    else:
        pytest.fail("no BINPUT followed by bytes that read as a large index")
    target.write_bytes(bytes(data))
    assert "memo index" in refused(forked_runs, path, "model_world_size_2_rank_0.pt", tmp_path=tmp_path)


@pytest.mark.parametrize("shape, data_offsets, says", [
    ([0, 2**70, 2**70], [0, 0], "shape has dimension 2**70"),
    ([1] * 1000, [0, 4], "shape has 1000 dimensions (at most 64)"),
    ([2**62, 4], [0, 0], "holds 2**64 elements of 4 bytes"),
    ([-1], [0, 0], "shape has dimension -1"),
    ([1], [0, 2**64], "data_offsets is not two integers"),
    ([1], [8, 4], "data_offsets is not two integers"),
    ([1], [1000, 1004], "needs bytes up to"),
])
def test_safetensors_shapes_and_offsets_are_checked(tmp_path, shape, data_offsets, says):
    from dcptool.errors import CheckpointError
    from dcptool.formats import open_checkpoint

    header = {"a": {"dtype": "F32", "shape": shape, "data_offsets": data_offsets}}
    path = safetensors_file(tmp_path / "model.safetensors", json.dumps(header))
    with pytest.raises(CheckpointError, match="model.safetensors: ") as raised:
        open_checkpoint(path)
    assert says in str(raised.value)


def test_huge_shape_is_not_converted(forked_runs, tmp_path):
    """[0, 2**70, 2**70] holds no bytes, but no file torch loads can hold that shape."""
    header = {"a": {"dtype": "F32", "shape": [0, 2**70, 2**70], "data_offsets": [0, 0]}}
    path = safetensors_file(tmp_path / "model.safetensors", json.dumps(header))
    assert "2**70" in refused(forked_runs, path, "model.safetensors", "shape", tmp_path=tmp_path)


def test_overlapping_safetensors_data_is_refused(forked_runs, tmp_path):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    path = safetensors_file(tmp_path / "model.safetensors", json.dumps(header))
    assert "the data of a and b overlap" in refused(forked_runs, path, "model.safetensors", tmp_path=tmp_path)


def test_dcp_metadata_sizes_are_checked(forked_runs, bases, tmp_path):
    import pickle

    path = tmp_path / "dcp"
    shutil.copytree(bases / "dcp", path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # our own file: trusted here
    entry = metadata.state_dict_metadata["model.w"]
    entry.size = type(entry.size)([0, 2**70, 2**70])
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    assert "size has dimension 2**70" in refused(forked_runs, path, ".metadata", "model.w", tmp_path=tmp_path)


def test_torch_save_tensor_sizes_are_checked(forked_runs, tmp_path):
    from dcptool.torch_archive import StorageOut, TensorOut, dumps

    pickled = dumps({"w": TensorOut(StorageOut("0", "float32", 0), (0, 2**70, 2**70))})
    path = crafted_rank_file(tmp_path / "fsdp1", pickled)
    assert "tensor size has dimension 2**70" in refused(forked_runs, path, "data.pkl", tmp_path=tmp_path)


# ---------------------------------------------------------------------------------------------
# The restricted unpickler: what an N-byte pickle can make it do is O(N)


def _memo_chain(start: bytes, level: bytes, levels: int) -> bytes:
    """``start`` as memo 0, then ``levels`` objects, each ``level`` made with ``%s`` twice: the one before,
    from the memo. The last is left on the stack: a few bytes a level, 2**levels objects when expanded."""
    out = bytearray(start + b"\x940")
    for i in range(levels):
        get = b"j" + struct.pack("<I", i)
        out += level.replace(b"%s", get) + b"\x940"
    return bytes(out + b"j" + struct.pack("<I", levels))


def _hostile_pickles() -> dict[str, tuple[bytes, str]]:
    """Name -> (pickle, what the refusal says); each of these costs far more than its size without limits."""
    flood = bytearray(b"\x80\x04}(")
    for i in range(2000):  # 2,000 distinct integers with one hash (they differ by multiples of 2**61 - 1)
        value = 5 + i * (2**61 - 1)
        flood += b"\x8a" + bytes([10]) + value.to_bytes(10, "little", signed=True) + b"N"
    flood += b"u."
    items = b"".join(b"J" + struct.pack("<i", i) for i in range(5000))
    copies = (b"\x80\x04](" + items + b"e\x94" + b"\x85\x94"  # the list, and the args tuple (list,) as memo 1
              + b"\x8c\x08builtins\x8c\x03set\x93\x94" + b"]" + b"h\x02h\x01R\x94a" * 20000 + b".")
    big_dict = b"}(" + b"".join(b"\x8c\x04k%03d" % i + b"N" for i in range(1000)) + b"u\x94"
    record = b"\x8c%torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93\x94"  # memo 1 after the dict (0)
    builds = b"\x80\x04" + big_dict + record + b"]" + b"h\x01)\x81h\x00ba" * 20000 + b"."
    return {
        "cycle": (b"\x80\x04]\x94h\x00a.", "reference cycle"),
        "deep list": (b"\x80\x04" + b"]" * 100_000 + b"a" * 99_999 + b".", "levels deep"),
        "shared lists": (b"\x80\x04" + _memo_chain(b"]", b"](%s%se", 40) + b".", "shared containers are counted"),
        "shared dicts": (b"\x80\x04" + _memo_chain(b"}", b"}(\x8c\x01a%s\x8c\x01b%su", 40) + b".",
                         "shared containers are counted"),
        "tuple key hash bomb": (b"\x80\x04}" + _memo_chain(b")", b"%s%s\x86", 50) + b"Ns.", "more work"),
        "deep tuple key": (b"\x80\x04})" + b"\x85" * 1_000_000 + b"Ns.", "nests more than 64 levels"),
        "hash flooding": (bytes(flood), "share a hash"),
        "set of a shared list, over and over": (copies, "more work"),
        "one dict given as state over and over": (builds, "more work"),
        "memo index in the billions": (b"\x80\x02}r\x00\x00\x00\xf0.", "memo index"),
        "bytes of 2**40": (b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b".", "truncated"),
        "frame of 2**60": (b"\x80\x04\x95" + struct.pack("<Q", 2**60) + b"N.", "truncated"),
        "integer of 2 GB": (b"\x80\x02\x8b\xff\xff\xff\x7f.", "an integer of"),
        "text integer of 5000 digits": (b"I" + b"9" * 5000 + b"\n.", "an integer of"),
        "extension registry": (b"\x80\x02\x82\x01.", "EXT1"),
        "out-of-band buffer": (b"\x80\x05\x97.", "NEXT_BUFFER"),
        "unknown opcode": (b"\x80\x02\xff.", "unknown opcode"),
        "os.system": (b"\x80\x02cos\nsystem\n.", "refuses to unpickle os.system"),
        "getattr of a builtin": (b"\x80\x02c__builtin__\ngetattr\ncbuiltins\nset\nX\x03\x00\x00\x00mroq\x00\x86R.",
                                 "refuses getattr"),
    }


_PROBE = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (%d, %d))
from dcptool.errors import CheckpointError
from dcptool.safe_pickle import load_bytes
report = {}
for name, data in json.loads(sys.stdin.read()).items():
    try:
        load_bytes(bytes.fromhex(data), "x.pkl")
        report[name] = "loaded"
    except CheckpointError as exc:
        report[name] = str(exc)
print(json.dumps(report))
""" % (MEMORY_LIMIT, MEMORY_LIMIT)


def test_hostile_pickles_are_refused_within_limits():
    """Run in a child with the fuzz run's limits: a regression shows as a failure, not as a dead test run."""
    cases = _hostile_pickles()
    result = subprocess.run([sys.executable, "-c", _PROBE], input=json.dumps({k: v.hex() for k, (v, _) in cases.items()}),
                            capture_output=True, text=True, timeout=TIMEOUT * 2, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    for name, (_, says) in cases.items():
        assert report[name].startswith("x.pkl: ") and says in report[name], (name, report[name])
        assert "\n" not in report[name]


def test_ordinary_pickles_load_as_pickle_loads_them():
    """Every protocol, and what checkpoints keep beside tensors: the machine agrees with pickle.loads."""
    import collections
    import pickle

    from dcptool.safe_pickle import load_bytes

    value = {"step": 3, "lr": 0.5, "neg": -7, "big": 2**100, "text": "héllo ✓", "raw": b"\x00\xff",
             "none": None, "flags": [True, False], "pair": (1, "a"), "nested": {"a": [1, {"b": (2.5, None)}]},
             "set": {1, 2}, "frozen": frozenset({"x"}), "ordered": collections.OrderedDict(a=1, b=2),
             "complex": 1 + 2j, "slice": slice(1, 5, 2), "surrogate": "a\ud800", "empty": ((), [], {}),
             "shared": [[1, 2]] * 3, "memo": list(range(300)), 7: "int key", ("t", 1): "tuple key"}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(value, protocol=protocol)
        assert load_bytes(data, "x.pkl") == pickle.loads(data), protocol
    assert load_bytes(pickle.dumps(bytearray(b"ab"), protocol=5), "x.pkl") == bytearray(b"ab")


def test_zip64_locator_that_says_nonsense(forked_runs, bases, tmp_path):
    """A zip64 locator claiming several disks: zipfile raises BadZipFile from is_zipfile; one line here."""
    path = tmp_path / "full.pt"
    data = (bases / "torch" / "full.pt").read_bytes()
    end = data.rfind(b"PK\x05\x06")
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 3, 0, 7)  # on disk 3 of 7
    path.write_bytes(data[:end] + locator + data[end:end + 10] + b"\xff\xff" + data[end + 12:])
    assert "full.pt" in refused(forked_runs, path, "full.pt", tmp_path=tmp_path)


def test_verify_of_a_checkpoint_with_a_nan_entry_against_itself(forked_runs, tmp_path):
    import torch

    torch.save({"w": torch.ones(2), "lr": float("nan")}, tmp_path / "nan.pt")
    [result] = forked_runs.run([["verify", str(tmp_path / "nan.pt"), str(tmp_path / "nan.pt")]])
    assert result.returncode == 0, result.stdout + result.stderr
