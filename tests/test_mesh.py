"""dcptool's chunk arithmetic against torch's own (compute_local_shape_and_global_offset), no process group."""

import itertools
import random

import numpy as np
import pytest
from safetensors.numpy import save_file
from torch.distributed.tensor import Replicate, Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from conftest import dcptool
from dcptool.errors import UsageError
from dcptool.mesh import Axis, Mesh, NotRectangular, Shard, Strided, fsdp_placement, local_chunk, parse_mesh


def torch_placement(placement):
    if placement is None:
        return Replicate()
    if isinstance(placement, Strided):
        return _StridedShard(placement.dim, split_factor=placement.split_factor)
    return TorchShard(placement.dim)


def random_spec(rng, ndim):
    """FSDP over TP/EP axes the way FSDP2 composes them: model-parallel axes, then the FSDP axis in front."""
    parallel = tuple(Axis(f"mp{i}", rng.choice([1, 2, 3, 4]), rng.choice([None, Shard(rng.randrange(ndim))]))
                     for i in range(rng.randrange(3)))
    fsdp = Axis("fsdp", rng.choice([1, 2, 3, 4, 8]), fsdp_placement(rng.randrange(ndim), parallel))
    return (fsdp,) + parallel


def test_chunks_match_torch_for_random_shapes_and_meshes():
    rng = random.Random(7)
    checked = 0
    for _ in range(400):
        ndim = rng.choice([1, 2, 3])
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 8, 12, 250]) for _ in range(ndim))
        spec = random_spec(rng, ndim)
        placements = [torch_placement(a.placement) for a in spec]
        for coords in itertools.product(*(range(a.size) for a in spec)):
            named = {a.name: c for a, c in zip(spec, coords)}
            want_sizes, want_offsets = _compute_local_shape_and_global_offset(
                shape, [a.size for a in spec], list(coords), placements)
            try:
                got = local_chunk(shape, spec, named)
            except NotRectangular:
                continue  # torch records only the first index; dcptool refuses such layouts
            assert got == (tuple(want_offsets), tuple(want_sizes)), (shape, spec, coords)
            checked += 1
    assert checked > 2000


def test_empty_shards_sit_at_the_end_of_the_dim():
    spec = (Axis("fsdp", 4, Shard(0)),)
    chunks = [local_chunk((2, 3), spec, {"fsdp": r}) for r in range(4)]
    assert chunks == [((0, 0), (1, 3)), ((1, 0), (1, 3)), ((2, 0), (0, 3)), ((2, 0), (0, 3))]


def test_mesh_rules():
    assert Mesh(dp=4, tp=2, ep=2, etp=1).efsdp == 4
    assert Mesh(dp=4, tp=2, ep=2, etp=2).efsdp == 2
    assert Mesh(dp=4, tp=2, ep=2, etp=2).describe() == "8 ranks: dp=4 x tp=2; experts ep=2 (etp=2)"
    with pytest.raises(UsageError, match="etp=3"):
        Mesh(dp=2, tp=2, etp=3).check()
    with pytest.raises(UsageError, match="ep=4 with etp=2"):
        Mesh(dp=2, tp=2, ep=4, etp=2).check()
    Mesh(dp=2, tp=2, ep=4, etp=1).check()


def test_mesh_text_refusals_name_the_option_it_came_with(tmp_path):
    """One parser for --load-on and inspect --mesh; its refusal names the flag the text was given with
    (in the API, the keyword argument)."""
    assert parse_mesh("dp=2, tp=4,ep=2,etp=tp", "load_on") == {"dp": 2, "tp": 4, "ep": 2, "etp": 4}
    save_file({"w": np.zeros((4, 4), np.float32)}, tmp_path / "model.safetensors")
    names = "give sizes as name=N with names dp, tp, ep, etp, cp, dp_replicate"
    for command, flag, keyword in ([("inspect", tmp_path, "--layout", "w"), "--mesh", "mesh"],
                                   [("verify", tmp_path), "--load-on", "load_on"]):
        result = dcptool(*command, flag, "dp=2,pp=2", check=False)
        assert result.returncode == 2, result.stderr
        assert result.stderr.splitlines()[-1] == f"dcptool: error: {flag} dp=2,pp=2: {names}"
        with pytest.raises(UsageError, match=f"^{keyword}='dp=2,pp=2': {names}$"):
            parse_mesh("dp=2,pp=2", keyword)
