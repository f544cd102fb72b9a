"""Adapters: train small added weights on top of a frozen (possibly sharded, possibly 4-bit) base model.

- lora.py: LoRA through PEFT on meta-device, sharded models: `LoraOptions`,
  `apply_lora`, deterministic adapter initialisation on every rank,
  `count_parameters` at full size, and the up-front checks of the options.
"""

from shardwise.adapters.lora import (
    LoraOptions,
    apply_lora,
    count_parameters,
    init_lora_weights,
    is_adapter_model,
)

__all__ = ["LoraOptions", "apply_lora", "count_parameters", "init_lora_weights", "is_adapter_model"]
