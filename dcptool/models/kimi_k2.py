"""Kimi-K2: DeepSeek-V3's architecture under a config of its own (``model_type`` ``kimi_k2``, ``architectures``
``DeepseekV3ForCausalLM``, DeepSeek-V3's fields: 384 routed experts, one dense first layer, no prediction layers in
the release). transformers has no Kimi-K2 class (its release loads as remote code, DeepSeek-V3's), so everything
here is DeepSeek-V3's: its names in every family, weights, plans and Megatron tables, under this name.
"""

from dataclasses import replace

from dcptool.models import deepseek_v3
from dcptool.models.kind import ModelKind

KIND: ModelKind = replace(deepseek_v3.KIND, name="kimi_k2", architecture_of="deepseek_v3")
