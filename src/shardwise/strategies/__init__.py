"""The one place a strategy name becomes a strategy object.

`Trainer(strategy="fsdp")` and `Trainer(strategy=FSDPStrategy(...))` both end
here; an unknown name fails with the list of valid ones before any process
is started. Importing the strategies does not import DeepSpeed (an extra): only
building or running a DeepSpeedStrategy does.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Union

from shardwise.checkpoint.reader import register_reader
from shardwise.strategies import deepspeed_checkpoint
from shardwise.strategies.base import Strategy, wrap
from shardwise.strategies.ddp import DDPStrategy
from shardwise.strategies.deepspeed import NAMED as _DEEPSPEED_NAMED, DeepSpeedStrategy
from shardwise.strategies.fsdp import FSDPStrategy
from shardwise.strategies.single import SingleDeviceStrategy

# `shardwise convert` / `inspect` read DeepSpeed's checkpoint directories through this reader;
# checkpoint/ names no strategy, so the strategy side registers it.
register_reader(deepspeed_checkpoint.FORMAT, deepspeed_checkpoint.DeepSpeedReader)

_REGISTRY: Dict[str, Callable[[], Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "fsdp_shard_grad_op": lambda: FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"),
    "fsdp_no_shard": lambda: FSDPStrategy(sharding_strategy="NO_SHARD"),
    "fsdp_hybrid_shard": lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD"),
    "fsdp_cpu_offload": lambda: FSDPStrategy(cpu_offload=True),
    **{name: functools.partial(DeepSpeedStrategy.from_name, name) for name in _DEEPSPEED_NAMED},
}
_ALIASES = {"single_device": "single", "dp": "ddp", "fsdp2": "fsdp", "fsdp_full_shard": "fsdp"}

STRATEGY_NAMES = ("auto", *_REGISTRY)


def build_strategy(strategy: Union[str, Strategy], world_size: int = 1) -> Strategy:
    """Turn a name (or an instance, returned as is) into a strategy."""
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy instance, got {type(strategy).__name__}")
    key = strategy.lower().strip()
    key = _ALIASES.get(key, key)
    if key == "auto":
        chosen = SingleDeviceStrategy() if world_size <= 1 else DDPStrategy()
        chosen.is_auto = True  # Trainer(device_memory=...) may replace it with the memory planner's choice
        return chosen
    if key not in _REGISTRY:
        raise ValueError(f"Unknown strategy {strategy!r}. Valid names: {', '.join(STRATEGY_NAMES)}; "
                         "or pass a strategy object such as FSDPStrategy(...).")
    return _REGISTRY[key]()


__all__ = ["Strategy", "SingleDeviceStrategy", "DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy", "build_strategy",
           "STRATEGY_NAMES", "wrap"]
