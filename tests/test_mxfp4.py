"""--dequantize of MXFP4 experts, as GPT-OSS's release stores them (``X_blocks`` + ``X_scales``).

Oracles: transformers' own dequantization, ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``
and its ``convert_moe_packed_tensors``, bitwise; the released layout made by a quantizer written here from the
OCP MX specification (v1.0, section 6.3: a block's scale is 2 ** (floor(log2(amax)) - 2), its elements rounded to
the nearest E2M1 value, ties to even) apart from dcptool's code; torch's dcp_to_torch_save and safetensors reading
the outputs back, and transformers' logits of the export.
"""

import doctest
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import dcptool, oracle, read_dcp

transformers = oracle("transformers")
convert_moe_packed_tensors = oracle("transformers.integrations.mxfp4").convert_moe_packed_tensors

# The E2M1 magnitudes, code 0 to 7 (OCP MX v1.0, table 5); bit 3 is the sign.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# What GPT-OSS's release keeps unquantized (its config.json's quantization_config).
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 expert tensor ``[experts, in, out]`` as GPT-OSS's release stores it: per expert the ``[out, in]``
    matrix in blocks of 32 along ``in``, two codes a byte (the first in the low nibble) and a uint8 E8M0 scale
    a block (2 ** (byte - 127))."""
    rows = weight.transpose(1, 2).float()
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, -127).clamp(-127, 127)  # 6 = 1.5 * 2**2
    scaled = groups / torch.exp2(exponent)[..., None]
    distance = (scaled.abs().clamp(max=6.0)[..., None] - E2M1).abs()
    nearest = distance == distance.amin(-1, keepdim=True)
    codes = torch.arange(8)
    even = torch.where(nearest & (codes % 2 == 0), codes, 8).amin(-1)  # a tie: the code whose last bit is 0
    code = torch.where(even < 8, even, torch.where(nearest, codes, 8).amin(-1))
    code = (code | torch.where((scaled < 0) & (code > 0), 8, 0)).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny random GPT-OSS saved by transformers in bf16, the same model as its release lays it out (MXFP4
    experts), and transformers' own dequantization of that release: (release folder, reference model)."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8)
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(folder / "bf16")
    release = folder / "release"
    shutil.copytree(folder / "bf16", release)
    state = {}
    for key, tensor in load_file(folder / "bf16" / "model.safetensors").items():
        if key.endswith(EXPERTS):
            state[key + "_blocks"], state[key + "_scales"] = quantize(tensor * 16)  # larger: more scales than one
        else:
            state[key] = tensor
    save_file(state, release / "model.safetensors")
    saved = json.loads((release / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (release / "config.json").write_text(json.dumps(saved))
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        release, quantization_config=transformers.Mxfp4Config(dequantize=True))
    assert "quantization_config" not in reference.config.to_dict()  # what a dequantized export's config lacks too
    return release, reference


def reference_state(model) -> dict:
    return {key: value.detach() for key, value in model.state_dict().items()}


def assert_bitwise(read: dict, expected: dict) -> None:
    assert set(read) == set(expected)
    for key, tensor in expected.items():
        assert read[key].dtype == tensor.dtype and read[key].shape == tensor.shape, key
        assert torch.equal(read[key].view(torch.int16), tensor.view(torch.int16)), key


def test_import_hf_dequantize_to_dcp_bitwise_as_transformers(gpt_oss, tmp_path):
    release, reference = gpt_oss
    result = dcptool("import-hf", release, tmp_path / "dcp", "--dequantize", "--dp", "2", "--max-memory", "64KiB")
    assert "dequantized 4 MXFP4 tensors to bfloat16" in result.stderr
    assert "left out 4 _blocks and 4 _scales tensors" in result.stderr
    read = read_dcp(tmp_path / "dcp", tmp_path)
    assert_bitwise(read, reference_state(reference))
    gate_up = read["model.layers.0.mlp.experts.gate_up_proj"]
    assert list(gate_up.shape) == [4, 64, 2 * 96]  # [experts, hidden, 2 * intermediate], as the bf16 model's


def test_export_hf_of_the_import_loads_with_the_reference_logits(gpt_oss, tmp_path):
    release, reference = gpt_oss
    dcptool("import-hf", release, tmp_path / "dcp", "--dequantize", "--dp", "2")
    result = dcptool("export-hf", tmp_path / "dcp", tmp_path / "hf", "--config-dir", release)
    assert "left out the config's quantization_config (mxfp4)" in result.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert_bitwise(reference_state(exported), reference_state(reference))
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, reference(tokens).logits)


def test_export_hf_dequantize_of_the_release(gpt_oss, tmp_path):
    """Straight from the release: the quantization_config dropped by --dequantize."""
    release, reference = gpt_oss
    dcptool("export-hf", release, tmp_path / "hf", "--dequantize", "--config-dir", release)
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert_bitwise(load_file(tmp_path / "hf" / "model.safetensors"), reference_state(reference))


def test_dequantize_from_a_dcp_of_the_release(gpt_oss, tmp_path):
    """The release imported as stored (uint8 blocks and scales sharded over two ranks' files, records checked as
    they are read), then dequantized on the way out."""
    release, reference = gpt_oss
    dcptool("import-hf", release, tmp_path / "dcp", "--dp", "2")
    assert read_dcp(tmp_path / "dcp", tmp_path)["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    dcptool("export-hf", tmp_path / "dcp", tmp_path / "hf", "--dequantize", "--config-dir", release,
            "--max-memory", "64KiB")
    assert_bitwise(load_file(tmp_path / "hf" / "model.safetensors"), reference_state(reference))


@pytest.fixture(scope="module")
def every_code(tmp_path_factory):
    """Expert tensors whose blocks hold every byte with every scale byte (0 to 255: the smallest scale, the
    largest, and 255, NaN in the specification, which transformers takes as 2 ** 128), and random ones of
    shapes that are not powers of two."""
    folder = tmp_path_factory.mktemp("every-code")
    generator = torch.Generator().manual_seed(1)
    every = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(2, 256, 16, 16).contiguous()
    state = {"model.layers.0.mlp.experts.gate_up_proj_blocks": every,
             "model.layers.0.mlp.experts.gate_up_proj_scales":
                 torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(2, 256, 16).contiguous(),
             "model.layers.0.mlp.experts.down_proj_blocks":
                 torch.randint(0, 256, (3, 40, 5, 16), dtype=torch.uint8, generator=generator),
             "model.layers.0.mlp.experts.down_proj_scales":
                 torch.randint(100, 140, (3, 40, 5), dtype=torch.uint8, generator=generator),
             "model.norm.weight": torch.ones(8, dtype=torch.bfloat16)}
    save_file(state, folder / "model.safetensors")
    return folder, state


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_code_and_scale_as_transformers_in_each_dtype(every_code, dtype, tmp_path):
    folder, state = every_code
    dcptool("convert", folder, tmp_path / "out", "--to", "hf", "--dequantize", "--dtype", dtype,
            "--max-memory", "64KiB")
    read = load_file(tmp_path / "out" / "model.safetensors")
    assert set(read) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj",
                         "model.norm.weight"}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        expected = convert_moe_packed_tensors(state[name + "_blocks"], state[name + "_scales"],
                                              dtype=getattr(torch, dtype))
        bits = torch.int32 if dtype == "float32" else torch.int16
        assert read[name].shape == expected.shape and torch.equal(read[name].view(bits), expected.view(bits)), name


def test_regions_at_any_offset(every_code):
    """Regions that start and end inside a byte's pair and a block, of a few experts and rows: what slabs,
    expert-parallel shards and tensor-parallel shards read."""
    from dcptool.formats import open_checkpoint
    from dcptool.planning import quant

    folder, state = every_code
    checkpoint, _ = quant.dequantized(open_checkpoint(folder), None, "bfloat16")
    tensor = checkpoint.tensors["model.layers.0.mlp.experts.down_proj"]
    expected = convert_moe_packed_tensors(state["model.layers.0.mlp.experts.down_proj_blocks"],
                                          state["model.layers.0.mlp.experts.down_proj_scales"]).view(torch.int16)
    assert tensor.shape == tuple(expected.shape) == (3, 160, 40)
    scratch = memoryview(bytearray(1 << 16))
    for offsets, sizes in [((0, 0, 0), (3, 160, 40)), ((1, 31, 7), (2, 3, 1)), ((2, 33, 0), (1, 64, 40)),
                           ((0, 17, 39), (3, 1, 1)), ((1, 0, 5), (1, 159, 30)), ((0, 63, 2), (2, 66, 11))]:
        out = np.empty(sizes, np.uint16)
        checkpoint.read_region(tensor, offsets, sizes, out, scratch)
        window = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert np.array_equal(out.view(np.int16), expected[window].numpy()), (offsets, sizes)


def test_blocks_without_scales_or_of_another_shape_are_refused(every_code, tmp_path):
    _, state = every_code
    for case, change in [("no-scales", lambda s: s.pop("model.layers.0.mlp.experts.down_proj_scales")),
                         ("shape", lambda s: s.update({"model.layers.0.mlp.experts.down_proj_scales":
                                                       torch.zeros(3, 40, 4, dtype=torch.uint8)}))]:
        broken = dict(state)
        change(broken)
        (tmp_path / case).mkdir()
        save_file(broken, tmp_path / case / "model.safetensors")
        result = dcptool("import-hf", tmp_path / case, tmp_path / f"{case}-dcp", "--dequantize", check=False)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert "model.safetensors" in lines[0] and "model.layers.0.mlp.experts.down_proj_blocks" in lines[0]
        assert not (tmp_path / f"{case}-dcp").exists()


def test_codec_doctests_run():
    from dcptool import mxfp4

    result = doctest.testmod(mxfp4)
    assert result.attempted and not result.failed
