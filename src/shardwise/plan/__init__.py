"""The memory planner: "does it fit, and which configuration is fastest that fits?" before a GPU is rented.

`shardwise.plan(model, batch_size=..., seq_len=..., devices=..., num_nodes=...,
device_memory="80GiB", precision="bf16-mixed")` runs the real model and the
real strategy code (FSDP2's fully_shard, DDP, activation checkpointing) on
fake tensors with a fake process group, so nothing is allocated, and models
DeepSpeed ZeRO from its accounting. It returns a `Plan`: per configuration the
predicted per-device peak split into parameters, gradients, optimizer state,
activations and temporaries, the reserved memory the caching allocator will
need, host memory per node, a relative step time, and the fastest
configuration that fits with the reason. `shardwise plan --help` is the CLI.
"""

import sys
import types

from shardwise.plan.candidates import Candidate, default_candidates
from shardwise.plan.core import RESERVED_FACTOR, Estimate, Plan, plan
from shardwise.plan.errors import PlanError
from shardwise.plan.presets import LMModule, ModelSpec, preset_names, resolve_model

__all__ = [
    "plan",
    "Plan",
    "Estimate",
    "Candidate",
    "PlanError",
    "LMModule",
    "ModelSpec",
    "RESERVED_FACTOR",
    "default_candidates",
    "preset_names",
    "resolve_model",
]


class _CallablePackage(types.ModuleType):
    """`shardwise.plan(...)` calls plan() while `shardwise.plan.core` etc. stay importable.

    Binding the function to the name `shardwise.plan` would shadow this
    package, and `import shardwise.plan.core` would then fail; a callable
    package has both.
    """

    def __call__(self, *args, **kwargs) -> "Plan":
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
