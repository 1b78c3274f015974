"""``dcptool reshard`` and ``dcptool import-hf``: a checkpoint laid out as a job on another mesh saves it
(both plan and write through ``_reshard``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import typer

from dcptool import formats, hub
from dcptool.cli import render, writing
from dcptool.cli.app import app
from dcptool.cli.options import (CastDtype, CompressOption, Compression, ConfigDirOption, CpOption, DequantizeOption,
                                 DpReplicateOption, DryRunOption, DtypeOption, EpOption, EtpOption, Family, FormatName,
                                 FromOption, FsyncOption, MaxMemoryOption, ModelValuesOption, OptimForm,
                                 OptimFormOption, OutputLocation, OverwriteOption, PlanOption, RevisionOption,
                                 TargetAdapterOption, TpOption, WorldSizeOption)
from dcptool.cli.render import shown
from dcptool.errors import UsageError
from dcptool.sizes import parse_size
from dcptool.storage import check_destination, output_path


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
    to: Literal["dcp", "fsdp1"] = typer.Option("dcp", "--to", help="dcp, or fsdp1 (per-rank files of the model, data parallel only)."),
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
    fsync: bool = FsyncOption,
) -> None:
    """Lay a checkpoint out for another mesh, exactly as a job with that mesh saves it with dcp.save.

    Each rank of the new job then reads its own file. Placements follow FSDP2 fully_shard over dp (and cp), TP colwise/rowwise by the plan, and EP for grouped experts; optimizer state follows its parameter. Entries of single data-parallel ranks (dataloader.dp_rank_*) are dropped with a warning unless --keep-rank-state.

    [bold]Examples[/bold]:
      [cyan]dcptool reshard step-1000 step-1000-tp4 --tp 4[/cyan]            (8 ranks saved it: dp=2 x tp=4)
      [cyan]dcptool reshard step-1000 moe-ep --dp 4 --tp 2 --ep 4 --etp 1 --dry-run[/cyan]
      [cyan]dcptool reshard global_step_10/actor fsdp1-w8 --to fsdp1 --world-size 8[/cyan]
    """
    from dcptool import conversion, resharding

    mesh_options = resharding.mesh_options(dp, tp, ep, etp, cp, dp_replicate, world_size)
    conversion.fsdp1_forms_only(to, optim_form, model_values)
    if to == "fsdp1":
        if compress:
            raise UsageError(f"--compress {compress} goes with --to dcp")
        checkpoint = formats.open_checkpoint(source, source_format)
        writing.write(resharding.fsdp1_conversion(checkpoint, mesh_options, dtype, keep_rank_state=keep_rank_state,
                                                  optim_form=optim_form, model_values=model_values),
                      destination, max_memory, overwrite, fsync)
        return
    _reshard(source, destination, source_format, mesh_options, plan, keep_rank_state, config_dir, dtype, dry_run,
             as_json, max_memory, overwrite, fsync, adapter, compress=compress)


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
    adapter: Family = typer.Option("hf", "--adapter", help="Names of the job that will load it: hf (keys as in the folder), archon (AReaL Archon: model.<name>, grouped experts) or torchtitan (0.3 and later, keys at the top level)."),
    config_dir: Optional[str] = ConfigDirOption,
    dtype: Optional[CastDtype] = DtypeOption,
    dry_run: bool = DryRunOption,
    revision: Optional[str] = RevisionOption,
    dequantize: bool = DequantizeOption,
    max_memory: str = MaxMemoryOption,
    overwrite: bool = OverwriteOption,
    fsync: bool = FsyncOption,
) -> None:
    """Turn Hugging Face safetensors into a DCP checkpoint that dcp.load reads, laid out for a mesh.

    Without mesh options the weights are one chunk each; with them, chunked as a job on that mesh saves them (see reshard). The folder's config.json is checked against tp and ep. With --adapter archon or torchtitan the weights get that family's names and layout (experts grouped, so --ep works), and an Archon or torchtitan job starts from them with dcp.load.

    [bold]Examples[/bold]:
      [cyan]dcptool import-hf Qwen3-8B qwen3-dcp[/cyan]
      [cyan]dcptool import-hf Qwen3-30B-A3B qwen3-moe-archon --adapter archon --dp 8 --ep 8[/cyan]
      [cyan]dcptool import-hf Llama-3.1-8B llama-titan --adapter torchtitan --dp 4 --tp 2[/cyan]
      [cyan]dcptool import-hf Qwen/Qwen3-8B qwen3-dcp --revision main[/cyan]   (a hub repo, through the hub cache)
    """
    from dcptool import adapters, resharding

    source, = hub.with_revision(source, revision=revision)
    mesh_options = resharding.mesh_options(dp, tp, ep, etp, cp, dp_replicate, world_size)
    _reshard(source, destination, "hf", mesh_options, plan, False, config_dir, dtype, dry_run, False,
             max_memory, overwrite, fsync, adapter, adapters.JOB_WRAPPERS[adapter], dequantize=dequantize)


def _reshard(source, destination, source_format, mesh_options, plan, keep_rank_state, config_dir, dtype, dry_run,
             as_json, max_memory, overwrite, fsync, adapter=None, wrapper=(), dequantize=False, compress=None) -> None:
    """Plan the layout on the mesh; print it (--dry-run, exit 2 on problems) or write it with a bar and summarize."""
    from dcptool import resharding

    if not dry_run:
        check_destination(destination, overwrite)  # before planning prints its warnings
    checkpoint, quant_notes = writing.dequantized(formats.open_checkpoint(source, source_format), dequantize, config_dir,
                                                  dtype)
    result = resharding.plan_for(checkpoint, mesh_options, plan, adapter=adapter,
                                 wrapper=wrapper, config_dir=config_dir, keep_rank_state=keep_rank_state, dtype=dtype)
    result.notes[:0] = quant_notes
    if dry_run:
        render.print_plan(result, as_json)
        if not as_json:
            render.notes(result.notes)
        if result.problems:
            raise typer.Exit(2)
        return
    resharding.raise_problems(result)
    if not render.settings["quiet"]:
        render.stderr_console().print(f"{result.mesh.describe()}; plan {result.plan.name} ({result.plan.description})",
                                      soft_wrap=True)
    for warning in result.warnings:
        render.stderr_console().print("[yellow]warning[/yellow]: " + shown(warning).replace("[", "\\["), soft_wrap=True)
    total = sum(layout.tensor.nbytes for layout in result.layouts)
    with render.progress(total, f"writing {Path(str(destination)).name}") as advance:
        report = resharding.write_plan(result, destination, compress=compress,
                                       max_memory=parse_size(max_memory, "--max-memory"),
                                       overwrite=overwrite, fsync=fsync, progress=advance)
    render.summary(report)
    render.notes(report.notes)
