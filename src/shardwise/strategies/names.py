"""Strategy names: the one table the Trainer, the fine-tuning recipe, the planner, the demo and the tests read.

Each name stands for a configuration: the ParallelPlan fields it sets (engine "single", "ddp", "fsdp",
"deepspeed", with its sharding or ZeRO stage and offload). The table is plain data, and this module
imports nothing of the package: parallel.py reads it to make `ParallelPlan.from_name`, `plan.name` and
`PLANS` (the table as plans), so the two never import each other. Any name with the suffix `_ac` also
means activation checkpointing of the wrapped blocks; that needs the block class, so only the callers
that know it (the planner, the demo) accept the suffix. Older spellings are aliases, so a command line
that worked keeps working. Imports no torch, so any layer can use the table.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

# name -> the ParallelPlan fields it sets (the rest are the plan's defaults)
TABLE: Dict[str, Dict[str, Any]] = {
    "single": {"engine": "single"},
    "ddp": {"engine": "ddp"},
    "fsdp": {"engine": "fsdp"},
    "fsdp_shard_grad_op": {"engine": "fsdp", "sharding": "SHARD_GRAD_OP"},
    "fsdp_no_shard": {"engine": "fsdp", "sharding": "NO_SHARD"},
    "fsdp_hybrid_shard": {"engine": "fsdp", "sharding": "HYBRID_SHARD"},
    "fsdp_cpu_offload": {"engine": "fsdp", "offload_params": True, "offload_optimizer": True},
    "deepspeed": {"engine": "deepspeed", "zero_stage": 2},
    "deepspeed_stage_1": {"engine": "deepspeed", "zero_stage": 1},
    "deepspeed_stage_2": {"engine": "deepspeed", "zero_stage": 2},
    "deepspeed_stage_2_offload": {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
    "deepspeed_stage_3": {"engine": "deepspeed", "zero_stage": 3},
    "deepspeed_stage_3_offload": {
        "engine": "deepspeed",
        "zero_stage": 3,
        "offload_optimizer": True,
        "offload_params": True,
    },
}
SHORT_ALIASES = ("deepspeed",)  # names that are another name's short form: never given back for a plan

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

# Lightning's strategy strings that are a name above plus a constructor option (the process start method of
# ddp_spawn / ddp_fork / ddp_notebook is the launcher's business here: the same processes, the same numbers).
LIGHTNING_NAMES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    f"ddp{start}{unused}": ("ddp", {"find_unused_parameters": value} if unused else {})
    for start in ("", "_spawn", "_fork", "_notebook")
    for unused, value in (("", False), ("_find_unused_parameters_true", True), ("_find_unused_parameters_false", False))
    if start or unused
}
# Lightning's strategy strings with no counterpart here, and why.
REFUSED_NAMES = {
    "deepspeed_stage_3_offload_nvme": "NVMe offload is not supported; use 'deepspeed_stage_3_offload' (CPU memory)",
    **dict.fromkeys(
        ("xla", "xla_debug", "single_xla", "single_tpu", "xla_fsdp"),
        "shardwise runs on CPUs and CUDA GPUs, not on TPUs / XLA devices",
    ),
}

AC_SUFFIX = "_ac"


def valid_names(with_ac: bool = False) -> str:
    names = ", ".join(TABLE)
    return names + (f"; any of them + {AC_SUFFIX!r} for activation checkpointing" if with_ac else "")


def key_of(name: str, allow_ac: bool = False) -> Tuple[str, bool]:
    """`name` (any spelling: case, dashes, aliases, an `_ac` suffix if allowed) -> (the table's name, whether
    it asked for activation checkpointing); ValueError with the valid names otherwise."""
    key = str(name).lower().strip().replace("-", "_")
    ac = allow_ac and key.endswith(AC_SUFFIX) and key not in TABLE
    if ac:
        key = key[: -len(AC_SUFFIX)]
    key = ALIASES.get(key, key)
    if key not in TABLE:
        raise ValueError(f"Unknown strategy {name!r}. Valid names: {valid_names(allow_ac)}.")
    return key, ac


__all__ = [
    "TABLE",
    "ALIASES",
    "SHORT_ALIASES",
    "LIGHTNING_NAMES",
    "REFUSED_NAMES",
    "AC_SUFFIX",
    "key_of",
    "valid_names",
]
