"""Strategy names: the one table the Trainer, the fine-tuning recipe, the planner, the demo and the tests read.

Each name stands for a ParallelPlan (parallel.py): the engine ("single",
"ddp", "fsdp", "deepspeed") with its sharding or ZeRO stage and offload. Any
name with the suffix `_ac` also means activation checkpointing of the wrapped
blocks; that needs the block class, so only the callers that know it (the
planner, the demo) accept the suffix. Older spellings are aliases, so a
command line that worked keeps working. Imports no torch, so any layer can
use the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from shardwise.strategies.parallel import ParallelPlan

PLANS: Dict[str, ParallelPlan] = {
    "single": ParallelPlan("single"),
    "ddp": ParallelPlan("ddp"),
    "fsdp": ParallelPlan("fsdp"),
    "fsdp_shard_grad_op": ParallelPlan("fsdp", sharding="SHARD_GRAD_OP"),
    "fsdp_no_shard": ParallelPlan("fsdp", sharding="NO_SHARD"),
    "fsdp_hybrid_shard": ParallelPlan("fsdp", sharding="HYBRID_SHARD"),
    "fsdp_cpu_offload": ParallelPlan("fsdp", offload_params=True, offload_optimizer=True),
    "deepspeed": ParallelPlan("deepspeed", zero_stage=2),
    "deepspeed_stage_1": ParallelPlan("deepspeed", zero_stage=1),
    "deepspeed_stage_2": ParallelPlan("deepspeed", zero_stage=2),
    "deepspeed_stage_2_offload": ParallelPlan("deepspeed", zero_stage=2, offload_optimizer=True),
    "deepspeed_stage_3": ParallelPlan("deepspeed", zero_stage=3),
    "deepspeed_stage_3_offload": ParallelPlan("deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True),
}
SHORT_ALIASES = ("deepspeed",)  # names that are another name's short form: never given back by name_of

# name -> (strategy class key, the constructor options the name stands for)
STRATEGIES: Dict[str, Tuple[str, Dict[str, Any]]] = {n: (p.engine, p.strategy_options()) for n, p in PLANS.items()}

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


def valid_names(with_ac: bool = False) -> str:
    names = ", ".join(PLANS)
    return names + (f"; any of them + {AC_SUFFIX!r} for activation checkpointing" if with_ac else "")


def _key(name: str, allow_ac: bool) -> Tuple[str, bool]:
    key = str(name).lower().strip().replace("-", "_")
    ac = allow_ac and key.endswith(AC_SUFFIX) and key not in PLANS
    if ac:
        key = key[: -len(AC_SUFFIX)]
    key = ALIASES.get(key, key)
    if key not in PLANS:
        raise ValueError(f"Unknown strategy {name!r}. Valid names: {valid_names(allow_ac)}.")
    return key, ac


def lookup(name: str, allow_ac: bool = False) -> ParallelPlan:
    """`name` (any spelling: case, dashes, aliases, an `_ac` suffix if allowed) -> its ParallelPlan."""
    key, ac = _key(name, allow_ac)
    return replace(PLANS[key], ac="full") if ac else PLANS[key]


def resolve(name: str, allow_ac: bool = False) -> Named:
    """`name` -> Named (the table's spelling, class key and options); ValueError otherwise."""
    key, ac = _key(name, allow_ac)
    kind, options = STRATEGIES[key]
    return Named(key, kind, dict(options), ac)


def name_of(plan: ParallelPlan) -> Optional[str]:
    """The table's name for a plan's configuration (+ `_ac` for full checkpointing), or None if it has none."""
    if plan.ac == "selective":
        return None
    wanted = replace(plan.configuration(), ac="none")
    for name, entry in PLANS.items():
        if entry == wanted and name not in SHORT_ALIASES:
            return name + (AC_SUFFIX if plan.uses_ac else "")
    return None


__all__ = ["PLANS", "STRATEGIES", "ALIASES", "AC_SUFFIX", "Named", "lookup", "resolve", "name_of", "valid_names"]
