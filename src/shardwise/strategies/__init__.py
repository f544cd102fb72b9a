"""Where a strategy name becomes a strategy object.

`Trainer(strategy="fsdp")`, `Trainer(strategy=ParallelPlan("fsdp", ...))` and
`Trainer(strategy=FSDPStrategy(...))` all end here; a name stands for a
ParallelPlan (the table in names.py), and a plan builds its strategy. An unknown
name fails with the list of valid ones before any process is started.
Importing the strategies does not import DeepSpeed (an extra): only building
or running a DeepSpeedStrategy does.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Union

from shardwise.checkpoint.reader import register_reader
from shardwise.strategies import deepspeed_checkpoint
from shardwise.strategies.base import Strategy, wrap
from shardwise.strategies.ddp import DDPStrategy
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.strategies.fsdp import FSDPStrategy
from shardwise.strategies.names import LIGHTNING_NAMES, REFUSED_NAMES, TABLE, valid_names
from shardwise.strategies.parallel import ENGINE_CLASSES, ParallelPlan
from shardwise.strategies.single import SingleDeviceStrategy
from shardwise.utilities.refusal import build_refused_class

# `shardwise convert` / `inspect` read DeepSpeed's checkpoint directories through this reader;
# checkpoint/ names no strategy, so the strategy side registers it.
register_reader(deepspeed_checkpoint.FORMAT, deepspeed_checkpoint.DeepSpeedReader)

CLASSES: Dict[str, type] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "fsdp": FSDPStrategy,
    "deepspeed": DeepSpeedStrategy,
}

# ParallelPlan.build constructs through this table: parallel.py cannot import the classes (they import it).
ENGINE_CLASSES.update(CLASSES)

STRATEGY_NAMES = ("auto", *TABLE)

# Lightning's strategy classes with no counterpart here: importable, refused when built.
ModelParallelStrategy = build_refused_class(
    "ModelParallelStrategy",
    __name__,
    "tensor and sequence parallelism are FSDPStrategy's options here: FSDPStrategy(tp_size=..., sp_size=...), "
    "on one device mesh with the data-parallel dimensions.",
)
ParallelStrategy = build_refused_class(
    "ParallelStrategy",
    __name__,
    "a strategy here subclasses shardwise.strategies.Strategy (or DDPStrategy / FSDPStrategy / DeepSpeedStrategy).",
)


def build_strategy(
    strategy: Union[str, ParallelPlan, Strategy],
    world_size: int = 1,
    blocks: Optional[Iterable[Any]] = None,
    **options: Any,
) -> Strategy:
    """Turn a name or a ParallelPlan (or an instance, returned as is) into a strategy.

    `blocks`: the model's block classes, if known. FSDP then wraps each block as
    a unit (without them it shards the whole model as one, as Lightning's
    `strategy="fsdp"` does), and a name ending in `_ac` checkpoints them.
    `options`: further constructor arguments (e.g. `device_mesh=(2, 2)`).
    """
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, ParallelPlan):
        return strategy.build(blocks, **options)
    if not isinstance(strategy, str):
        raise TypeError(
            f"strategy must be a name, a ParallelPlan or a Strategy instance, got {type(strategy).__name__}"
        )
    if strategy.lower().strip() == "auto":
        chosen = SingleDeviceStrategy() if world_size <= 1 else DDPStrategy()
        chosen.is_auto = True  # Trainer(device_memory=...) may replace it with the memory planner's choice
        return chosen
    key = strategy.lower().strip().replace("-", "_")
    if key in LIGHTNING_NAMES:  # Lightning's "ddp_find_unused_parameters_true", "ddp_spawn", ...
        name, lightning_options = LIGHTNING_NAMES[key]
        return ParallelPlan.from_name(name).build(blocks, spelled=strategy, **{**lightning_options, **options})
    if key in REFUSED_NAMES:
        raise ValueError(f"strategy={strategy!r} (Lightning's) is not available: {REFUSED_NAMES[key]}.")
    try:
        plan = ParallelPlan.from_name(strategy, allow_ac=True)
    except ValueError:
        raise ValueError(
            f"Unknown strategy {strategy!r}. Valid names: auto, {valid_names()}; or pass a strategy "
            "object such as FSDPStrategy(...)."
        ) from None
    return plan.build(blocks, spelled=strategy, **options)


__all__ = [
    "Strategy",
    "SingleDeviceStrategy",
    "DDPStrategy",
    "FSDPStrategy",
    "DeepSpeedStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "build_strategy",
    "ParallelPlan",
    "STRATEGY_NAMES",
    "wrap",
]
