"""FSDP1 per-rank checkpoints (verl layout) against real FSDP1 jobs on gloo.

Real multi-process jobs (this file is also their script, run under torchrun) save
``SHARDED_STATE_DICT`` files with ``ShardedTensor`` and ``DTensor`` values plus the full state dict
FSDP1 itself gathers (``FULL_STATE_DICT``). dcptool reads them without torch and is compared bitwise;
what dcptool writes is loaded back into a real FSDP1 job with ``SHARDED_STATE_DICT``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_fsdp1.py save OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_fsdp1.py load RESULT.json \
        DIR=EXPECT.pt ...
"""

from __future__ import annotations

import json
import os
import pickletools
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

VALUES = ("sharded_tensor", "dtensor")
NOTE = {"step": 3, "text": "carried as is"}  # a non-tensor entry the save job adds to the model file
REPLICATED_BUFFERS = r"(^|\.)pos$"  # the 1-D buffer FSDP1 leaves unsharded


# ---------------------------------------------------------------------------------------------
# The jobs (torch only; run under torchrun)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.back = torch.nn.Linear(6, 8, bias=False)

    def forward(self, x):
        return x + self.back(self.norm(self.proj(x)))


class Net(torch.nn.Module):
    """Row counts chosen to shard unevenly: 11 rows over 2 (6, 5) and 4 (3, 3, 3, 2); 5 rows over 4 (2, 2, 1, none)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 5)
        self.register_buffer("scale", torch.tensor(0.5))  # shape (): a plain tensor in every rank's file
        self.register_buffer("pos", torch.arange(8, dtype=torch.float32) / 8)  # unsharded 1-D buffer

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x * self.scale + self.pos)


def build_fsdp1(world_size: int, values: str, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    model = Net()
    extra = {"device_mesh": init_device_mesh("cpu", (world_size,))} if values == "dtensor" else {}
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                device_id=torch.device("cpu"), **extra)


def sharded_state_dict_type(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

    return FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())


def full_state_dict(model) -> dict:
    """FSDP1's own FULL_STATE_DICT (on rank 0). offload_to_cpu=True segfaults on a CPU-only job in torch 2.13."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def job_save(out: Path) -> None:
    """Train a step, then save verl-style files for both value types, and the full state dicts."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    for values in VALUES:
        model = build_fsdp1(world, values, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        ids = torch.arange(12).reshape(2, 6) % 11
        model(ids).pow(2).mean().backward()
        optimizer.step()
        folder = out / values
        folder.mkdir(parents=True, exist_ok=True)
        with sharded_state_dict_type(model):
            state = model.state_dict()
            optim_state = FSDP.optim_state_dict(model, optimizer)
        types = {k: type(v).__name__ for k, v in state.items()}
        state["note"] = dict(NOTE)
        torch.save(state, folder / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(optim_state, folder / f"optim_world_size_{world}_rank_{rank}.pt")
        torch.save({"rng": torch.get_rng_state()}, folder / f"extra_state_world_size_{world}_rank_{rank}.pt")
        full = full_state_dict(model)
        if rank == 0:
            (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 1, "world_size": world}))
            (folder / "huggingface").mkdir(exist_ok=True)
            (folder / "huggingface" / "config.json").write_text("{}")
            torch.save(full, out / f"{values}.full.pt")
            (out / f"{values}.types.json").write_text(json.dumps(types))
        dist.barrier()


def job_load(result: Path, pairs: list[str]) -> int:
    """Load each folder's files into a fresh FSDP1 model (SHARDED_STATE_DICT) and compare with its full state dict."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for pair in pairs:
        folder, expect = (Path(p) for p in pair.split("="))
        expected = torch.load(expect, weights_only=True)
        # weights_only=False, as verl loads these files: ShardedTensor values need the full unpickler.
        state = torch.load(folder / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False)
        problems = []
        objects = {k: state.pop(k) for k in list(state) if not isinstance(state[k], torch.Tensor)}
        for key, value in state.items():
            if isinstance(value, ShardedTensor):
                problems += check_local_shards(key, value, expected[key], rank)
            elif not torch.equal(value, expected[key]):
                problems.append(f"{key}: plain tensor differs")
        model = build_fsdp1(world, "sharded_tensor", seed=1234)  # other values than the saver's
        with sharded_state_dict_type(model):
            model.load_state_dict(state)  # strict: every key of the model, nothing else
        loaded = full_state_dict(model)
        if rank == 0:
            if sorted(loaded) != sorted(expected):
                problems.append(f"keys {sorted(loaded)} != {sorted(expected)}")
            for key in sorted(set(loaded) & set(expected)):
                same = loaded[key].dtype == expected[key].dtype and torch.equal(loaded[key], expected[key])
                if not same:
                    problems.append(f"{key}: loaded value differs")
        everyone = [None] * world
        dist.all_gather_object(everyone, {
            "problems": problems,
            "types": {k: type(v).__name__ for k, v in state.items()},
            "objects": objects,
        })
        report[str(folder)] = everyone
    if rank == 0:  # the test reads the problems from here; the job itself succeeds
        result.write_text(json.dumps(report, indent=1))
    return 0


def check_local_shards(key: str, value, full: torch.Tensor, rank: int) -> list[str]:
    """The rank's shard must be the rows FSDP1 gives it (torch.chunk on dim 0), at the offsets its metadata says."""
    problems = []
    rows = full.chunk(torch.distributed.get_world_size(), dim=0)
    shards = value.local_shards()
    if tuple(value.size()) != tuple(full.shape):
        problems.append(f"{key}: global size {tuple(value.size())} != {tuple(full.shape)}")
    if len(shards) != (1 if rank < len(rows) else 0):
        problems.append(f"{key}: {len(shards)} local shards on rank {rank}")
    for shard in shards:
        offsets = shard.metadata.shard_offsets
        region = full[tuple(slice(o, o + s) for o, s in zip(offsets, shard.metadata.shard_sizes))]
        if not torch.equal(shard.tensor, region) or not torch.equal(shard.tensor, rows[rank]):
            problems.append(f"{key}: local shard at {offsets} differs")
    return problems


def job_main(argv: list[str]) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        status = job_save(Path(argv[1])) if argv[0] == "save" else job_load(Path(argv[1]), argv[2:])
        dist.barrier()
        return status or 0
    finally:
        dist.destroy_process_group()


def run_job(nproc: int, *args) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               __file__, *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"job {args[0]} on {nproc} ranks failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                             f"{done.stderr[-6000:]}")


if __name__ == "__main__":
    code = job_main(sys.argv[1:])
    # A finished gloo process sometimes aborts in interpreter teardown ("terminate called without an
    # active exception", after destroy_process_group and atexit); leave without running C++ destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# The tests

from conftest import dcptool, read_tensor  # noqa: E402
from harness.conversions import convert_checkpoint  # noqa: E402
from dcptool.errors import CheckpointError, UnsafePickleError  # noqa: E402
from dcptool.formats import detect, open_checkpoint  # noqa: E402
from dcptool.safe_pickle import Record, SubclassRef, TensorRef  # noqa: E402
from dcptool.storage import CheckpointFiles  # noqa: E402
from dcptool.torch_archive import Archive  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(world_size)``: the folder of a save job on that many ranks (made once)."""
    root = tmp_path_factory.mktemp("fsdp1")
    made = {}

    def get(world_size: int) -> Path:
        if world_size not in made:
            out = root / f"w{world_size}"
            run_job(world_size, "save", out)
            made[world_size] = out
        return made[world_size]

    return get


def assert_same(checkpoint, expected: dict) -> None:
    """The model part equals ``expected`` (the optimizer and extra state are read too: tests/test_verl.py)."""
    model = [key for key in checkpoint.tensors if not key.startswith(("optimizer.", "extra_state."))]
    assert sorted(model) == sorted(expected)
    for key, value in expected.items():
        actual = read_tensor(checkpoint, key)
        assert actual.dtype == value.dtype and actual.shape == value.shape, key
        assert torch.equal(actual, value), key


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("values", VALUES)
def test_reader_matches_fsdp1_full_state_dict(saved, world_size, values):
    out = saved(world_size)
    folder = out / values
    types = json.loads((out / f"{values}.types.json").read_text())
    assert types["embed.weight"] == {"sharded_tensor": "ShardedTensor", "dtensor": "DTensor"}[values]
    assert types["scale"] == types["pos"] == "Tensor"
    assert detect(folder) == "fsdp1"

    checkpoint = open_checkpoint(folder)
    assert checkpoint.format == "fsdp1"
    assert_same(checkpoint, torch.load(out / f"{values}.full.pt", weights_only=True))
    assert checkpoint.info["world_size"] == world_size
    assert checkpoint.info["optimizer_files"] == checkpoint.info["extra_state_files"] == world_size
    assert checkpoint.info["hf_config_dir"] == folder / "huggingface"
    # A nested non-tensor entry is flattened into keys, as the DCP and torch readers do.
    assert {k: checkpoint.object_value(o) for k, o in checkpoint.objects.items() if k.startswith("note.")} == {
        f"note.{k}": v for k, v in NOTE.items()}
    # One chunk per rank that holds rows, at the offsets the files record; the replicated buffer once.
    rows = {2: [6, 5], 4: [3, 3, 3, 2]}[world_size]
    assert [c.sizes[0] for c in sorted(checkpoint.tensors["embed.weight"].chunks, key=lambda c: c.offsets)] == rows
    head = {2: [3, 2], 4: [2, 2, 1]}[world_size]
    assert [c.sizes[0] for c in sorted(checkpoint.tensors["head.weight"].chunks, key=lambda c: c.offsets)] == head
    assert len(checkpoint.tensors["pos"].chunks) == 1 and checkpoint.tensors["scale"].shape == ()


@pytest.fixture(scope="module")
def round_trips(saved, tmp_path_factory):
    """dcptool-written fsdp1 folders loaded by real FSDP1 jobs: ``{(source, world size): per-rank reports}``."""
    root = tmp_path_factory.mktemp("fsdp1-out")
    w2, w4 = saved(2), saved(4)
    full_file = root / "full.pt"  # a plain torch full state dict as the source
    shutil.copy(w4 / "sharded_tensor.full.pt", full_file)
    jobs = {
        2: [("w2-sharded_tensor", w2 / "sharded_tensor", w2 / "sharded_tensor.full.pt"),
            ("w2-dtensor", w2 / "dtensor", w2 / "dtensor.full.pt"),
            ("w4-sharded_tensor", w4 / "sharded_tensor", w4 / "sharded_tensor.full.pt"),
            ("torch-full", full_file, full_file)],
        4: [("w2-dtensor", w2 / "dtensor", w2 / "dtensor.full.pt")],
    }
    reports = {}
    for world_size, sources in jobs.items():
        pairs = []
        for name, source, expect in sources:
            out = root / f"{name}-to-w{world_size}"
            convert_checkpoint(source, out, to="fsdp1", world_size=world_size,
                               format_options={"optim_form": "named", "model_values": "sharded-tensor"},
                               writer_options={"replicate": REPLICATED_BUFFERS})
            pairs.append(f"{out}={expect}")
            reports[(name, world_size)] = (out, expect)
        result = root / f"load-w{world_size}.json"
        run_job(world_size, "load", result, *pairs)
        loaded = json.loads(result.read_text())
        for name, _, _ in sources:
            out, expect = reports[(name, world_size)]
            reports[(name, world_size)] = (out, expect, loaded[str(out)])
    return reports


@pytest.mark.parametrize("name, world_size", [("w2-sharded_tensor", 2), ("w2-dtensor", 2), ("w4-sharded_tensor", 2),
                                              ("torch-full", 2), ("w2-dtensor", 4)])
def test_written_files_load_in_a_real_fsdp1_job(round_trips, name, world_size):
    out, expect, ranks = round_trips[(name, world_size)]
    assert len(ranks) == world_size
    for rank, report in enumerate(ranks):
        assert report["problems"] == [], f"rank {rank}: {report['problems']}"
        assert report["types"]["embed.weight"] == report["types"]["head.weight"] == "ShardedTensor"
        assert report["types"]["scale"] == report["types"]["pos"] == "Tensor"
        assert report["objects"] == ({} if name == "torch-full" else {"note": NOTE})
    assert json.loads((out / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": world_size}
    kinds = ["model"] if name == "torch-full" else ["model", "optim"]  # the save job's optimizer state goes too
    config = [] if name == "torch-full" else ["huggingface"]  # a verl folder's model config is carried over
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["fsdp_config.json", *config] + [f"{kind}_world_size_{world_size}_rank_{r}.pt" for kind in kinds
                                         for r in range(world_size)])
    # dcptool reads its own output back to the same values.
    assert_same(open_checkpoint(out), torch.load(expect, weights_only=True))


def pickle_globals(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    return {arg.replace(" ", ".") for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


def structure(value):
    """What a pickle holds, as seen through dcptool's stand-ins, without storage names."""
    if isinstance(value, TensorRef):
        return ("tensor", value.dtype.name, value.shape, value.stride, value.storage_offset, value.storage.numel,
                value.subclass, structure(value.subclass_state))
    if isinstance(value, SubclassRef):
        return ("subclass", value.qualname, structure(value.args), structure(value.state))
    if isinstance(value, Record):
        return (type(value).qualname, {k: structure(v) for k, v in sorted(vars(value).items())})
    if isinstance(value, dict):
        return [(k, structure(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [structure(v) for v in value])
    return (type(value).__name__, value)


@pytest.mark.parametrize("rank", [0, 1])
def test_written_pickle_is_what_torch_pickles(saved, round_trips, rank):
    """Same globals, and the same objects in the same order, as torch.save of FSDP1's own state dict."""
    name = f"model_world_size_2_rank_{rank}.pt"
    real, ours = saved(2) / "sharded_tensor", round_trips[("w2-sharded_tensor", 2)][0]
    assert pickle_globals(ours / name) == pickle_globals(real / name)
    loaded = [Archive(CheckpointFiles(folder), name).load() for folder in (real, ours)]
    assert structure(loaded[1]) == structure(loaded[0])


def test_reading_and_writing_never_import_torch(saved, tmp_path):
    code = (
        "import sys\n"
        "import dcptool\n"
        f"dcptool.convert({str(saved(2) / 'dtensor')!r}, {str(tmp_path / 'out')!r}, to='fsdp1',\n"
        "                format_options=dcptool.format_options('fsdp1', world_size=3))\n"
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')], 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert len(list((tmp_path / "out").glob("model_world_size_3_rank_*.pt"))) == 3


def test_missing_rank_file_is_named(saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved(4) / "sharded_tensor", folder)
    (folder / "model_world_size_4_rank_2.pt").unlink()
    with pytest.raises(CheckpointError, match="model_world_size_4_rank_2.pt"):
        open_checkpoint(folder)
    (folder / "fsdp_config.json").unlink()  # world size from the file names alone
    with pytest.raises(CheckpointError, match="model_world_size_4_rank_2.pt: missing"):
        open_checkpoint(folder)


def test_ranks_that_disagree_on_a_shape_are_refused(saved, tmp_path):
    full = torch.load(saved(2) / "sharded_tensor.full.pt", weights_only=True)
    torch.save(full, tmp_path / "a.pt")
    torch.save(dict(full, **{"head.weight": full["head.weight"][:4].clone()}), tmp_path / "b.pt")
    for name in ("a", "b"):
        convert_checkpoint(tmp_path / f"{name}.pt", tmp_path / name, to="fsdp1", world_size=2,
                           writer_options={"replicate": REPLICATED_BUFFERS})
    shutil.copy(tmp_path / "b" / "model_world_size_2_rank_1.pt", tmp_path / "a" / "model_world_size_2_rank_1.pt")
    with pytest.raises(CheckpointError, match=r"model_world_size_2_rank_1.pt.*head.weight is float32\[4, 8\]"):
        open_checkpoint(tmp_path / "a")


class NotACheckpointType:
    pass


def test_foreign_objects_in_a_rank_file_are_refused(tmp_path):
    torch.save({"w": torch.zeros(2), "x": NotACheckpointType()}, tmp_path / "model_world_size_1_rank_0.pt")
    with pytest.raises(UnsafePickleError, match="NotACheckpointType"):
        open_checkpoint(tmp_path)


def test_entries_verl_has_no_place_for_ride_in_the_extra_state(tmp_path):
    """A source's train_state rides as plain data in rank 0's extra-state file, beside verl's placeholder
    scheduler, and comes back without one; an object that is not plain data (a numpy array, which torch's
    weights_only loading refuses) is left out with a line."""
    import numpy as np

    train_state = {"step": 7, "seen": b"position 100", "losses": [1.5, 0.25]}
    torch.save({"model": {"w": torch.arange(6.0).reshape(3, 2)}, "train_state": train_state,
                "metrics": {"hist": np.arange(3)}}, tmp_path / "source.pt")
    result = dcptool("convert", tmp_path / "source.pt", tmp_path / "out", "--to", "fsdp1", "--world-size", "2")
    left_out = next(line for line in result.stdout.splitlines() if line.startswith("left out"))
    assert "not plain data" in left_out and left_out.endswith(": metrics.hist")
    extra = [torch.load(tmp_path / "out" / f"extra_state_world_size_2_rank_{r}.pt", weights_only=True) for r in (0, 1)]
    assert extra == [{"lr_scheduler": None, "dcptool_carried": {"train_state": train_state}}, {"lr_scheduler": None}]
    dcptool("convert", tmp_path / "out", tmp_path / "back.pt", "--to", "torch")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == {"w", "train_state"} and back["train_state"] == train_state
    # A carried entry under a key of the model files never replaces the model's value.
    torch.save({**extra[1], "dcptool_carried": {"w": torch.zeros(3, 2)}},
               tmp_path / "out" / "extra_state_world_size_2_rank_1.pt")
    checkpoint = open_checkpoint(tmp_path / "out")
    assert torch.equal(read_tensor(checkpoint, "w"), torch.arange(6.0).reshape(3, 2))
    assert "dcptool_carried of the extra-state files holds w, which the model" in checkpoint.info["not_read"][0]
    assert "train_state.step" not in checkpoint.objects
