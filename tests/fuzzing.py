"""What the fuzz tests share (tests/test_fuzz.py, tests/test_hostile_inputs.py): seeded mutations of every
header dcptool reads, the small base checkpoints they start from, the server the runs fork from, and the
check of one run's exit. The fixtures that make them once per session are in tests/conftest.py."""

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


def mutate_json_file(rng: random.Random, target: Path, mutate_fields, chance: float) -> str:
    """Mutate a JSON file in place: with probability ``chance`` its fields (``mutate_fields(rng, parsed)`` gives
    the new text), else its bytes; returns what was done."""
    if rng.random() < chance:
        text, what = mutate_fields(rng, json.loads(target.read_text()))
        target.write_bytes(text.encode("utf-8", "surrogatepass"))
    else:
        mutated, what = mutate_bytes(rng, target.read_bytes())
        target.write_bytes(mutated)
    return what


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


def make_bases(root: Path) -> Path:
    """One small checkpoint of each format, made by torch, safetensors and dcptool's own fsdp1 writer."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from harness.conversions import convert_checkpoint

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
    subprocess.run([sys.executable, "-c", MEGATRON_SAVE, str(root)], check=True, timeout=300,
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


# Megatron-Core's layouts as its saves lay them out, made without Megatron (so the fuzz tests need none): a
# torch_dist folder (metadata.json; the common state as the object common_state/shard_0_1, with args a Namespace
# holding one of Megatron's enums, pickled under Megatron's module name; the _extra_state objects), the same with
# the older common.pt, and the legacy per-rank mp_rank_0T/model_optim_rng.pt files of TP 2.
MEGATRON_SAVE = """
import argparse, enum, json, sys, types, torch, torch.distributed.checkpoint as dcp
from pathlib import Path
from torch.distributed.checkpoint import DefaultSavePlanner
enums = types.ModuleType("megatron.core.enums")
class ModelType(enum.Enum):
    encoder_or_decoder = 1
ModelType.__module__ = enums.__name__
enums.ModelType = ModelType
sys.modules[enums.__name__] = enums
root = Path(sys.argv[1])
args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                          num_layers=2, hidden_size=4, num_attention_heads=2, swiglu=True, params_dtype=torch.float32,
                          model_type=ModelType.encoder_or_decoder, untie_embeddings_and_output_weights=True)
common = {"args": args, "checkpoint_version": 3.0, "iteration": 5}
weights = {"embedding.word_embeddings.weight": torch.arange(32.0).reshape(8, 4),
           "decoder.layers.self_attention.linear_qkv.weight": torch.arange(64.0).reshape(2, 8, 4)}
objects = {f"decoder.layers.self_attention.linear_qkv._extra_state/shard_{l}_2": [None] for l in range(2)}
config = json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
dcp.save({**weights, **objects, "common_state/shard_0_1": [common]}, checkpoint_id=root / "megatron", no_dist=True,
         planner=DefaultSavePlanner(flatten_state_dict=False))
(root / "megatron" / "metadata.json").write_text(config)
dcp.save({**weights, **objects}, checkpoint_id=root / "megatron-common-pt", no_dist=True,
         planner=DefaultSavePlanner(flatten_state_dict=False))
(root / "megatron-common-pt" / "metadata.json").write_text(config)
torch.save(common, root / "megatron-common-pt" / "common.pt")
for tp in range(2):
    model = {"embedding.word_embeddings.weight": weights["embedding.word_embeddings.weight"][4 * tp:4 * tp + 4],
             **{f"decoder.layers.{l}.self_attention.linear_qkv.weight": weights[
                 "decoder.layers.self_attention.linear_qkv.weight"][l, 4 * tp:4 * tp + 4] for l in range(2)},
             "decoder.layers.0.self_attention.linear_qkv._extra_state": None}
    (root / "megatron-legacy" / f"mp_rank_0{tp}").mkdir(parents=True)
    torch.save({"model": model, **common}, root / "megatron-legacy" / f"mp_rank_0{tp}" / "model_optim_rng.pt")
"""


def megatron_common_state(folder: Path) -> tuple[int, int]:
    """Where the common state's record lies in the base's data file (torch reads the trusted base's .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    [info] = [info for index, info in metadata.storage_data.items() if index.fqn == "common_state/shard_0_1"]
    return info.offset, info.offset + info.length


def mutate_megatron_config(rng: random.Random, config: dict) -> tuple[str, str]:
    """Megatron-Core's metadata.json changed as data."""
    field = rng.choice(["sharded_backend", "sharded_backend_version", "extra"])
    value = rng.choice(HOSTILE_JSON + ["zarr", "torch_dist", "torch"])
    return json.dumps({**config, field: value}), f"{field}={json_text(value)[:20]}"


# (kind, mutants): where each kind's mutations go; the counts add up to the corpus.
CORPUS = {"dcp-metadata": 70, "dcp-distcp": 45, "safetensors": 70, "index": 40, "fsdp-config": 30,
          "fsdp1-pickle": 60, "fsdp1-dtensor-pickle": 40, "torch-save": 25, "hf-dcp": 30,
          "megatron-config": 12, "megatron-common-state": 16, "megatron-common-pt": 12, "megatron-legacy": 16}
CONVERT_TO = {"dcp": "torch", "hf": "dcp", "fsdp1": "hf", "torch": "fsdp1", "hf-dcp": "torch", "megatron": "torch"}
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
    if kind.startswith("megatron"):
        base, file = {"megatron-config": ("megatron", "metadata.json"),
                      "megatron-common-state": ("megatron", "__0_0.distcp"),
                      "megatron-common-pt": ("megatron-common-pt", "common.pt"),
                      "megatron-legacy": ("megatron-legacy", f"mp_rank_0{rng.randrange(2)}/model_optim_rng.pt")}[kind]
        shutil.copytree(bases / base, folder)
        if kind == "megatron-config":
            return folder, "megatron", mutate_json_file(rng, folder / file, mutate_megatron_config, 0.7)
        data = (folder / file).read_bytes()
        if file.endswith(".pt"):
            mutated, what = mutate_archive(rng, data)
        else:  # the common state's record in the data file
            lo, hi = megatron_common_state(folder)
            record, what = mutate_archive(rng, data[lo:hi])
            mutated = data[:lo] + record + data[hi:]
        (folder / file).write_bytes(mutated)
        return folder, "megatron", f"{file}:{what}"
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
        return folder, "hf", mutate_json_file(rng, folder / "model.safetensors.index.json", mutate_index, 0.7)
    if kind == "fsdp-config":
        shutil.copytree(bases / "fsdp1", folder)
        return folder, "fsdp1", mutate_json_file(rng, folder / "fsdp_config.json", mutate_config, 0.75)
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


def fork_server(bases: Path, scratch: Path, folder: Path) -> ForkServer:
    """The server the fuzz runs fork from: dcptool imported, a few commands run once to warm it up, each run
    under the address-space limit and the alarm."""
    warmup = [["--quiet", "inspect", str(bases / "dcp")], ["--quiet", "verify", str(bases / "dcp"), str(bases / "hf2")]]
    warmup += [["--quiet", "convert", str(bases / name), str(scratch / name), "--to", to, "--no-fsync"]
               for name, to in (("dcp", "hf"), ("hf", "dcp"), ("fsdp1", "torch"), ("fsdp1-dtensor", "hf"),
                                ("torch", "fsdp1"))]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MALLOC_ARENA_MAX="2",
               PYTHONWARNINGS="ignore")
    return ForkServer(folder, warmup, memory_limit=MEMORY_LIMIT, timeout=TIMEOUT,
                      at_once=AT_ONCE, env=env, cwd=str(ROOT))


def check_run(job: dict, result: subprocess.CompletedProcess) -> str | None:
    """What is wrong with one run, or None."""
    code, stderr = result.returncode, result.stderr
    lines = stderr.strip().splitlines()
    if code not in ((0, 1, 2) if job["argv"][1] == "check" else (0, 2)):
        return f"exit {code}: {stderr.strip()[-600:] or result.stdout[-300:]}"
    if "Traceback" in stderr:
        return f"traceback on exit {code}: {stderr[-600:]}"
    if code == 1 and len(lines) != 1:
        return f"{len(lines)} lines on stderr: {stderr[-600:]}"
    if code == 2:
        if len(lines) != 1:
            return f"{len(lines)} lines on stderr: {stderr[-600:]}"
        if job["out"] and (Path(job["out"]).exists() or any(Path(job["out"]).parent.iterdir())):
            return f"exit 2 but something was written next to {job['out']}: {sorted(Path(job['out']).parent.iterdir())}"
    elif job["out"] and not Path(job["out"]).exists():  # a convert that succeeded
        return "exit 0 but no output"
    return None
