"""Megatron-Core's names to and from any family's, through the hub's (HF's): ``layers`` takes its tensors apart
into HF's and puts them together from them; the rows' mapping (``renaming.TableMapping``) goes on to the others."""

from __future__ import annotations

from dcptool import models
from dcptool.families.megatron import Megatron, MegatronOptions, layers
from dcptool.family_interface import Family
from dcptool.renaming import Entry, Result, TableMapping


class MegatronMapping:
    """Entries of model ``kind`` from or to Megatron-Core's names, through the hub's (HF's): Megatron's stacked and
    fused tensors taken apart into HF's (``layers.to_hf``), then mapped on to ``target`` like any HF names; or
    any family's mapped to HF, then put together as Megatron keeps them (``layers.from_hf``, the vocabulary padded
    as ``options`` say). ``options``: the target's; ``where`` names the checkpoint in refusals."""

    def __init__(self, kind: str, source: Family, target: Family, config: dict | None, options, where: str,
                 hub: Family):
        self.kind, self.source, self.target, self.hub = kind, source, target, hub
        self.model = models.kinds()[kind]
        self.config = models.text_config(config)
        self.where = where or "the checkpoint"
        self.options = options
        self.output = options if isinstance(options, MegatronOptions) else MegatronOptions()

    def convert(self, entries: dict[str, Entry], model: bool = True) -> Result:
        hub = self.hub
        if isinstance(self.source, Megatron):
            # HF's prediction layers repeat the embedding and head: other families keep them once
            hf = layers.to_hf(self.model, entries, self.config, self.where, mtp_copies=self.target is hub)
            result = Result(dropped=list(hf.dropped), unmatched=list(hf.unmatched), made=list(hf.made))
            fused = self.target.fused_experts(self.options)
            if self.target is hub and not fused:
                result.entries = dict(hf.entries)
                return result
            after = TableMapping(self.kind, hub, self.target, self.config, fused).convert(
                {name: entry for name, (entry, _) in hf.entries.items()}, model)
            result.entries = {name: (entry, hf.entries[first][1]) for name, (entry, first) in after.entries.items()}
            result.dropped += after.dropped
            result.unmatched += [hf.entries[name][1] for name in after.unmatched]
            return result
        result = Result()
        named = entries
        if self.source is not hub:
            before = TableMapping(self.kind, self.source, hub, self.config).convert(entries, model)
            result.dropped, result.unmatched, result.made = before.dropped, before.unmatched, before.made
            firsts = {name: first for name, (_, first) in before.entries.items()}
            named = {name: entry for name, (entry, _) in before.entries.items()}
        else:
            firsts = {name: name for name in entries}
        if model:  # a tied HF model saves no lm_head; Megatron's output_layer is absent when tied too
            for output in models.tied_outputs(self.config, hub.name):
                named.pop(output, None)
        built = layers.from_hf(self.model, named, self.config, self.output, self.where)
        result.entries = {name: (entry, firsts[first]) for name, (entry, first) in built.entries.items()}
        result.unmatched += [firsts[name] for name in built.unmatched]
        result.dropped += built.dropped
        result.made += built.made
        return result

    def untranslatable(self, names) -> list[str]:
        """Names of the source whose tensors the target family has no place for."""
        if isinstance(self.source, Megatron):
            empty = {m.megatron for m in self.model.megatron if not m.hf}
            return [n for n in names if (match := layers.LAYER.match(n)) and match[2] in empty]
        if self.source is self.hub:
            return []
        return TableMapping(self.kind, self.source, self.hub, self.config).untranslatable(names)
