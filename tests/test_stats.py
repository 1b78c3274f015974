"""inspect --stats, the parameter count, --include and folded rows, and --layout pictures, on real saves.

Oracles: numpy over the reference full state dict a real gloo job gathered with torch's own state
dict helpers; torch's dcp.save for a small MoE-like checkpoint with planted faults; and the chunk
offsets and rank files that torch's own DCP metadata reader reports.
"""

import json
import re
import warnings
import xml.etree.ElementTree as ElementTree

import numpy as np
import pytest

from conftest import dcptool, load_reference

STAT_FIELDS = ("min", "max", "mean", "std", "l2", "zeros", "nan", "inf")


def numpy_stats(values: np.ndarray) -> dict:
    """The numbers inspect --stats promises, computed by numpy in float64 over the finite values."""
    flat = values.astype(np.float64).reshape(-1)
    finite = flat[np.isfinite(flat)]
    numbers = {"zeros": int(np.count_nonzero(finite == 0)), "nan": int(np.isnan(flat).sum()),
               "inf": int(np.isinf(flat).sum())}
    if finite.size:
        numbers |= {"min": finite.min(), "max": finite.max(), "mean": finite.mean(), "std": finite.std(),
                    "l2": np.sqrt(np.sum(finite * finite))}
    return numbers


def assert_stats(key: str, got: dict, expected: dict) -> None:
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, name, got[name], value)


def test_stats_match_numpy_over_the_reference(checkpoints):
    path, reference = checkpoints("fsdp2_dp2_tp2")
    full = load_reference(reference)
    # A small budget reads the larger tensors in several slabs, summed across them and two threads.
    report = json.loads(dcptool("inspect", path, "--stats", "--json", "--max-memory", "128KB", "--threads", "2").stdout)
    stats = report["stats"]["tensors"]
    assert set(stats) == set(full)
    for key, tensor in full.items():
        assert_stats(key, stats[key], numpy_stats(tensor.double().numpy()))
        assert stats[key]["shape"] == list(tensor.shape) and stats[key]["elements"] == tensor.numel()
    # Parameters: the model weights only (dcp.model.*), not the optimizer moments beside them.
    model = {k: t for k, t in full.items() if k.startswith("dcp.model.")}
    parameters = report["parameters"]
    assert parameters["total"] == sum(t.numel() for t in model.values())
    assert parameters["other_elements"] == sum(t.numel() for k, t in full.items() if k not in model)
    assert parameters["groups"]["model.layers"] == sum(t.numel() for k, t in model.items() if ".layers." in k)
    assert parameters["groups"]["lm_head"] == full["dcp.model.lm_head.weight"].numel()
    assert sum(parameters["groups"].values()) == parameters["total"] and parameters["experts"] is None


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A single-process dcp.save of MoE-like weights with faults planted: expert 2 of a grouped
    [E, out, in] tensor zeroed, expert 1 of per-expert keys zeroed, one NaN, one Inf, a copied tensor."""
    import torch
    import torch.distributed.checkpoint as dcp

    generator = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    grouped = randn(4, 8, 6)
    grouped[2] = 0
    model = {"layers.0.moe.experts.w1": grouped, "norm.weight": torch.ones(8), "output.weight": randn(10, 8),
             "layers.0.attention.wq.weight": randn(16, 8).to(torch.bfloat16),
             "layers.0.attention.wo.weight": randn(8, 16).to(torch.float16)}
    for layer in range(3):
        model[f"layers.{layer}.attention.wk.weight"] = randn(16, 8)
    model["layers.2.attention.wk.weight"][3, 1] = float("nan")
    model["layers.0.attention.wo.weight"][0, 0] = float("inf")
    for expert in range(4):
        model[f"layers.1.mlp.experts.{expert}.up_proj.weight"] = torch.zeros(4, 3) if expert == 1 else randn(4, 3)
    model["copy.weight"] = model["output.weight"].clone()
    state = {"model": model, "optimizer": {"state.output.weight.exp_avg": randn(10, 8)}}
    path = tmp_path_factory.mktemp("planted") / "ckpt"
    with warnings.catch_warnings():  # no process group: torch says it saves as a single rank, as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path)
    return path, {f"model.{k}": v for k, v in model.items()} | {"optimizer.state.output.weight.exp_avg": state["optimizer"]["state.output.weight.exp_avg"]}


def test_planted_faults_are_flagged(planted):
    path, tensors = planted
    report = json.loads(dcptool("inspect", path, "--stats", "--json").stdout)
    for key, tensor in tensors.items():  # bfloat16 and float16 widened to float64 as torch widens them
        assert_stats(key, report["stats"]["tensors"][key], numpy_stats(tensor.double().numpy()))
    grouped = report["stats"]["tensors"]["model.layers.0.moe.experts.w1"]["expert_norms"]
    assert grouped[2] == 0 and all(grouped[e] > 0 for e in (0, 1, 3))
    flags = {(f["kind"], tuple(f["keys"])) for f in report["stats"]["flags"]}
    assert flags == {
        ("zero expert", ("model.layers.0.moe.experts.w1",)),
        ("zero expert", ("model.layers.1.mlp.experts.1.up_proj.weight",)),
        ("non-finite", ("model.layers.2.attention.wk.weight",)),
        ("non-finite", ("model.layers.0.attention.wo.weight",)),
        ("identical", ("model.output.weight", "model.copy.weight")),
    }  # the constant norm.weight (all ones) is neither all zeros nor worth an "identical"
    experts = report["parameters"]["experts"]
    assert experts == {"count": 4, "per_expert": (4 * 8 * 6 + 4 * 4 * 3) // 4, "total": 4 * 8 * 6 + 4 * 4 * 3, "layers": 2}

    text = dcptool("inspect", path, "--stats").stdout
    assert "suspicious: zero expert: model.layers.0.moe.experts.w1: expert 2 of 4 is all zeros" in text
    assert "suspicious: non-finite: model.layers.2.attention.wk.weight: 1 NaN, 0 Inf" in text
    assert "5 suspicious findings" in text


def test_a_damaged_record_is_a_finding_that_exits_1(planted, tmp_path):
    """The faults above are reported with exit 0; a record that cannot be read is damage a CI gate must see."""
    import shutil

    from torch.distributed.checkpoint import FileSystemReader

    path, _ = planted
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    key = "model.output.weight"
    info = next(info for index, info in FileSystemReader(str(path)).read_metadata().storage_data.items()
                if index.fqn == key)
    data = bytearray((damaged / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    (damaged / info.relative_path).write_bytes(bytes(data))
    for options in ((), ("--json",)):
        result = dcptool("inspect", damaged, "--stats", *options, check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert lines[0] == f"dcptool: error: {damaged}: 1 tensor could not be read: {key}", lines
    flags = json.loads(result.stdout)["stats"]["flags"]
    assert [flag["keys"] for flag in flags if flag["kind"] == "unreadable"] == [[key]]


def test_include_and_folded_rows(planted):
    path, _ = planted
    rows = dcptool("inspect", path).stdout.splitlines()
    folded = [r for r in rows if r.startswith("model.layers.{0..2}.attention.wk.weight")]
    assert len(folded) == 1 and folded[0].split()[1:4] == ["float32", "[16,", "8]"]
    assert "model.layers.1.mlp.experts.{0..3}.up_proj.weight" in "\n".join(rows)
    every = dcptool("inspect", path, "--all").stdout
    assert all(f"model.layers.{n}.attention.wk.weight " in every for n in range(3)) and "{" not in every
    only = json.loads(dcptool("inspect", path, "--include", r"experts\.", "--json").stdout)
    assert sorted(only["tensors"]) == ["model.layers.0.moe.experts.w1"] + [
        f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    assert only["parameters"]["total"] == 4 * 8 * 6 + 4 * 4 * 3

    for args, says in [(["--include", "("], "--include '(': not a regular expression"),
                       (["--layout", "model.norm.weigh"], "did you mean model.norm.weight"),
                       (["--svg", "x.svg"], "--mesh and --svg go with --layout KEY")]:
        result = dcptool("inspect", path, *args, check=False)
        assert result.returncode == 2 and says in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def saved_blocks(path, key) -> dict:
    """{(offsets, sizes): rank} as torch's DCP metadata reader reports the chunks and the rank files holding them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    metadata = FileSystemReader(str(path)).read_metadata()
    blocks = {}
    for chunk in metadata.state_dict_metadata[key].chunks:
        stored = metadata.storage_data[MetadataIndex(key, chunk.offsets)].relative_path
        rank = int(re.fullmatch(r"__(\d+)_\d+\.distcp", stored)[1])
        blocks[tuple(chunk.offsets), tuple(chunk.sizes)] = rank
    return blocks


def grid_cells(text: str) -> list[list[str]]:
    lines = text.splitlines()
    grid = lines[3:lines.index("legend:")]
    return [line.split("|", 1)[1].split() for line in grid if "|" in line]


@pytest.mark.parametrize("name", ["q_proj", "o_proj", "norm"])
def test_layout_names_the_rank_of_every_block(checkpoints, tmp_path, name):
    path, _ = checkpoints("fsdp2_dp2_tp2")  # dp=2 x tp=2: q_proj strided colwise, o_proj rowwise, norm replicated on tp
    key = {"q_proj": "dcp.model.model.layers.0.self_attn.q_proj.weight",
           "o_proj": "dcp.model.model.layers.0.self_attn.o_proj.weight", "norm": "dcp.model.model.norm.weight"}[name]
    expected = saved_blocks(path, key)
    picture = json.loads(dcptool("inspect", path, "--layout", key, "--json").stdout)
    assert {(tuple(b["offsets"]), tuple(b["sizes"])): int(b["label"]) for b in picture["blocks"]} == expected
    grid = picture["grid"]
    assert not grid["sampled"]
    for i, (r0, r1) in enumerate(grid["rows"]):
        for j, (c0, c1) in enumerate(grid["columns"]):
            point = (r0, c0) if len(picture["shape"]) == 2 else (c0,)
            rank = next(rank for (offsets, sizes), rank in expected.items()
                        if all(o <= p < o + s for p, o, s in zip(point, offsets, sizes)))
            assert grid["cells"][i][j] == str(rank), (key, i, j)
    # Every block has cells of its own, and the text grid is the same grid.
    assert {cell for row in grid["cells"] for cell in row} == {str(r) for r in expected.values()}
    svg = tmp_path / "layout.svg"
    text = dcptool("inspect", path, "--layout", key, "--svg", svg).stdout
    assert grid_cells(text) == grid["cells"]
    assert "saved on 4 ranks: dp=2 x tp=2" in text.splitlines()[0]
    titles = [e.findtext("{http://www.w3.org/2000/svg}title")
              for e in ElementTree.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}rect")]
    assert sorted(t.split()[0] for t in titles if t) == sorted(str(r) for r in expected.values())
    # Planned for the mesh it was saved on, reshard's layout has the saved blocks, each held by the rank
    # that saved it; a block replicated on tp is held by both tp ranks, and either may store it.
    planned = json.loads(dcptool("inspect", path, "--layout", key, "--mesh", "dp=2,tp=2", "--json").stdout)
    holders = {(tuple(b["offsets"]), tuple(b["sizes"])): b["holders"] for b in planned["blocks"]}
    assert holders.keys() == expected.keys() and all(expected[block] in holders[block] for block in expected)
    assert all(int(b["label"]) in b["holders"] for b in planned["blocks"])
    assert sorted(map(len, holders.values())) == ([2, 2] if name == "norm" else [1, 1, 1, 1])


def test_layout_of_a_format_without_ranks_names_the_files(planted, tmp_path):
    path, _ = planted
    hf = tmp_path / "hf"
    dcptool("convert", path, hf, "--to", "hf", "--max-shard-size", "1KB")  # several safetensors files
    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    key = next(k for k in weight_map if k.endswith("output.weight"))
    text = dcptool("inspect", hf, "--layout", key).stdout.splitlines()
    assert "1 block, saved in 1 data file" in text[0] and "each cell shows the data file holding it" in text[1]
    assert text[-1].split() == ["A", "[0:10,", "0:8]", "file", weight_map[key]]
