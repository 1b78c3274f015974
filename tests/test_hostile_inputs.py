"""Inputs that broke dcptool before (a traceback and exit 1, tens of GB allocated, a hang), each run through
the real command line under the fuzz runs' limits (tests/fuzzing.py); and the restricted unpickler's
bounds: what an N-byte pickle can make it do is O(N)."""

from __future__ import annotations

import json
import pickletools
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from fuzzing import DEEP_LIST, MEMORY_LIMIT, ROOT, TIMEOUT, digest, pickle_regions
from jobs import ForkServer


# ---------------------------------------------------------------------------------------------
# Targeted cases: each input that broke before (a traceback and exit 1, tens of GB, a hang)


def refused(runs: ForkServer, path: Path, *names: str, tmp_path: Path, command: str = "convert", options=()) -> str:
    """Exit 2 with one line naming ``names``, no traceback, nothing written, the source unchanged (the real
    command line, forked by the fuzz runs' server, under their limits)."""
    before = digest(path)
    out = tmp_path / "refused-out"
    args = ["convert", path, out, "--to", "torch", "--no-fsync"] if command == "convert" else ["inspect", path]
    args += options
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
    for rank, header in enumerate(headers, start=1):  # data as long as the header says (safetensors takes no more)
        safetensors_file(folder / f"shard-{rank:05d}-model-00001-of-00001.safetensors", header,
                         b"\0" * json.loads(header)["w"]["data_offsets"][1])
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
    """A BINPUT turned into LONG_BINPUT: the next four bytes become a memo index in the billions. (data.pkl's
    CRC-32 no longer matches: records are read unchecked here, to reach the pickle machine.)"""
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
    assert "memo index" in refused(forked_runs, path, "model_world_size_2_rank_0.pt", tmp_path=tmp_path,
                                   options=["--no-verify-records"])


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


class _RunsCode:
    """Pickles as a call of ``os.system`` (what a hostile checkpoint's pickle does under ``pickle.load``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("where", ["common.pt", "common state", "legacy args"])
def test_megatron_pickles_that_run_code_are_refused(forked_runs, bases, tmp_path, where):
    """Megatron's common state and legacy files are read by the restricted unpickler: a pickle that would run a
    command under ``pickle.load`` (``torch.load(weights_only=False)``, as Megatron-LM's legacy loader does) is
    refused in one line and runs nothing."""
    import torch
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    common = {"args": _RunsCode(marker), "iteration": 5, "checkpoint_version": 3.0}
    if where == "common.pt":
        folder = shutil.copytree(bases / "megatron-common-pt", tmp_path / "run")
        torch.save(common, folder / "common.pt")
    elif where == "common state":
        folder = tmp_path / "run"
        dcp.save({"w": torch.ones(2), "common_state/shard_0_1": [common]}, checkpoint_id=folder, no_dist=True,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
        (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                          "sharded_backend_version": 1}))
    else:
        folder = shutil.copytree(bases / "megatron-legacy", tmp_path / "run")
        torch.save({"model": {"w": torch.ones(2)}, **common}, folder / "mp_rank_00" / "model_optim_rng.pt")
    refused(forked_runs, folder, "refuses to unpickle posix.system", tmp_path=tmp_path, command="inspect")
    assert not marker.exists()
