"""Megatron-Core checkpoints: the ``torch_dist`` folder (a DCP folder with ``metadata.json``; the common state in
``common.pt`` or the ``common_state`` object) and Megatron-LM's legacy per-rank ``mp_rank_*`` files, read
offline with nothing of Megatron imported; written as torch_dist for Megatron's ``dist_checkpointing.load``.

Megatron-LM's run layout (``iter_0000100/`` folders beside ``latest_checkpointed_iteration.txt``) is a folder
of checkpoints: each iteration is one, listed newest first (``dcptool.formats``).
"""

from __future__ import annotations

from dcptool.converters.dcp import METADATA
from dcptool.converters.megatron.names import BACKEND, COMMON_PT, CONFIG, NAME, SAFE_GLOBALS
from dcptool.converters.megatron.reader import detect, read
from dcptool.converters.megatron.writer import Writer, expected_objects, has_common_state, megatron_objects
from dcptool.format_interface import Format, Sharding, Output, OutputRequest
from dcptool.errors import option

__all__ = ["FORMAT", "Megatron", "detect", "read"]


class Megatron(Format):
    """A Megatron-Core checkpoint folder (torch_dist, or legacy per-rank files when read)."""

    name = NAME
    title = "Megatron-Core torch_dist"
    refines = ("dcp",)  # a torch_dist folder is a DCP folder too: this format is the one that knows it whole
    completes = (METADATA, CONFIG)
    sharding = Sharding.MESH
    dcp_loadable = True
    safe_globals = SAFE_GLOBALS

    detect = staticmethod(detect)
    read = staticmethod(read)
    writer_class = Writer

    def problems(self, checkpoint) -> list[tuple[str, str]]:
        """What Megatron's ``dist_checkpointing.load`` of a torch_dist folder would miss: the common state, and
        the ``_extra_state`` objects of its stacked linear layers ("Missing key")."""
        if checkpoint.info.get("sharded_backend") != BACKEND:
            return []
        found = []
        if not has_common_state(checkpoint.objects) and not checkpoint.files.is_file(COMMON_PT):
            why = (f"{checkpoint.root}: no common state ({COMMON_PT} or the common_state object): Megatron's "
                   "load_common_state_dict fails")
            found.append(("common_state", why))
        missing = [key for key in expected_objects((t.key, t.shape) for t in checkpoint.tensors.values())
                   if key not in checkpoint.objects]
        if missing:
            why = (f"{checkpoint.root}: {len(missing)} _extra_state objects that Megatron's load asks for are missing "
                   f"({missing[0]} ...): it fails with \"Missing key\"; convert with {option('to', NAME)} adds them")
            found.append((missing[0], why))
        return found

    def plan_output(self, checkpoint, request: OutputRequest) -> Output:
        output = super().plan_output(checkpoint, request)
        output.objects = megatron_objects(output.tensors, output.objects, checkpoint)
        return output


FORMAT = Megatron()
