"""LoRA (peft) checkpoints: a peft-wrapped Llama trained with FSDP2 on 2 gloo ranks (harness.lora_jobs), then
merged (against peft's own merge_and_unload), exported as a PEFT adapter (loaded by PeftModel.from_pretrained),
carried by reshard and convert, and laid out again by import-hf --lora-adapter (loaded by a resumed FSDP2 job)."""

import json
import shutil

import pytest
import torch
from conftest import dcptool
from jobs import LORA_JOBS, run_job
from safetensors.torch import load_file

VARIANTS = ["lora", "rslora_tied", "dora", "qwen3_moe"]  # (harness.lora_jobs.VARIANTS)


def refused(*args, names: list[str], output):
    """exit 2, one line naming each of ``names``, no traceback, nothing written."""
    result = dcptool(*args, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for name in names:
        assert name in lines[0], lines[0]
    assert not output.exists()
    return lines[0]


def peft_model(reference, adapter=None):
    """The peft model of a LoRA run, rebuilt by peft itself: the reference's base weights with the adapter folder
    ``adapter`` (default: the one peft saved of the trained model)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(reference / "base")
    return peft.PeftModel.from_pretrained(base, adapter or reference / "adapter")


def assert_merged_as(folder, expected: dict) -> None:
    """The merged export in ``folder`` holds ``expected`` (peft's merge), within float32 rounding."""
    merged = load_file(folder / "model.safetensors")
    assert set(merged) == set(expected)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7, msg=key)


def lora_layers(reference) -> set[str]:
    """The modules peft gave LoRA layers, by their names in the peft model's state dict (the run's peft.pt)."""
    state = torch.load(reference / "peft.pt", weights_only=True)
    return {key.split(".lora_")[0] for key in state if ".lora_" in key}


def logits_of(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_matches_peft(lora_runs, variant, tmp_path):
    import transformers

    checkpoint, reference = lora_runs / variant, lora_runs / f"{variant}.reference"
    out = tmp_path / "merged"
    result = dcptool("export-hf", checkpoint, out, "--lora", "merge", "--config-dir", checkpoint / "huggingface")
    assert "merged" in result.stderr and "adapter_config.json" in result.stderr
    peft_merged = torch.load(reference / "merged.pt", weights_only=True)
    exported = load_file(out / "model.safetensors")
    tied = json.loads((checkpoint / "huggingface" / "config.json").read_text())["tie_word_embeddings"]
    assert set(exported) == set(peft_merged) - ({"lm_head.weight"} if tied else set())
    base = load_file(reference / "base" / "model.safetensors")
    changed = [k for k in exported if k in base and not torch.equal(exported[k], base[k])]
    assert any("q_proj" in k for k in changed)  # the adapters were merged, not the base copied
    if variant == "qwen3_moe":  # transformers v5's fused experts, each expert's delta merged
        assert "model.layers.1.mlp.experts.gate_up_proj" in exported
    for key, tensor in exported.items():  # float32 rounding of peft's own merge
        torch.testing.assert_close(tensor, peft_merged[key], rtol=1e-6, atol=1e-7, msg=key)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.load(reference / "inputs.pt", weights_only=True)
    if tied:  # the head is the merged embedding, as in peft's merged model (no longer the peft model's)
        assert "the head changes too" in result.stderr
        torch.testing.assert_close(model.lm_head.weight.detach(), peft_merged["lm_head.weight"], rtol=1e-6, atol=1e-7)
        assert not torch.equal(model.lm_head.weight.detach(), base["model.embed_tokens.weight"])
    else:
        torch.testing.assert_close(logits_of(model, ids), torch.load(reference / "logits.pt", weights_only=True),
                                   rtol=1e-5, atol=1e-5)


def test_merge_rounds_to_dtype_as_torch(lora_runs, tmp_path):
    checkpoint = lora_runs / "lora"
    dcptool("export-hf", checkpoint, tmp_path / "f32", "--lora", "merge")
    dcptool("export-hf", checkpoint, tmp_path / "bf16", "--lora", "merge", "--dtype", "bfloat16", "--max-memory", "1MiB")
    f32, bf16 = load_file(tmp_path / "f32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    for key, tensor in f32.items():
        assert torch.equal(bf16[key], tensor.to(torch.bfloat16)), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapter_loads_in_peft(lora_runs, variant, tmp_path):
    import peft
    import transformers

    checkpoint, reference = lora_runs / variant, lora_runs / f"{variant}.reference"
    out = tmp_path / "adapter"
    dcptool("export-hf", checkpoint, out, "--lora", "adapter")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    ours, theirs = load_file(out / "adapter_model.safetensors"), load_file(reference / "adapter" / "adapter_model.safetensors")
    # peft's own save adds the targeted embedding's base weight; every tensor of ours is one of its, bitwise
    assert set(theirs) - set(ours) <= {"base_model.model.model.embed_tokens.base_layer.weight"}
    assert set(ours) <= set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((out / "adapter_config.json").read_text())
    expected = json.loads((reference / "adapter" / "adapter_config.json").read_text())
    for field in ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "modules_to_save"):
        assert config[field] == expected[field], field
    assert sorted(config["target_modules"]) == sorted(expected["target_modules"])
    ids = torch.load(reference / "inputs.pt", weights_only=True)

    def loaded(folder):
        base = transformers.AutoModelForCausalLM.from_pretrained(reference / "base")
        return logits_of(peft.PeftModel.from_pretrained(base, folder), ids)

    ours = loaded(out)
    assert torch.equal(ours, loaded(reference / "adapter"))  # as peft's own save_pretrained folder loads
    trained = torch.load(reference / "logits.pt", weights_only=True)
    if variant == "qwen3_moe":  # the peft model built in the job runs its experts' LoRA in another order
        torch.testing.assert_close(ours, trained, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(ours, trained)


def test_merge_from_any_format(lora_runs, tmp_path):
    """The same merge from the checkpoint converted to verl's FSDP1 files and to one torch.save file."""
    checkpoint = lora_runs / "dora"
    dcptool("export-hf", checkpoint, tmp_path / "from-dcp", "--lora", "merge", "--lora-alpha", "8")
    expected = load_file(tmp_path / "from-dcp" / "model.safetensors")
    for name, options in (("fsdp1", ["--to", "fsdp1", "--world-size", "2"]), ("whole.pt", ["--to", "torch"])):
        dcptool("convert", checkpoint, tmp_path / name, *options)
        assert "LoRA (DoRA): adapter default" in dcptool("inspect", tmp_path / name).stdout
        dcptool("export-hf", tmp_path / name, tmp_path / f"{name}-merged", "--lora", "merge", "--lora-alpha", "8")
        got = load_file(tmp_path / f"{name}-merged" / "model.safetensors")
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected), name


def test_verl_fsdp1_files(lora_runs, tmp_path):
    """verl's FSDP1 files of a LoRA run: merged as peft merges them; the optimizer, built over the trainable
    parameters only (peft froze the rest), keyed by their positions among those, read under their names."""
    checkpoint, reference = lora_runs / "lora-fsdp1", lora_runs / "lora-fsdp1.reference"
    dcptool("export-hf", checkpoint, tmp_path / "merged", "--lora", "merge")  # config and adapter_config: huggingface/
    merged, expected = load_file(tmp_path / "merged" / "model.safetensors"), torch.load(reference / "merged.pt")
    assert set(merged) == set(expected)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7, msg=key)
    found = json.loads(dcptool("inspect", checkpoint, "--json").stdout)
    assert found["info"]["optimizer_form"] == "orig" and not found["info"].get("not_read")
    dcptool("convert", checkpoint, tmp_path / "whole.pt", "--to", "torch")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)["optimizer"]["state"]
    full = torch.load(reference / "optim.pt", weights_only=True)["state"]
    assert set(whole) == set(full) and all("lora_" in name or "modules_to_save" in name for name in full)
    for name, moments in full.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(whole[name][moment], moments[moment]), (name, moment)


def test_inspect_shows_adapters(lora_runs):
    found = json.loads(dcptool("inspect", lora_runs / "lora", "--json").stdout)
    lora = found["lora"]
    settings = json.loads((lora_runs / "lora.reference" / "adapter" / "adapter_config.json").read_text())
    assert lora["adapters"] == ["default"] and lora["alpha"] == settings["lora_alpha"]
    assert lora["modules_to_save"] == settings["modules_to_save"]
    prefix = "base_model.model."
    assert set(lora["ranks"]) == {name.removeprefix(prefix) for name in lora_layers(lora_runs / "lora.reference")}
    assert set(lora["ranks"].values()) == {settings["r"]}
    assert found["names"] == {"family": "hf", "kind": "llama"}
    text = dcptool("inspect", lora_runs / "dora").stdout
    dora = lora_runs / "dora.reference"
    settings = json.loads((dora / "adapter" / "adapter_config.json").read_text())
    modules = f"{len(lora_layers(dora))} modules ({', '.join(sorted(settings['target_modules']))})"
    assert f"LoRA (DoRA): adapter default, rank {settings['r']} on {modules}" in text


def test_refusals(lora_runs, tmp_path):
    checkpoint = lora_runs / "lora"
    out = tmp_path / "out"
    refused("export-hf", checkpoint, out, names=["LoRA", "--lora merge", "--lora adapter"], output=out)
    refused("export-hf", checkpoint, out, "--lora-alpha", "16", names=["--lora"], output=out)
    # no adapter_config.json beside it: alpha unknown until given
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("huggingface"))
    refused("export-hf", bare, out, "--lora", "merge", names=["lora_alpha", "--lora-config", "--lora-alpha"], output=out)
    refused("export-hf", bare, out, "--lora", "merge", "--lora-config", tmp_path / "none.json",
            names=["none.json", "--lora-config"], output=out)
    dcptool("export-hf", bare, tmp_path / "alpha", "--lora", "merge", "--lora-alpha", "16")
    dcptool("export-hf", bare, tmp_path / "config", "--lora", "merge", "--lora-config",
            checkpoint / "huggingface" / "adapter_config.json")
    dcptool("export-hf", checkpoint, tmp_path / "beside", "--lora", "merge")
    beside = load_file(tmp_path / "beside" / "model.safetensors")
    for name in ("alpha", "config"):
        got = load_file(tmp_path / name / "model.safetensors")
        assert all(torch.equal(got[k], beside[k]) for k in beside), name
    # --lora-alpha 8 merges as peft merges the same adapter whose config says lora_alpha 8
    halved = tmp_path / "halved"
    dcptool("export-hf", bare, halved, "--lora", "merge", "--lora-alpha", "8")
    reference = lora_runs / "lora.reference"
    shutil.copytree(reference / "adapter", tmp_path / "alpha-8")
    adapter_config = json.loads((tmp_path / "alpha-8" / "adapter_config.json").read_text())
    assert adapter_config["lora_alpha"] != 8
    (tmp_path / "alpha-8" / "adapter_config.json").write_text(json.dumps({**adapter_config, "lora_alpha": 8}))
    expected = peft_model(reference, tmp_path / "alpha-8").merge_and_unload().state_dict()
    assert_merged_as(halved, expected)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(expected[key], beside[key])


def test_reshard_convert_and_import_resume(lora_runs, tmp_path):
    """reshard and convert carry the LoRA weights and their AdamW state; import-hf --lora-adapter lays out base and
    adapter as the peft model's state dict: a real FSDP2 job of the peft model loads each. Their outputs keep the
    model's config and the adapter's adapter_config.json, so that a merge of them needs no --lora-alpha."""
    checkpoint, reference = lora_runs / "lora", lora_runs / "lora.reference"
    dcptool("reshard", checkpoint, tmp_path / "dp1", "--dp", "1")
    assert "equal" in dcptool("verify", checkpoint, tmp_path / "dp1").stdout
    for name in ("config.json", "adapter_config.json"):
        assert (tmp_path / "dp1" / name).read_bytes() == (checkpoint / "huggingface" / name).read_bytes()
    for source, merged in ((checkpoint, "merged"), (tmp_path / "dp1", "dp1-merged")):
        dcptool("export-hf", source, tmp_path / merged, "--lora", "merge")
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == \
        (tmp_path / "dp1-merged" / "model.safetensors").read_bytes()
    dcptool("convert", checkpoint, tmp_path / "whole.pt", "--to", "torch")
    dcptool("verify", checkpoint, tmp_path / "whole.pt")
    dcptool("export-hf", checkpoint, tmp_path / "adapter", "--lora", "adapter")
    result = dcptool("import-hf", reference / "base", tmp_path / "resume", "--dp", "2",
                     "--lora-adapter", tmp_path / "adapter")
    assert f"{len(lora_layers(reference))} LoRA layers, modules_to_save lm_head" in result.stderr
    assert (tmp_path / "resume" / "adapter_config.json").read_bytes() == \
        (tmp_path / "adapter" / "adapter_config.json").read_bytes()
    assert (tmp_path / "resume" / "config.json").read_bytes() == (reference / "base" / "config.json").read_bytes()
    # Qwen3-MoE: the HF folder holds one tensor per expert, the peft model transformers v5's fused ones
    moe = lora_runs / "qwen3_moe.reference"
    dcptool("import-hf", moe / "base", tmp_path / "resume-moe", "--dp", "2", "--lora-adapter", moe / "adapter")
    job = run_job(2, "load-lora", "--ckpt", tmp_path / "dp1", "lora", reference, "1",
                  "--ckpt", tmp_path / "resume", "lora", reference, "0",
                  "--ckpt", tmp_path / "resume-moe", "qwen3_moe", moe, "0", module=LORA_JOBS)
    assert job.stdout.count("loaded, equal to the reference") == 3, job.stdout[-3000:]


def test_archon_names_under_peft(lora_runs, tmp_path):
    """peft wrapping a torchtitan / Archon model: its names (q/k rows RoPE-interleaved, so lora_B's rows too),
    made from the job's state with the tests' independent oracle (harness.family_models), merge to the same HF
    weights and export the same adapter."""
    from harness.family_models import hf_to_family

    reference, config = lora_runs / "lora.reference", lora_runs / "lora" / "huggingface"
    hf_config = json.loads((config / "config.json").read_text())
    peft_state = torch.load(reference / "peft.pt", weights_only=True)
    prefix = "base_model.model."

    def archon(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        [(new, value)] = hf_to_family({name: tensor}, "llama", "archon", hf_config).items()
        return new, value

    state = {}
    for key, tensor in peft_state.items():
        name = key.removeprefix(prefix)
        for part in (".base_layer.", ".original_module.", ".modules_to_save.default."):
            if part in name:
                module, leaf = name.split(part)
                new, value = archon(f"{module}.{leaf}", tensor)
                state[prefix + new.replace(f".{leaf}", f"{part}{leaf}")] = value
                break
        else:
            if ".lora_" not in name:
                new, value = archon(name, tensor)
                state[prefix + new] = value
                continue
            module, part = name.split(".lora_")
            new, value = archon(f"{module}.weight", tensor)  # lora_B's rows follow the weight's
            state[prefix + new.removesuffix(".weight") + ".lora_" + part] = value if part.split(".")[0].endswith("B") else tensor
    assert f"{prefix}layers.0.attention.wq.lora_B.default.weight" in state
    (tmp_path / "titan").mkdir()
    torch.save({"model": state}, tmp_path / "titan" / "model.pt")
    shutil.copy(config / "adapter_config.json", tmp_path / "titan")
    result = dcptool("export-hf", tmp_path / "titan" / "model.pt", tmp_path / "merged", "--lora", "merge",
                     "--config-dir", config)
    assert "archon (llama)" in result.stderr
    merged, expected = load_file(tmp_path / "merged" / "model.safetensors"), torch.load(reference / "merged.pt")
    assert set(merged) == set(expected)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7, msg=key)
    dcptool("export-hf", tmp_path / "titan" / "model.pt", tmp_path / "adapter", "--lora", "adapter",
            "--config-dir", config)
    ours, theirs = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), load_file(reference / "adapter" / "adapter_model.safetensors")
    assert set(ours) <= set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_refusals_of_what_cannot_merge(lora_runs, tmp_path):
    """LoRA on a head the config ties to the embedding, and DoRA next to another adapter: one line each."""
    state = torch.load(lora_runs / "rslora_tied.reference" / "peft.pt", weights_only=True)
    head = "base_model.model.lm_head"
    state[f"{head}.base_layer.weight"] = state.pop(f"{head}.weight")
    state[f"{head}.lora_A.default.weight"], state[f"{head}.lora_B.default.weight"] = torch.ones(8, 32), torch.ones(128, 8)
    torch.save({"model": state}, tmp_path / "tied.pt")
    config = lora_runs / "rslora_tied" / "huggingface"
    out = tmp_path / "out"
    refused("export-hf", tmp_path / "tied.pt", out, "--lora", "merge", "--config-dir", config, "--lora-config",
            config / "adapter_config.json", names=["lm_head.weight", "ties", "tie_word_embeddings"], output=out)
    dora = torch.load(lora_runs / "dora.reference" / "peft.pt", weights_only=True)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    dora[f"{q}.lora_A.second.weight"] = dora[f"{q}.lora_A.default.weight"]
    dora[f"{q}.lora_B.second.weight"] = dora[f"{q}.lora_B.default.weight"]
    torch.save({"model": dora}, tmp_path / "dora.pt")
    refused("export-hf", tmp_path / "dora.pt", out, "--lora", "merge", "--lora-alpha", "8",
            names=["DoRA", "q_proj", "one adapter at a time"], output=out)
    refused("export-hf", tmp_path / "dora.pt", out, "--lora", "adapter", "--lora-alpha", "8",
            names=["2 (default, second)", "--lora merge"], output=out)


def test_every_adapter_merged(lora_runs, tmp_path):
    """Two adapters on the same layers, of other ranks (so other scalings), both merged: against peft's own
    merge_and_unload of both; modules_to_save's copy of the first still replaces the head."""
    import peft

    reference = lora_runs / "lora.reference"
    model = peft_model(reference)
    settings = json.loads((reference / "adapter" / "adapter_config.json").read_text())
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=settings["lora_alpha"],
                                                target_modules=settings["target_modules"]))
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".second." in name:  # peft starts lora_B (embeddings: lora_A) at zero
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert any(".lora_B.second." in key for key in state) and any(".lora_embedding_A.second" in key for key in state)
    torch.save({"model": state}, tmp_path / "two.pt")
    result = dcptool("export-hf", tmp_path / "two.pt", tmp_path / "merged", "--lora", "merge", "--lora-alpha",
                     str(settings["lora_alpha"]))
    assert f"merged {len(lora_layers(reference))} LoRA layers of default, second" in result.stderr
    assert_merged_as(tmp_path / "merged", model.merge_and_unload(adapter_names=["default", "second"]).state_dict())
    refused("export-hf", tmp_path / "two.pt", tmp_path / "adapter", "--lora", "adapter", "--lora-alpha", "16",
            names=["2 (default, second)"], output=tmp_path / "adapter")


def saved_with_trained_b(model, state_file, adapter_folder) -> None:
    """A peft model whose lora_B is not zero (as after training), saved whole with torch.save and as peft's
    own adapter folder."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    torch.save({"model": model.state_dict()}, state_file)
    model.save_pretrained(adapter_folder)


def test_fan_in_fan_out(tmp_path):
    """GPT-2's Conv1D layers store [in, out] (peft's fan_in_fan_out): the delta is (B @ A).T. A peft GPT-2
    saved with torch.save, lora_B made non-zero, against peft's own merge_and_unload."""
    import peft
    import transformers

    torch.manual_seed(5)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config),
                                peft.LoraConfig(r=4, lora_alpha=12, target_modules=["c_attn", "c_fc"],
                                                fan_in_fan_out=True))
    saved_with_trained_b(model, tmp_path / "gpt2.pt", tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["fan_in_fan_out"]
    dcptool("export-hf", tmp_path / "gpt2.pt", tmp_path / "merged", "--lora", "merge", "--lora-config",
            tmp_path / "adapter" / "adapter_config.json")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    expected = model.merge_and_unload().state_dict()
    assert "transformer.h.0.attn.c_attn.weight" in merged and set(merged) <= set(expected)
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_rank_and_alpha_patterns(lora_runs, tmp_path):
    """Ranks and alphas per module (peft's rank_pattern, alpha_pattern): merged with each module's own scale,
    and written back into the adapter folder's config so that peft builds the same layers."""
    import peft
    import transformers

    base_folder = lora_runs / "lora.reference" / "base"
    torch.manual_seed(9)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                "rank_pattern": {"down_proj": 2}, "alpha_pattern": {"v_proj": 32}}
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base_folder),
                                peft.LoraConfig(**settings))
    saved_with_trained_b(model, tmp_path / "patterns.pt", tmp_path / "peft-adapter")
    config = tmp_path / "peft-adapter" / "adapter_config.json"
    dcptool("export-hf", tmp_path / "patterns.pt", tmp_path / "adapter", "--lora", "adapter", "--lora-config", config)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["alpha_pattern"] == {"v_proj": 32}
    assert written["rank_pattern"] == {f"model.layers.{i}.mlp.down_proj": 2 for i in range(2)}
    ids = torch.load(lora_runs / "lora.reference" / "inputs.pt", weights_only=True)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_folder),
                                            tmp_path / "adapter")
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))
    dcptool("export-hf", tmp_path / "patterns.pt", tmp_path / "merged", "--lora", "merge", "--lora-config", config)
    merged, expected = load_file(tmp_path / "merged" / "model.safetensors"), model.merge_and_unload().state_dict()
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_merge_under_torchrun(lora_runs, tmp_path):
    """Under torchrun each rank computes the merged weights of its own shards: the same bytes as one process."""
    from test_torchrun import contents, torchrun

    options = ["--lora", "merge", "--max-shard-size", "40KB", "--config-dir", lora_runs / "lora" / "huggingface"]
    dcptool("export-hf", lora_runs / "lora", tmp_path / "alone", *options)
    result = torchrun("export-hf", lora_runs / "lora", tmp_path / "ranks", *options)
    assert result.returncode == 0, result.stderr[-3000:]
    alone = contents(tmp_path / "alone")
    assert len([name for name in alone if name.endswith(".safetensors")]) >= 2
    assert contents(tmp_path / "ranks") == alone
