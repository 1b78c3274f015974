"""``dcptool reshard`` and ``dcptool import-hf``: a checkpoint laid out as a job on another mesh saves it
(both plan and write through ``_reshard``)."""

from __future__ import annotations

from typing import Optional

import typer

from dcptool.cli import render
from dcptool.cli.app import app
from dcptool.cli.options import (NoVerifyRecordsOption, LaidOutFormat, CastDtype, CompressOption, Compression, ConfigDirOption, CpOption, DequantizeOption,
                                 DpReplicateOption, DryRunOption, DtypeOption, EpOption, EtpOption, Family, FormatName,
                                 FromOption, NoFsyncOption, MaxMemoryOption, ModelValuesOption, OptimForm,
                                 OptimFormOption, OutputLocation, OverwriteOption, PlanOption, RevisionOption,
                                 TargetAdapterOption, TpOption, WorldSizeOption)
from dcptool.cli.render import shown
from dcptool.storage import output_path


@app.command()
def reshard(
    source: str = typer.Argument(..., help="Checkpoint to read (DCP, FSDP1 folder, torch.save file, HF folder; a path or a URL)."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output folder; a path or a URL."),
    dp: Optional[int] = typer.Option(None, "--dp", help="FSDP shard degree (default: keeps the source's world size, else 1)."),
    tp: int = TpOption,
    ep: int = EpOption,
    etp: str = EtpOption,
    cp: int = CpOption,
    dp_replicate: int = DpReplicateOption,
    world_size: Optional[int] = WorldSizeOption,
    plan: str = PlanOption,
    to: LaidOutFormat = typer.Option("dcp", "--to", help="dcp (chunks per rank of any mesh), hf-dcp, or fsdp1 (per-rank files of the model, data parallel only)."),
    keep_rank_state: bool = typer.Option(False, "--keep-rank-state", help="Keep entries of single data-parallel ranks (dataloader.dp_rank_*) as saved instead of dropping them."),
    optim_form: Optional[OptimForm] = OptimFormOption,
    model_values: Optional[str] = ModelValuesOption,
    adapter: Optional[Family] = TargetAdapterOption,
    config_dir: Optional[str] = ConfigDirOption,
    source_format: Optional[FormatName] = FromOption,
    dtype: Optional[CastDtype] = DtypeOption,
    dry_run: bool = DryRunOption,
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: the plan as JSON."),
    compress: Optional[Compression] = CompressOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    no_fsync: bool = NoFsyncOption,
    no_verify_records: bool = NoVerifyRecordsOption,
) -> None:
    """Lay a checkpoint out for another mesh, exactly as a job with that mesh saves it with dcp.save.

    Each rank of the new job then reads its own file. Placements follow FSDP2 fully_shard over dp (and cp), TP colwise/rowwise by the plan, and EP for grouped experts; optimizer state follows its parameter. Entries of single data-parallel ranks (dataloader.dp_rank_*) are dropped with a warning unless --keep-rank-state.

    [bold]Examples[/bold]:
      [cyan]dcptool reshard step-1000 step-1000-tp4 --tp 4[/cyan]            (8 ranks saved it: dp=2 x tp=4)
      [cyan]dcptool reshard step-1000 moe-ep --dp 4 --tp 2 --ep 4 --etp 1 --dry-run[/cyan]
      [cyan]dcptool reshard global_step_10/actor fsdp1-w8 --to fsdp1 --world-size 8[/cyan]
    """
    from dcptool import api

    report = api.reshard(source, destination, dp=dp, tp=tp, ep=ep, etp=etp, cp=cp, dp_replicate=dp_replicate,
                         world_size=world_size, plan=plan, to=to, keep_rank_state=keep_rank_state, adapter=adapter,
                         config_dir=config_dir, source_format=source_format, dtype=dtype, optim_form=optim_form,
                         model_values=model_values, compress=compress, max_memory=max_memory, overwrite=overwrite,
                         fsync=not no_fsync, dry_run=dry_run, progress=render.progress,
                        verify_records=not no_verify_records)
    _show(report, as_json)


@app.command(name="import-hf")
def import_hf(
    source: str = typer.Argument(..., help="Hugging Face folder with safetensors (and index); a path, a URL or a hub repo ORG/NAME."),
    destination: OutputLocation = typer.Argument(..., parser=output_path, help="Output DCP folder; a path or a URL."),
    dp: Optional[int] = typer.Option(None, "--dp", help="FSDP shard degree of the job that will load it (default 1)."),
    tp: int = TpOption,
    ep: int = EpOption,
    etp: str = EtpOption,
    cp: int = CpOption,
    dp_replicate: int = DpReplicateOption,
    world_size: Optional[int] = WorldSizeOption,
    plan: str = PlanOption,
    adapter: Family = typer.Option("hf", "--adapter", help="Names of the job that will load it: hf (keys as in the folder), archon (AReaL Archon: dcp.model.<name>, grouped experts), torchtitan (0.3 and later, keys at the top level) or megatron (Megatron-Core's torch_dist: stacked layers, fused qkv and gate/up, the vocabulary padded for --tp as Megatron-LM pads it, Megatron-LM's args in the common state)."),
    make_vocab_size_divisible_by: Optional[int] = typer.Option(None, "--make-vocab-size-divisible-by", metavar="N", rich_help_panel="Megatron-Core (--adapter megatron)", help="With --adapter megatron: pad the vocabulary to a multiple of N x --tp, as Megatron-LM's option of that name does (default 128); written into args."),
    config_dir: Optional[str] = ConfigDirOption,
    dtype: Optional[CastDtype] = DtypeOption,
    dry_run: bool = DryRunOption,
    revision: Optional[str] = RevisionOption,
    dequantize: bool = DequantizeOption,
    lora_adapter: Optional[str] = typer.Option(None, "--lora-adapter", metavar="ADAPTER_DIR", help="A PEFT adapter folder to put on the model: the output holds the peft model's state dict (base_layer, lora_A/B.default, ...), as an FSDP job of that model loads it with dcp.load."),
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    no_fsync: bool = NoFsyncOption,
) -> None:
    """Turn Hugging Face safetensors into a DCP checkpoint that dcp.load reads, laid out for a mesh.

    Without mesh options the weights are one chunk each; with them, chunked as a job on that mesh saves them (see reshard). The folder's config.json is checked against tp and ep. With --adapter archon or torchtitan the weights get that family's names and layout (experts grouped, so --ep works), and an Archon or torchtitan job starts from them with dcp.load.

    [bold]Examples[/bold]:
      [cyan]dcptool import-hf Qwen3-8B qwen3-dcp[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-archon --adapter archon --dp 8 --ep 8[/cyan]
      [cyan]dcptool import-hf Llama-3.1-8B llama-titan --adapter torchtitan --dp 4 --tp 2[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-mcore --adapter megatron --tp 2 --make-vocab-size-divisible-by 64[/cyan]
      [cyan]dcptool import-hf Qwen/Qwen3-8B qwen3-dcp --revision main[/cyan]   (a hub repo, through the hub cache)
      [cyan]dcptool import-hf Qwen3-8B lora-resume --lora-adapter my-adapter --dp 8[/cyan]   (resume a LoRA run)
    """
    from dcptool import api

    report = api.import_hf(source, destination, dp=dp, tp=tp, ep=ep, etp=etp, cp=cp, dp_replicate=dp_replicate,
                           world_size=world_size, plan=plan, adapter=adapter,
                           make_vocab_size_divisible_by=make_vocab_size_divisible_by, config_dir=config_dir, revision=revision,
                           dtype=dtype, dequantize=dequantize, lora_adapter=lora_adapter, max_memory=max_memory,
                           overwrite=overwrite, fsync=not no_fsync, dry_run=dry_run, progress=render.progress)
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
