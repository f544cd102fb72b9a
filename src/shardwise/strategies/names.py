"""Strategy names: the one table the Trainer, the fine-tuning recipe, the planner, the demo and the tests read.

Each name is a strategy class ("single", "ddp", "fsdp", "deepspeed") with the
constructor options it stands for. Any name with the suffix `_ac` also means
activation checkpointing of the wrapped blocks; that needs the block class, so
only the callers that know it (the planner, the demo) accept the suffix.
Older spellings are aliases, so a command line that worked keeps working.
This module imports nothing, so any layer can use the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

STRATEGIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "single": ("single", {}),
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "fsdp_shard_grad_op": ("fsdp", {"sharding_strategy": "SHARD_GRAD_OP"}),
    "fsdp_no_shard": ("fsdp", {"sharding_strategy": "NO_SHARD"}),
    "fsdp_hybrid_shard": ("fsdp", {"sharding_strategy": "HYBRID_SHARD"}),
    "fsdp_cpu_offload": ("fsdp", {"cpu_offload": True}),
    "deepspeed": ("deepspeed", {"stage": 2}),
    "deepspeed_stage_1": ("deepspeed", {"stage": 1}),
    "deepspeed_stage_2": ("deepspeed", {"stage": 2}),
    "deepspeed_stage_2_offload": ("deepspeed", {"stage": 2, "offload_optimizer": True}),
    "deepspeed_stage_3": ("deepspeed", {"stage": 3}),
    "deepspeed_stage_3_offload": ("deepspeed", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
}

ALIASES = {
    "single_device": "single",
    "dp": "ddp",
    "fsdp2": "fsdp",
    "fsdp_full_shard": "fsdp",
    "fsdp_grad_op": "fsdp_shard_grad_op",
    "fsdp_full_shard_offload": "fsdp_cpu_offload",
    "fsdp_offload": "fsdp_cpu_offload",
    "zero1": "deepspeed_stage_1",
    "zero2": "deepspeed_stage_2",
    "zero3": "deepspeed_stage_3",
    "zero2_offload": "deepspeed_stage_2_offload",
    "zero3_offload": "deepspeed_stage_3_offload",
}

AC_SUFFIX = "_ac"


@dataclass(frozen=True)
class Named:
    """A resolved name: the table's own spelling, the strategy class, its options, and the `_ac` suffix."""

    name: str
    kind: str
    options: Dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    activation_checkpointing: bool = False

    @property
    def full_name(self) -> str:
        return self.name + (AC_SUFFIX if self.activation_checkpointing else "")


def valid_names(with_ac: bool = False) -> str:
    names = ", ".join(STRATEGIES)
    return names + (f"; any of them + {AC_SUFFIX!r} for activation checkpointing" if with_ac else "")


def resolve(name: str, allow_ac: bool = False) -> Named:
    """`name` (any spelling: case, dashes, aliases, an `_ac` suffix if allowed) -> Named; ValueError otherwise."""
    key = str(name).lower().strip().replace("-", "_")
    ac = allow_ac and key.endswith(AC_SUFFIX) and key not in STRATEGIES
    if ac:
        key = key[: -len(AC_SUFFIX)]
    key = ALIASES.get(key, key)
    if key not in STRATEGIES:
        raise ValueError(f"Unknown strategy {name!r}. Valid names: {valid_names(allow_ac)}.")
    kind, options = STRATEGIES[key]
    return Named(key, kind, dict(options), ac)


def name_for(kind: str, options: Dict[str, Any], activation_checkpointing: bool = False) -> str:
    """The table's name for a configuration (the inverse of `resolve`); ValueError if it has none."""
    defaults = {
        "sharding_strategy": "FULL_SHARD",
        "cpu_offload": False,
        "offload_optimizer": False,
        "offload_parameters": False,
    }
    wanted = {k: v for k, v in options.items() if v != defaults.get(k, object())}
    for name, (k, opts) in STRATEGIES.items():
        if k == kind and opts == wanted and name != "deepspeed":  # "deepspeed" is stage 2's short alias
            return name + (AC_SUFFIX if activation_checkpointing else "")
    raise ValueError(f"No strategy name for {kind} with {wanted}; pass a strategy object instead.")


__all__ = ["STRATEGIES", "ALIASES", "AC_SUFFIX", "Named", "resolve", "name_for", "valid_names"]
