"""How the Trainer calls user code: callbacks' hooks and the module's own.

Callbacks are duck-typed, as in Lightning Fabric: `call_callbacks` calls a
hook on every callback that defines it, with Lightning's (trainer, module,
...) arguments. `call_module` calls the TrainModule's hook after telling the
module which hook runs (self.log's defaults depend on it) and recording it as
this rank's progress, which names what a rank was doing if it ever hangs.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List

from shardwise.distributed.progress import mark as mark_progress
from shardwise.module import enter_hook


def call_callbacks(trainer: Any, hook: str, *args: Any, **kwargs: Any) -> None:
    """Call `hook(trainer, module, *args, **kwargs)` on every callback that defines it."""
    for callback in trainer.callbacks:
        fn = getattr(callback, hook, None)
        if callable(fn):
            fn(trainer, trainer.module, *args, **kwargs)


def call_module(trainer: Any, hook: str, *args: Any) -> Any:
    """Call the module's `hook(*args)` if it defines one; return what it returns."""
    module = trainer.module
    fn = getattr(module, hook, None)
    if not callable(fn):
        return None
    enter_hook(module, hook)
    mark_progress(hook, trainer.state.global_step)  # what this rank does, if it ever hangs
    return fn(*args)


def takes_batch_idx(fn: Any) -> bool:
    """Whether a training_step / validation_step takes (batch, batch_idx) or only (batch)."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def step_schedulers(schedulers: List[Dict[str, Any]], interval: str, counter: int, metrics: Any) -> None:
    """Step the LR schedulers of this `interval` ("step" or "epoch") due at `counter` (global step, or epochs done).

    A scheduler with a `monitor` (ReduceLROnPlateau) steps on that logged value from `metrics`.
    """
    for entry in schedulers:
        if entry["interval"] == interval and counter % entry["frequency"] == 0:
            monitor = entry.get("monitor")
            if monitor is not None:
                logged = metrics.callback_metrics
                if monitor not in logged:
                    raise KeyError(
                        f"lr_scheduler monitors {monitor!r}, which was never logged. Logged: {sorted(logged)}"
                    )
                entry["scheduler"].step(logged[monitor])
            else:
                entry["scheduler"].step()
