"""`shardwise.tuner.Tuner`: Lightning's learning-rate and batch-size finder, importable and refused by name.

The batch size that fits is the memory planner's answer, before anything
runs (`Trainer(device_memory=...)`, `shardwise plan`); a learning-rate sweep
is a short fit with a rising LR, read off the logged losses.
"""

from __future__ import annotations

from shardwise.utilities.refusal import build_refused_class

Tuner = build_refused_class(
    "Tuner",
    __name__,
    "for the batch size that fits, give the Trainer device_memory='80GiB' (or run `shardwise plan`): the memory "
    "planner picks a micro-batch and accumulation before any process starts; for the learning rate, run a short "
    "fit with torch.optim.lr_scheduler.LambdaLR raising it each step and pick it from the logged losses",
)

__all__ = ["Tuner"]
