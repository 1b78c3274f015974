"""verl's FSDP1 checkpoint folder: one ``torch.save`` file per rank of FSDP1 ``SHARDED_STATE_DICT`` values.

A folder holds ``model_world_size_{W}_rank_{r}.pt`` for every rank ``r`` of ``W``, optionally
``optim_world_size_{W}_rank_{r}.pt``, ``extra_state_world_size_{W}_rank_{r}.pt`` (where dcptool
carries under ``dcptool_carried`` what of its source verl has no place for, e.g. torchtitan's
``train_state``), ``fsdp_config.json`` (``{"FSDP_version": 1, "world_size": W}``; dcptool adds ``dcptool_source_layout``
where it restructured the source's non-tensor entries, for its reader to give them back) and
``huggingface/`` (config, tokenizer). Each model file is a flat state dict whose parameters are

* ``ShardedTensor`` (FSDP1 without a device mesh): the rank's local shard plus the global
  ``ShardedTensorMetadata`` listing every shard's offsets and sizes;
* ``DTensor`` (FSDP1 given a device mesh): the local tensor plus a ``DTensorSpec`` with the
  placements, the mesh and the rank's coordinate in it, and the global shape;
* plain tensors for what FSDP1 does not shard (buffers), repeated in every rank's file.

FSDP1 shards the unflattened parameters row-wise on dim 0, ``torch.chunk`` style: rank ``r``
holds rows ``[r*ceil(n/W), (r+1)*ceil(n/W))``, so trailing ranks may hold fewer rows or none.

dcptool reads and writes these folders without torch and without a process group. The rooms:

* ``folder``: the files' names and the roots the entries go under;
* ``reader``: detecting a folder and reading it (world size, model, optimizer, extra state);
* ``gathering``: every rank's values gathered into whole tensors, chunk by chunk;
* ``codecs``: the ShardedTensor, DTensor and DeviceMesh pickles, decoded and encoded;
* ``flat``: FSDP1's flat parameters (which parameters share one, where each lies, their alignment);
* ``optimizer``: the four forms of the optimizer files (``OPTIMIZER_FORMS``), read and written;
* ``planning``: what an output holds (``entries``) and in which forms (``output_forms``);
* ``writer``: the per-rank files, ``fsdp_config.json`` and ``huggingface/``.

The pickles, the DeviceMesh state and the flat-parameter layout are torch 2.13's, checked against
real gloo jobs of torch 2.13 (tests/test_verl.py, tests/test_fsdp1.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dcptool.engine.core import Checkpoint
from dcptool.errors import option
from dcptool.format_interface import Format, FormatOptions, Sharding, Output, OutputRequest
from dcptool.converters.fsdp1 import planning, reader
from dcptool.converters.fsdp1.folder import CONFIG, HF_DIR, NAME
from dcptool.converters.fsdp1.writer import Writer


@dataclass(frozen=True, kw_only=True)
class Fsdp1Options(FormatOptions):
    """The fsdp1 output's own options: ``--world-size``, ``--keep-rank-state``, ``--optim-form``, ``--model-values``
    (``planning.output_forms`` says what each form is).

    Args:
        world_size: the data-parallel ranks to write files for (default 1; a reshard writes its mesh's).
        keep_rank_state: give each new rank the state its source rank saved of its own (RNG) instead of dropping it
            (a reshard takes this as its own option).
        optim_form: how the optimizer files hold the state: named, flat, orig or fsdp2 (default: the source
            folder's form, else named).
        model_values: sharded-tensor or dtensor[:DEVICE] (default: the source folder's, else sharded-tensor).

    Example:
        >>> Fsdp1Options(world_size=8, optim_form="flat").given()
        {'world_size': 8, 'optim_form': 'flat'}
    """

    world_size: int | None = None
    keep_rank_state: bool = False
    optim_form: str | None = None
    model_values: str | None = None


class Fsdp1(Format):
    """verl's FSDP1 (and FSDP2) folders: model, optimizer and extra-state files per rank, ``fsdp_config.json``
    and the model's ``huggingface/`` config; written for ``world_size`` data-parallel ranks."""

    name = NAME
    title = "verl's FSDP1 folders"
    completes = (CONFIG,)
    config_home = HF_DIR  # where verl keeps the model's config and tokenizer
    sharding = Sharding.DATA_PARALLEL
    options = Fsdp1Options

    detect = staticmethod(reader.detect)
    read = staticmethod(reader.read)
    writer_class = Writer

    def plan_output(self, checkpoint: Checkpoint, request: OutputRequest) -> Output:
        """The model, its optimizer state and the lr scheduler for each rank (``entries``), in the forms
        ``optim_form`` and ``model_values`` choose (``output_forms``)."""
        own = request.format_options or Fsdp1Options()
        world_size = request.world_size or own.world_size or 1
        tensors, objects, reasons = planning.entries(checkpoint, world_size, request.dtype, request.include,
                                                     request.exclude, request.keep_rank_state or own.keep_rank_state)
        forms, said = planning.output_forms(checkpoint, own.optim_form, own.model_values)
        options = {"world_size": world_size, "source_layout": planning.source_layout(tensors, objects), **forms}
        selected = f", as selected by {option('include')}/{option('exclude')}" if request.include or request.exclude else ""
        why = f"the fsdp1 output holds {planning.HOLDS} only{selected}"
        return Output(tensors, objects, options, why, reasons, [said])


FORMAT = Fsdp1()
