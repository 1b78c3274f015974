"""``dcptool export-hf``: the model weights as Hugging Face safetensors, optionally pushed to the hub."""

from __future__ import annotations

from typing import Literal, Optional

import typer

from dcptool import families
from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import (COMPLETENESS, READING, SELECTION, WRITING, CastDtype, DtypeOption, FamilyOrAuto,
                                 OutputLocation, format_options_of, grouped)
from dcptool.errors import UsageError, option
from dcptool.format_interface import FormatOptions
from dcptool.options import Completeness, HubPush, Lora, Quantize, Reading, Selection, Writing
from dcptool.storage import output_path


@app.command(name="export-hf")
@grouped
def export_hf(
    source: str = typer.Argument(..., help="Training checkpoint (DCP, FSDP1 folder, torch.save file; a path or a URL)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder for safetensors, index and config; a path or a URL."),
    config_dir: Optional[str] = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with config.json and tokenizer files to copy."),
    selection: Selection = SELECTION,
    dtype: Optional[CastDtype] = DtypeOption,
    format_options: FormatOptions | None = format_options_of("hf", "max_shard_size").helped(max_shard_size="Largest safetensors file (default 5GB, the hub's)."),
    family: FamilyOrAuto = typer.Option("auto", "--adapter", help="Family of the checkpoint's names: auto (detected), " + families.described() + "; the output has HF names."),
    hf_experts: Literal["per-expert", "fused"] = typer.Option("per-expert", "--hf-experts", help="MoE experts as per-expert tensors (as hub checkpoints hold them) or fused (transformers v5's gate_up_proj / down_proj)."),
    completeness: Completeness = COMPLETENESS,
    push_to_hub: Optional[str] = typer.Option(None, "--push-to-hub", metavar="ORG/NAME", help="Then upload the export to this Hugging Face hub model repo (created if missing)."),
    private: bool = typer.Option(False, "--private", help="With --push-to-hub: create the repo private (an existing repo keeps its visibility)."),
    push_branch: Optional[str] = typer.Option(None, "--push-branch", metavar="BRANCH", help="With --push-to-hub: the branch to upload to, created if missing (e.g. one per step)."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", metavar="MESSAGE", help="With --push-to-hub: the commit message."),
    lora: Optional[Literal["merge", "adapter"]] = typer.Option(None, "--lora", help="A checkpoint of a peft (LoRA) model: merge every adapter into the base weights, or write a PEFT adapter folder (adapter_model.safetensors, adapter_config.json) that PeftModel.from_pretrained loads."),
    lora_config: Optional[str] = typer.Option(None, "--lora-config", metavar="FILE", help="With --lora: the adapter's adapter_config.json (lora_alpha, use_rslora, ...); default: one beside the checkpoint."),
    lora_alpha: Optional[float] = typer.Option(None, "--lora-alpha", help="With --lora: lora_alpha (the merge scales B @ A by lora_alpha / r), over the config's."),
    quantize: Optional[str] = typer.Option(None, "--quantize", metavar="fp8|mxfp4|like=DIR", help="Quantize the decoder layers' linear weights as they stream out: fp8 (float8_e4m3fn, a float32 X.weight_scale_inv per block, as DeepSeek-V3 and Qwen3-FP8 releases), mxfp4 (GPT-OSS's experts) or like=DIR (as the released model folder DIR is quantized). Other tensors as they are (or in --dtype)."),
    block_size: Optional[str] = typer.Option(None, "--block-size", metavar="ROWSxCOLS", help="With --quantize fp8: rows and columns of weight per scale (default 128x128)."),
    scale_format: Optional[Literal["float", "ue8m0"]] = typer.Option(None, "--scale-format", help="With --quantize fp8: each block's scale as amax / 448 (float, the default) or that rounded up to a power of two (ue8m0, DeepSeek-V3.1's scale_fmt)."),
    quant_format: Optional[Literal["native", "compressed-tensors"]] = typer.Option(None, "--quant-format", help="With --quantize fp8: the quant_method's own layout (native, the default: X.weight_scale_inv) or compressed-tensors' (X.weight_scale, as llm-compressor writes it and vLLM reads it)."),
    reading: Reading = READING,
    writing: Writing = WRITING,
) -> None:
    """Export the model weights as Hugging Face safetensors, ready for transformers' from_pretrained.

    The model part is found from the checkpoint's nesting ({"dcp": {"model": ...}} in AReaL,
    {"model": ..., "optim": ...}, or model keys at the top level as in torchtitan); optimizer and
    other state are left out. A verl folder's huggingface/ config is used when --config-dir is not given.

    The weights must be the whole model config.json describes (dcptool's table of the model kind, else
    transformers' model built on the meta device): a missing part (a vision tower, MTP layers, an untied
    lm_head, experts, a norm) or a tensor the model has no place for exits 2 naming it, unless
    --allow-missing PART or --allow-unexpected accepts it.

    Archon and torchtitan names (grouped experts, Llama's interleaved q/k rows) become Hugging Face's;
    the family is detected from the names and printed.

    A peft (LoRA) model's checkpoint needs --lora: merge (W + lora_alpha / r * B @ A per layer, rsLoRA and
    DoRA too, computed in float32 as it streams) or adapter (a PEFT adapter folder). lora_alpha comes from
    an adapter_config.json beside the checkpoint (or its huggingface/), --lora-config or --lora-alpha.

    [bold]Examples[/bold]:
      [cyan]dcptool export-hf recover_checkpoint hf-out --config-dir base-model --dtype bfloat16[/cyan]
      [cyan]dcptool export-hf archon/step-200 qwen3-moe-hf --config-dir Qwen3-30B-A3B[/cyan]
      [cyan]dcptool export-hf lora/step-300 merged --config-dir base-model --lora merge[/cyan]
      [cyan]dcptool export-hf lora/step-300 adapter --lora adapter --lora-config lora/adapter_config.json[/cyan]
      [cyan]dcptool export-hf step-1000 hf-1000 --config-dir base-model --push-to-hub my-org/run-7 --private --push-branch step-1000[/cyan]
      [cyan]dcptool export-hf megatron/iter_0002000 v3-fp8 --config-dir DeepSeek-V3 --quantize like=DeepSeek-V3[/cyan]
    """
    from dcptool import api

    if push_to_hub is None and (private or push_branch or commit_message):
        raise UsageError(f"{option('private')}, {option('push_branch')} and {option('commit_message')} go with "
                         f"{option('push_to_hub')}")
    if lora is None and (lora_config is not None or lora_alpha is not None):
        raise UsageError(f"{option('lora_config')} and {option('lora_alpha')} go with {option('lora')}")
    if quantize is None and (block_size is not None or scale_format is not None or quant_format is not None):
        raise UsageError(f"{option('block_size')}, {option('scale_format')} and {option('quant_format')} go with "
                         f"{option('quantize')}")
    quantized = Quantize(quantize, block_size=block_size, scale_format=scale_format,
                         layout=quant_format) if quantize else None
    push = HubPush(push_to_hub, private=private, branch=push_branch, commit_message=commit_message) if push_to_hub else None
    report = api.export_hf(source, destination, config_dir=config_dir, family=family,
                           family_options=api.family_options(families.hub().name, hf_experts=hf_experts),
                           dtype=dtype, selection=selection, format_options=format_options, completeness=completeness,
                           lora=Lora(lora, config=lora_config, alpha=lora_alpha) if lora else None,
                           quantize=quantized, push=push,
                           reading=reading, writing=writing)
    render.written(report)
    if report.pushed_to:
        print(f"pushed {destination} to {report.pushed_to}")
