"""Where a strategy name becomes a strategy object.

`Trainer(strategy="fsdp")` and `Trainer(strategy=FSDPStrategy(...))` both end
here; the names and what they stand for are the table in names.py. An unknown
name fails with the list of valid ones before any process is started.
Importing the strategies does not import DeepSpeed (an extra): only building
or running a DeepSpeedStrategy does.
"""
from __future__ import annotations

from typing import Dict, Union

from shardwise.checkpoint.reader import register_reader
from shardwise.strategies import deepspeed_checkpoint
from shardwise.strategies.base import Strategy, wrap
from shardwise.strategies.ddp import DDPStrategy
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.strategies.fsdp import FSDPStrategy
from shardwise.strategies.names import AC_SUFFIX, STRATEGIES, resolve, valid_names
from shardwise.strategies.single import SingleDeviceStrategy

# `shardwise convert` / `inspect` read DeepSpeed's checkpoint directories through this reader;
# checkpoint/ names no strategy, so the strategy side registers it.
register_reader(deepspeed_checkpoint.FORMAT, deepspeed_checkpoint.DeepSpeedReader)

CLASSES: Dict[str, type] = {"single": SingleDeviceStrategy, "ddp": DDPStrategy, "fsdp": FSDPStrategy,
                           "deepspeed": DeepSpeedStrategy}

STRATEGY_NAMES = ("auto", *STRATEGIES)


def build_strategy(strategy: Union[str, Strategy], world_size: int = 1) -> Strategy:
    """Turn a name (or an instance, returned as is) into a strategy."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}")
    if strategy.lower().strip() == "auto":
        chosen = SingleDeviceStrategy() if world_size <= 1 else DDPStrategy()
        chosen.is_auto = True  # Trainer(device_memory=...) may replace it with the memory planner's choice
        return chosen
    if strategy.lower().strip().endswith(AC_SUFFIX) and strategy.lower().strip() not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: activation checkpointing needs your block class; pass "
                         "FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}) "
                         "(or DeepSpeedStrategy(..., activation_checkpointing_policy={Block})).")
    try:
        named = resolve(strategy)
    except ValueError:
        raise ValueError(f"Unknown strategy {strategy!r}. Valid names: auto, {valid_names()}; or pass a strategy "
                         "object such as FSDPStrategy(...).") from None
    return CLASSES[named.kind](**named.options)


__all__ = ["Strategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy", "build_strategy",
           "STRATEGY_NAMES", "wrap"]
