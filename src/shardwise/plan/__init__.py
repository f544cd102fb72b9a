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
from shardwise.plan.candidates import Candidate, default_candidates
from shardwise.plan.core import RESERVED_FACTOR, Estimate, Plan, plan
from shardwise.plan.presets import LMModule, ModelSpec, PlanError, preset_names, resolve_model

__all__ = ["plan", "Plan", "Estimate", "Candidate", "PlanError", "LMModule", "ModelSpec", "RESERVED_FACTOR",
           "default_candidates", "preset_names", "resolve_model"]
