"""The restricted unpickler on what real jobs pickle beside tensors: numpy RNG state, and FSDP1 on one rank.

numpy values are rebuilt as data (``np.frombuffer`` of checked bytes, never numpy's own reconstruct
functions); torch itself (``torch.load``) is the oracle for what a file holds.
"""

from __future__ import annotations

import collections
import io
import pickle
import random
import zipfile

import numpy as np
import pytest
import torch

from conftest import dcptool
from jobs import VERL_JOBS, run_job
from dcptool.errors import CheckpointError, UnsafePickleError
from dcptool.safe_pickle import TensorRef, load_bytes
from dcptool.torch_archive import Global, PickleStream, Reduced, Streamed, Unpicklable, dumps, new_object


def data_pkl(path_or_bytes) -> bytes:
    """The ``data.pkl`` of a torch.save archive."""
    with zipfile.ZipFile(path_or_bytes) as archive:
        name, = (n for n in archive.namelist() if n.endswith("/data.pkl"))
        return archive.read(name)


def saved_rng_state() -> dict:
    """RNG state as verl's extra state and HF Trainer's rng_state_*.pth hold it, through torch.save."""
    np.random.seed(7)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state(),
             "scalars": [np.float64(0.25), np.int32(-3), np.bool_(True)],
             "arrays": [np.arange(6, dtype=np.float16).reshape(2, 3), np.asfortranarray(np.eye(2, 3)),
                        np.zeros((0, 4), np.int8), np.arange(3, dtype=">u4"), np.array([1 + 2j], np.complex64)]}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_numpy_values_read_as_data_equal_to_torch_load():
    buffer = saved_rng_state()
    expected = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    got = load_bytes(data_pkl(buffer), "rng_state_0.pth")
    assert isinstance(got["cpu"], TensorRef) and got["python"] == expected["python"]
    name, keys, *rest = got["numpy"]
    assert name == "MT19937" and keys.dtype == np.uint32 and np.array_equal(keys, expected["numpy"][1])
    assert tuple(rest) == tuple(expected["numpy"][2:])
    for value, want in zip(got["scalars"] + got["arrays"], expected["scalars"] + expected["arrays"]):
        assert type(value) is type(want) and value.dtype == want.dtype and np.shape(value) == np.shape(want)
        assert np.array_equal(value, want)
    assert got["arrays"][1].flags.f_contiguous
    # Written back (as torch_archive pickles objects), Python's own unpickler gives the same values.
    back = pickle.loads(dumps({k: v for k, v in got.items() if k != "cpu"}))
    assert np.array_equal(back["numpy"][1], expected["numpy"][1]) and back["numpy"][1].dtype == np.uint32
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back["arrays"], expected["arrays"]))


@pytest.mark.parametrize("value,problem", [
    (np.array(["text"]), "not a plain numeric dtype"),
    (np.array([object()], dtype=object), "not a plain numeric dtype"),
    (np.zeros(2, dtype=[("x", "f4")]), "not a plain numeric dtype"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "not a plain numeric dtype"),
])
def test_numpy_values_that_are_not_plain_numbers_are_refused(value, problem):
    with pytest.raises(CheckpointError, match=problem):
        load_bytes(pickle.dumps({"rng": value}, protocol=2), "rng.pth")


def test_numpy_array_whose_bytes_do_not_match_its_shape_is_refused():
    good = pickle.dumps(np.arange(4, dtype=np.int32), protocol=2)
    assert np.array_equal(load_bytes(good, "a.pkl"), np.arange(4))
    bad = good.replace(b"K\x04\x85", b"K\x05\x85")  # shape (4,) -> (5,): 20 bytes wanted, 16 given
    assert bad != good
    with pytest.raises(CheckpointError, match="needs 20 bytes, has 16"):
        load_bytes(bad, "a.pkl")


def test_numpy_shell_used_before_its_data_is_refused():
    # _reconstruct's empty array put in the memo and fetched before BUILD gives it data
    shell = (b"\x80\x02]q\x00(cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R"
             b"q\x01h\x01e.")
    with pytest.raises(CheckpointError, match="before its data"):
        load_bytes(shell, "a.pkl")
    never_built = b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85C\x01b\x87R\x85."
    with pytest.raises(CheckpointError, match="without its data"):
        load_bytes(never_built, "a.pkl")
    with pytest.raises(UnsafePickleError, match="numpy.core.multiarray.frombuffer"):
        load_bytes(b"\x80\x02cnumpy.core.multiarray\nfrombuffer\n.", "a.pkl")


@pytest.fixture(scope="module")
def one_rank_verl(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl1") / "actor"
    run_job(1, "save", out, module=VERL_JOBS)
    return out


def test_one_rank_fsdp1_files_read(one_rank_verl, tmp_path):
    """FSDP1 on one rank pickles plain tensors through _rebuild_from_type_v2(..., torch.Tensor, ..., {_has_been_cloned})."""
    model_file = one_rank_verl / "model_world_size_1_rank_0.pt"
    assert b"torch\nTensor\n" in data_pkl(model_file)  # the layout this test is about
    out = tmp_path / "full.pt"
    dcptool("convert", one_rank_verl, out, "--to", "torch", "--exclude", "^optimizer")
    written = torch.load(out, weights_only=True)
    expected = torch.load(model_file, weights_only=False)
    assert sorted(k for k in written if k != "extra_state") == sorted(expected)
    assert all(torch.equal(written[k], v) for k, v in expected.items())
    assert written["extra_state"]["lr_scheduler"]["last_epoch"] == 2


def test_one_rank_fsdp1_folder_resumes_at_two_ranks(one_rank_verl, tmp_path):
    """Model, optimizer (whole moments keyed by position) and scheduler of the one-rank folder, resumed by verl's calls."""
    from test_verl import assert_same_step, resumed_losses, verl_jobs

    out = tmp_path / "w2"
    result = dcptool("reshard", one_rank_verl, out, "--to", "fsdp1", "--dp", "2")
    assert "not read" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert_same_step(resumed_losses(out, 2), verl_jobs.reference(one_rank_verl.parent / "actor.full.pt"))


@pytest.mark.parametrize("old,new,problem", [
    (b"torch\nTensor\n", b"torch.nn\nModule\n", "refuses to unpickle torch.nn.Module"),
    (b"_has_been_cloned", b"_has_been_clonez", "not FSDP's _has_been_cloned flag"),
])
def test_one_rank_fsdp1_hostile_variants_are_refused(one_rank_verl, old, new, problem):
    data = data_pkl(one_rank_verl / "model_world_size_1_rank_0.pt")
    assert old in data
    with pytest.raises(CheckpointError, match=problem):
        load_bytes(data.replace(old, new), "model_world_size_1_rank_0.pt")


@pytest.mark.parametrize("protocol", [2, 5])
def test_metadata_rows_read_as_torch_reads_them_in_other_protocols(tmp_path, protocol):
    """Runs of records keep their memo slots as index ranges: with protocol 5 (MEMOIZE) later records
    refer into earlier runs' slots, which must resolve as pickle does; protocol 2 (BINPUT) takes the
    ordinary opcodes and must agree too."""
    from harness import synth_dcp
    from dcptool.converters.dcp.metadata import each_item, each_record, unpickle

    synth_dcp.main([str(tmp_path), "--ranks", "32", "--tp", "2", "--layers", "2", "--rows", "16", "--width", "4"])
    theirs = pickle.loads((tmp_path / ".metadata").read_bytes())
    ours = unpickle(pickle.dumps(theirs, protocol=protocol), "x")
    for key, md in theirs.state_dict_metadata.items():
        chunks = list(each_record(ours.state_dict_metadata[key].chunks)) if hasattr(md, "chunks") else []
        assert [(c.offsets, c.sizes) for c in chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in getattr(md, "chunks", [])]
    mine = {(i.fqn, i.offset): (s.relative_path, s.offset, s.length) for i, s in each_item(ours.storage_data)}
    assert mine == {(i.fqn, tuple(i.offset) if i.offset is not None else None): (s.relative_path, s.offset, s.length)
                    for i, s in theirs.storage_data.items()}


def test_streamed_pickles_load_as_the_values_they_stand_for():
    """PickleStream (the ``.metadata`` of a thousand ranks) against pickle.loads: every integer width,
    long strings, more memoized strings than one-byte memo indices reach, batches past 1,000 items,
    tuples past 3, objects rebuilt with NEWOBJ + BUILD and REDUCE, and dicts made as they are written."""
    rng = random.Random(0)
    ints = [0, 255, 256, 65535, 65536, -1, -2**31, 2**31 - 1, 2**31, 2**63 - 1, -2**63, 10**30]
    strings = [f"key-{i}" for i in range(700)] + ["x" * 300, "é✓"]
    pairs = [(rng.choice(strings), tuple(rng.choice(ints) for _ in range(rng.randint(0, 5)))) for _ in range(2500)]
    value = {
        "ints": ints, "floats": [0.5, -2.25], "flags": (True, False, None),
        "strings": strings + strings,  # the second time as memo references, past index 255
        "list": list(range(2500)),
        "ordered": Reduced(Global("collections", "OrderedDict"), ([("a", 1), ("b", (1, 2, 3, 4))],)),
        "counter": new_object("collections", "Counter", {"hits": 3}),
        "streamed": Streamed(iter(pairs)),
    }
    stream = PickleStream(io.BytesIO(), buffer_bytes=4096)
    stream.start()
    stream.save(value)
    stream.stop()
    loaded = pickle.loads(stream.file.getvalue())
    expected = collections.Counter()
    expected.hits = 3
    assert loaded["ints"] == ints and loaded["floats"] == [0.5, -2.25] and loaded["flags"] == (True, False, None)
    assert loaded["strings"] == strings + strings and loaded["list"] == list(range(2500))
    assert loaded["ordered"] == collections.OrderedDict([("a", 1), ("b", (1, 2, 3, 4))])
    assert type(loaded["counter"]) is collections.Counter and loaded["counter"].hits == 3
    assert loaded["streamed"] == dict(pairs)
    with pytest.raises(Unpicklable):
        PickleStream(io.BytesIO()).save(object())


def test_data_records_are_pickled_back_as_what_they_were():
    """Namespaces, enums (Megatron's args) and dtypes the restricted unpickler read as data are written back as
    what they were; any other record cannot be (its class is not data)."""
    import argparse
    import signal

    from dcptool.safe_pickle import load_bytes

    saved = {"args": new_object("argparse", "Namespace", {"tp": 2, "signal": Reduced(Global("signal", "Signals"), (15,)),
                                                          "dtype": Global("torch", "bfloat16")})}
    written = pickle.loads(dumps(load_bytes(dumps(saved), "common.pt")))
    assert written == {"args": argparse.Namespace(tp=2, signal=signal.SIGTERM, dtype=torch.bfloat16)}
    meta = load_bytes(dumps(new_object("torch.distributed.tensor._dtensor_spec", "TensorMeta", {"shape": (1,)})), "x")
    with pytest.raises(Unpicklable):
        dumps(meta)
