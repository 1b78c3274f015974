"""Options more than one command takes, and the choices of options as Literal types."""

from __future__ import annotations

from typing import Literal

import typer

from dcptool import dtypes, families, formats

# An output: a local Path, or a URL kept as given (storage.output_path decides). Not annotated Path:
# typer would make the URL "s3://b/x" the path "s3:/b/x".
OutputLocation = str

# Choices as Literal types, so that help lists them and click refuses anything else with exit 2.
FormatName = Literal[tuple(formats.names())]
OutputFormat = Literal[tuple(formats.writable())]
CastDtype = Literal[dtypes.CASTABLE]
Family = Literal[tuple(families.names())]
FamilyOrAuto = Literal[("auto", *families.names())]
# reshard writes the formats laid out over ranks (a mesh, or data-parallel ranks)
LaidOutFormat = Literal[tuple(name for name in formats.writable() if formats.get(name).layout.value != "none")]
OptimForm = Literal["named", "flat", "orig", "fsdp2"]
Compression = Literal[tuple(sorted({c for f in formats.all_formats().values() for c in f.compressions}))]


FromOption = typer.Option(None, "--from", help="Source format (detected when omitted).")
OverwriteOption = typer.Option(False, "--overwrite", help="Replace DST if it exists (only once the new output is complete).")
MaxMemoryOption = typer.Option("256MiB", "--max-memory", help="Budget for data buffers; larger tensors move in pieces.")
DtypeOption = typer.Option(None, "--dtype", help="Cast floating-point tensors to this dtype.")
IncludeOption = typer.Option(None, "--include", help="Only keys matching this regular expression.")
ExcludeOption = typer.Option(None, "--exclude", help="Leave out keys matching this regular expression.")
# One flag, not --fsync/--no-fsync: a second column of names would narrow every description at 80 columns.
NoFsyncOption = typer.Option(False, "--no-fsync", help="Rename outputs into place without flushing them to disk first "
                             "(faster; after a power loss a renamed output may be incomplete).")
RevisionOption = typer.Option(None, "--revision", metavar="REV", help="Branch, tag or commit of a source that is a Hugging Face hub repo (ORG/NAME; or hf://ORG/NAME@REVISION).")
DequantizeOption = typer.Option(False, "--dequantize", help="Turn block-scaled float8 weights (X.weight + X.weight_scale_inv, block size from config.json's quantization_config) into --dtype (default bfloat16); the scales are left out.")
CompressOption = typer.Option(None, "--compress", help="Compress DCP records as torch's zstd extension does (dcp.load reads them; needs the zstandard package).")
TargetAdapterOption = typer.Option(None, "--adapter", help="Write model weights and their optimizer state under this family's names and in its engine's layout: hf (layout kept), archon (AReaL Archon, torchtitan before 0.3: dcp.model.*, dcp.optim.*) torchtitan (0.3 and later: model at the top level, optimizer.*) or megatron (Megatron-Core: stacked layers, fused qkv and gate/up). Default: the source's.")
JsonOption = typer.Option(False, "--json", help="Print a JSON report (exit codes stay the same).")
PlanOption = typer.Option("auto", "--plan", help="Placement plan: auto, hf, torchtitan, fsdp, or a YAML/JSON plan file.")

# verl's FSDP1 files (--to fsdp1): how the optimizer and model files hold their tensors (converters/fsdp1/planning.output_forms).
OptimFormOption = typer.Option(None, "--optim-form", help="With --to fsdp1, how the optimizer files hold the state: flat (verl's plain optimizer.state_dict() under FSDP1 with use_orig_params=False, its default) or orig (use_orig_params=True), which verl's optimizer.load_state_dict loads as they are; or named (FSDP.optim_state_dict, loaded through its optim_state_dict_to_load); or fsdp2 (an FSDP2 folder: optimizer.state_dict() of fully_shard, DTensor moments and model values, FSDP_version 2). Default: the source folder's form, else named.")
ModelValuesOption = typer.Option(None, "--model-values", help="With --to fsdp1: sharded-tensor (FSDP1 without a device mesh) or dtensor[:DEVICE] (FSDP1 given verl's 1-D device mesh, which must equal the loading job's: on DEVICE, else the source mesh's device type, else cuda; named as the source mesh, else fsdp). Default: the source folder's, else sharded-tensor.")

# Mesh options shared by reshard and import-hf.
TpOption = typer.Option(1, "--tp", help="Tensor-parallel degree.")
EpOption = typer.Option(1, "--ep", help="Expert-parallel degree (borrows data-parallel ranks).")
EtpOption = typer.Option("1", "--etp", help="Tensor-parallel degree of the experts: 1 or tp.")
CpOption = typer.Option(1, "--cp", help="Context-parallel degree (FSDP shards over dp*cp).")
DpReplicateOption = typer.Option(1, "--dp-replicate", help="HSDP replicas (each holds the dp shards).")
WorldSizeOption = typer.Option(None, "--world-size", help="Ranks of the target job; must equal dp_replicate*dp*cp*tp.")
ConfigDirOption = typer.Option(None, "--config-dir", help="Folder (a path or a URL) with the model's config.json: heads, kv heads and experts are checked against tp and ep.")
NoVerifyRecordsOption = typer.Option(False, "--no-verify-records", help="Read records (torch.save archives: DCP chunks and objects, torch.save and FSDP1 files) without checking their zip structure and CRC-32s, which dcptool checks by default and refuses a damaged one (exit 2); only for a user who accepts that damaged bytes are read or copied as they are.")
DryRunOption = typer.Option(False, "--dry-run", help="Print the plan and its problems; write nothing.")
