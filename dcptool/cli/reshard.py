"""``dcptool reshard`` and ``dcptool import-hf``: a checkpoint laid out as a job on another mesh saves it
(both plan and write through ``_reshard``)."""

from __future__ import annotations

from typing import Literal, Optional

import typer

from dcptool import families
from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import (COMPLETENESS, FORMAT_OPTIONS, MESH, READING, WRITING, CastDtype, ConfigDirOption,
                                 DtypeOption, Family, LaidOutFormat, OutputLocation, TargetFamilyOption, grouped)
from dcptool.cli.render import shown
from dcptool.format_interface import FormatOptions
from dcptool.models import MEGATRON_SPECS
from dcptool.options import Completeness, MeshOptions, Reading, Writing
from dcptool.storage import output_path


@app.command()
@grouped
def reshard(
    source: str = typer.Argument(..., help="Checkpoint to read (DCP, FSDP1 folder, torch.save file, HF folder; a path or a URL)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder; a path or a URL."),
    mesh: MeshOptions = MESH,
    to: LaidOutFormat = typer.Option("dcp", "--to", help="dcp (chunks per rank of any mesh), hf-dcp, or fsdp1 (per-rank files of the model, data parallel only)."),
    keep_rank_state: bool = typer.Option(False, "--keep-rank-state", help="Keep entries of single data-parallel ranks (dataloader.dp_rank_*) as saved instead of dropping them."),
    format_options: FormatOptions | None = FORMAT_OPTIONS.only("optim_form", "model_values", "compress"),
    family: Optional[Family] = TargetFamilyOption,
    config_dir: Optional[str] = ConfigDirOption,
    dtype: Optional[CastDtype] = DtypeOption,
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    reading: Reading = READING.only("format", "revision", "dequantize", "max_memory", "verify_records"),
    writing: Writing = WRITING,
) -> None:
    """Lay a checkpoint out for another mesh, exactly as a job with that mesh saves it with dcp.save.

    Each rank of the new job then reads its own file. Placements follow FSDP2 fully_shard over dp (and cp), TP colwise/rowwise by the plan, and EP for grouped experts; optimizer state follows its parameter. Entries of single data-parallel ranks (dataloader.dp_rank_*) are dropped with a warning unless --keep-rank-state.

    [bold]Examples[/bold]:
      [cyan]dcptool reshard step-1000 step-1000-tp4 --tp 4[/cyan]            (8 ranks saved it: dp=2 x tp=4)
      [cyan]dcptool reshard step-1000 moe-ep --dp 4 --tp 2 --ep 4 --etp 1 --dry-run[/cyan]
      [cyan]dcptool reshard global_step_10/actor fsdp1-w8 --to fsdp1 --world-size 8[/cyan]
    """
    from dcptool import api

    report = api.reshard(source, destination, mesh=mesh, to=to, family=family, config_dir=config_dir, dtype=dtype,
                         keep_rank_state=keep_rank_state, format_options=format_options, reading=reading,
                         writing=writing)
    _show(report, as_json)


@app.command(name="import-hf")
@grouped
def import_hf(
    source: str = typer.Argument(..., help="Hugging Face folder with safetensors (and index); a path, a URL or a hub repo ORG/NAME."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output DCP folder; a path or a URL."),
    mesh: MeshOptions = MESH.helped(dp="FSDP shard degree of the job that will load it (default 1)."),
    family: Family = typer.Option("hf", "--adapter", help="Names of the job that will load it: " + families.described() + "."),
    make_vocab_size_divisible_by: Optional[int] = typer.Option(None, "--make-vocab-size-divisible-by", metavar="N", rich_help_panel="Megatron-Core (--adapter megatron)", help="With --adapter megatron: pad the vocabulary to a multiple of N x --tp, as Megatron-LM's option of that name does (default 128); written into args."),
    megatron_spec: Optional[Literal[MEGATRON_SPECS]] = typer.Option(None, "--megatron-spec", rich_help_panel="Megatron-Core (--adapter megatron)", help="With --adapter megatron: the names of the layer spec the run that loads it is built with: local (--transformer-impl local; the default) or te (Transformer Engine's, Megatron-LM's default --transformer-impl transformer_engine: MoE layers keep pre_mlp_layernorm, MLA's q/kv norms go into linear_q_up_proj / linear_kv_up_proj); written into args as transformer_impl."),
    config_dir: Optional[str] = ConfigDirOption,
    dtype: Optional[CastDtype] = DtypeOption,
    lora_folder: Optional[str] = typer.Option(None, "--lora-adapter", metavar="ADAPTER_DIR", help="A PEFT adapter folder to put on the model: the output holds the peft model's state dict (base_layer, lora_A/B.default, ...), as an FSDP job of that model loads it with dcp.load."),
    completeness: Completeness = COMPLETENESS,
    reading: Reading = READING.only("revision", "dequantize", "max_memory"),
    writing: Writing = WRITING,
) -> None:
    """Turn Hugging Face safetensors into a DCP checkpoint that dcp.load reads, laid out for a mesh.

    Without mesh options the weights are one chunk each; with them, chunked as a job on that mesh saves them (see reshard). The folder's config.json is checked against tp and ep, and its tensors against the model it describes, as export-hf checks them (--allow-missing, --allow-unexpected). With --adapter archon or torchtitan the weights get that family's names and layout (experts grouped, so --ep works), and an Archon or torchtitan job starts from them with dcp.load.

    [bold]Examples[/bold]:
      [cyan]dcptool import-hf Qwen3-8B qwen3-dcp[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-archon --adapter archon --dp 8 --ep 8[/cyan]
      [cyan]dcptool import-hf Llama-3.1-8B llama-titan --adapter torchtitan --dp 4 --tp 2[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-mcore --adapter megatron --tp 2 --make-vocab-size-divisible-by 64[/cyan]
      [cyan]dcptool import-hf DeepSeek-V3 dsv3-mcore --adapter megatron --megatron-spec te[/cyan]   (for a Transformer Engine run)
      [cyan]dcptool import-hf Qwen/Qwen3-8B qwen3-dcp --revision main[/cyan]   (a hub repo, through the hub cache)
      [cyan]dcptool import-hf Qwen3-8B lora-resume --lora-adapter my-adapter --dp 8[/cyan]   (resume a LoRA run)
    """
    from dcptool import api

    report = api.import_hf(source, destination, mesh=mesh, family=family,
                           family_options=api.family_options(family, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                                             megatron_spec=megatron_spec),
                           config_dir=config_dir, dtype=dtype, lora_folder=lora_folder, completeness=completeness,
                           reading=reading, writing=writing)
    _show(report, False)


def _show(report, as_json: bool) -> None:
    """A reshard's plan (--dry-run; exit 2 on problems) or what it wrote, with the mesh line and warnings first."""
    if report.dry_run:
        render.print_plan(report.summary, as_json)
        if not as_json:
            render.notes([*report.notes, *report.not_read])
        if report.problems:
            raise typer.Exit(2)
        return
    if not render.settings["quiet"]:
        render.stderr_console().print(report.description, soft_wrap=True)
    for warning in report.warnings:
        render.stderr_console().print("[yellow]warning[/yellow]: " + shown(warning).replace("[", "\\["), soft_wrap=True)
    render.written(report)
