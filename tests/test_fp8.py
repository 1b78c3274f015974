"""float8 in every format, and --dequantize of block-scaled FP8 weights (DeepSeek-V3 / Qwen3 FP8 layout).

Oracles: torch's own float8 dtypes and its dequantization ``(w.float() * scale per block).to(dtype)``,
read back with torch.load, safetensors and torch's dcp_to_torch_save.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import dcptool, read_dcp

FLOAT8 = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
BLOCK = 128
# (rows, cols): multiples of the block and not, so edge blocks are partial
SHAPES = {"model.layers.0.mlp.down_proj.weight": (200, 300), "model.layers.0.self_attn.q_proj.weight": (128, 64),
          "model.layers.0.mlp.up_proj.weight": (257, 129)}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.view(torch.int16)


def test_float8_dtypes_round_trip_through_every_format(tmp_path):
    torch.manual_seed(0)
    source = {name: (torch.randn(6, 5) * 4).to(getattr(torch, name)) for name in FLOAT8}
    torch.save(source, tmp_path / "in.pt")
    dcptool("convert", tmp_path / "in.pt", tmp_path / "dcp", "--to", "dcp")
    dcptool("convert", tmp_path / "dcp", tmp_path / "hf", "--to", "hf")
    dcptool("convert", tmp_path / "hf", tmp_path / "out.pt", "--to", "torch")
    from_dcp = read_dcp(tmp_path / "dcp", tmp_path)
    from_torch = torch.load(tmp_path / "out.pt", weights_only=True, mmap=True)
    # safetensors (0.8) has no float8_e8m0fnu yet; dcptool's hf output is read back through out.pt
    from_hf = load_file(tmp_path / "hf" / "model.safetensors")
    for name, tensor in source.items():
        for read in (from_dcp, from_torch) + ((from_hf,) if name != "float8_e8m0fnu" else ()):
            assert read[name].dtype == tensor.dtype and torch.equal(bits(read[name]), bits(tensor)), name


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny DeepSeek-V3-shaped FP8 folder: float8_e4m3fn weights, float32 weight_scale_inv per 128x128 block."""
    folder = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    state, reference = {}, {}
    for key, (rows, cols) in SHAPES.items():
        weight = (torch.randn(rows, cols) * 3).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-rows // BLOCK), -(-cols // BLOCK)) * 0.01 + 1e-3
        state[key], state[key + "_scale_inv"] = weight, scale
        wide = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
        reference[key] = weight.float() * wide
    state["model.norm.weight"] = reference["model.norm.weight"] = torch.randn(64).to(torch.bfloat16)
    save_file(state, folder / "model.safetensors")
    config = {"model_type": "fp8_test", "architectures": ["Fp8Test"], "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, reference


def check(read: dict, reference: dict, dtype: torch.dtype, cast_all: bool = False) -> None:
    """Dequantized weights (float32 references) are in ``dtype``; the others too with ``cast_all`` (--dtype)."""
    assert not [k for k in read if k.endswith("_scale_inv")]
    assert set(read) == set(reference)
    for key, expected in reference.items():
        expected = expected.to(dtype) if expected.dtype == torch.float32 or cast_all else expected
        assert read[key].dtype == expected.dtype and torch.equal(bits(read[key]), bits(expected)), key


def test_convert_dequantize_streams_and_matches_torch(fp8_model, tmp_path):
    folder, reference = fp8_model
    result = dcptool("convert", folder, tmp_path / "out", "--to", "hf", "--dequantize", "--max-memory", "64KiB")
    assert "left out 3 _scale_inv scales" in result.stderr
    check(load_file(tmp_path / "out" / "model.safetensors"), reference, torch.bfloat16)


def test_export_hf_dequantize_drops_quantization_config(fp8_model, tmp_path):
    folder, reference = fp8_model
    dcptool("export-hf", folder, tmp_path / "out", "--dequantize", "--dtype", "float32", "--config-dir", folder)
    check(load_file(tmp_path / "out" / "model.safetensors"), reference, torch.float32, cast_all=True)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "fp8_test"


def test_import_hf_dequantize_to_sharded_dcp(fp8_model, tmp_path):
    folder, reference = fp8_model
    dcptool("import-hf", folder, tmp_path / "dcp", "--dequantize", "--dp", "2")
    check(read_dcp(tmp_path / "dcp", tmp_path), reference, torch.bfloat16)


def test_reshard_dequantize_to_sharded_dcp(fp8_model, tmp_path):
    folder, reference = fp8_model
    dcptool("reshard", folder, tmp_path / "dcp", "--dequantize", "--dtype", "float32", "--dp", "2")
    check(read_dcp(tmp_path / "dcp", tmp_path), reference, torch.float32, cast_all=True)


def test_dequantize_without_block_size_is_refused(fp8_model, tmp_path):
    folder, _ = fp8_model
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"model_type": "fp8_test"}))
    result = dcptool("convert", folder, tmp_path / "out", "--to", "hf", "--dequantize", "--config-dir", config_dir,
                     check=False)
    assert result.returncode == 2 and "weight_block_size" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", FLOAT8[:4])
def test_one_float8_decoder_matches_torch(name):
    """dtypes.float8_to_float32, which dequantize, inspect --stats and checksum --scan-nonfinite share,
    against torch's ``.float()`` on every bit pattern: the same float32 bits (NaN: its sign, not its payload)."""
    import numpy as np

    from dcptool.checks.checksums import count_nonfinite
    from dcptool.dtypes import float8_to_float32
    from dcptool.checks.stats import widen

    patterns = np.arange(256, dtype=np.uint8)
    expected = torch.from_numpy(patterns.copy()).view(getattr(torch, name)).float().numpy()
    got = float8_to_float32(patterns, name)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan) and np.array_equal(np.signbit(got), np.signbit(expected))
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))
    assert np.array_equal(widen(patterns, name), got, equal_nan=True)
    many = np.random.default_rng(0).integers(0, 256, size=300_001, dtype=np.uint8)
    values = torch.from_numpy(many).view(getattr(torch, name)).float()
    assert count_nonfinite(many, name) == (int(values.isnan().sum()), int(values.isinf().sum()))
