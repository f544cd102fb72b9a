"""How the Trainer calls user code: callbacks' hooks, the module's, the datamodule's, the LR schedulers.

Callbacks are duck-typed, as in Lightning Fabric: `call_callbacks` calls a
hook on every callback that defines it, with Lightning's (trainer, module,
...) arguments. As in Lightning, the callbacks that monitor a metric
(EarlyStopping, ModelCheckpoint) can be called apart, after the module's own
hook, so they see what the module logged in it (`monitoring=True/False`).
`call_module` calls the TrainModule's hook after telling the module which
hook runs (self.log's defaults depend on it) and recording it as this rank's
progress, which names what a rank was doing if it ever hangs.
A hook wrapped in `rank_zero_only` runs inside `rank_zero_block`: under FSDP the
other ranks join the all-gathers of the units a forward in it makes on rank 0,
one unit at a time, so that forward does not wait for ranks that never come.
`update_lr_schedulers` steps the schedulers where Lightning does (see its
docstring). Which hook runs where is listed in lightning_hooks.py.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from shardwise.callbacks import EarlyStopping, ModelCheckpoint
from shardwise.distributed.progress import mark as mark_progress
from shardwise.module import enter_hook
from shardwise.module_hooks import ModuleHooks
from shardwise.strategies.fsdp_compat import gather_for_rank_zero
from shardwise.utilities.rank_zero import RANK_ZERO_MARK

# Callbacks whose decision reads a metric: at the end of a training epoch they run after the
# module's on_train_epoch_end, so they can monitor what it logged (Lightning's hard-coded pair).
MONITORING = (EarlyStopping, ModelCheckpoint)


def call_callbacks(trainer: Any, hook: str, *args: Any, monitoring: Optional[bool] = None, **kwargs: Any) -> None:
    """Call `hook(trainer, module, *args, **kwargs)` on every callback that defines it.

    monitoring: None for every callback; True / False for only those that do / do not monitor a metric.
    """
    defining = _defining(trainer, hook)
    if not defining:  # most hooks of most steps: no callback has them, nothing to announce
        return
    module = trainer.module
    previous = enter_hook(module, hook) if module is not None else None  # a callback's pl_module.log
    try:
        for callback, fn in defining:
            if monitoring is not None and isinstance(callback, MONITORING) != monitoring:
                continue
            # Named with its class: a collective only some ranks reach in it is then blamed on it.
            mark_progress(f"{type(callback).__name__}.{hook}", trainer.state.global_step)
            if getattr(fn, RANK_ZERO_MARK, False):
                with rank_zero_block(trainer, f"{type(callback).__name__}.{hook}"):
                    fn(trainer, module, *args, **kwargs)
            else:
                fn(trainer, module, *args, **kwargs)
    finally:
        if previous is not None:
            enter_hook(module, previous)


# Which callbacks define which hook, looked up once per trainer and list of callbacks instead of at every call
# (several calls a step): again when trainer.callbacks changes (another object, order or length) and at the
# start of every fit / validate / test (forget_callbacks), not when a callback's method is replaced mid-run.
_TABLES: "weakref.WeakKeyDictionary[Any, _Table]" = weakref.WeakKeyDictionary()


class _Table:
    def __init__(self, callbacks: Tuple[Any, ...]) -> None:
        self.snapshot = callbacks
        self.hooks: Dict[str, List[Tuple[Any, Any]]] = {}


def forget_callbacks(trainer: Any) -> None:
    """Look the callbacks' hooks up afresh (each fit / validate / test starts with this)."""
    try:
        _TABLES.pop(trainer, None)
    except TypeError:
        pass


def _defining(trainer: Any, hook: str) -> List[Tuple[Any, Any]]:
    """(callback, bound hook) for every callback of the trainer that defines `hook`, in order."""
    current = tuple(trainer.callbacks)
    try:
        table = _TABLES.get(trainer)
    except TypeError:  # an object without weak references (a test's stand-in): look up every time
        table = None
    if table is None or table.snapshot != current:  # a tuple compares its items by identity first
        table = _Table(current)
        try:
            _TABLES[trainer] = table
        except TypeError:
            pass
    found = table.hooks.get(hook)
    if found is None:
        pairs = ((callback, getattr(callback, hook, None)) for callback in current)
        found = table.hooks[hook] = [(callback, fn) for callback, fn in pairs if callable(fn)]
    return found


def call_module(trainer: Any, hook: str, *args: Any, **kwargs: Any) -> Any:
    """Call the module's `hook(*args, **kwargs)` if it defines one; return what it returns."""
    module = trainer.module
    fn = getattr(module, hook, None)
    empty = _EMPTY_DEFAULTS.get(hook)
    if not callable(fn) or empty is not None and getattr(fn, "__func__", None) is empty:
        return None  # ModuleHooks' empty default: nothing would run (several a step)
    previous = enter_hook(module, hook)
    mark_progress(hook, trainer.state.global_step)  # what this rank does, if it ever hangs
    try:
        if getattr(fn, RANK_ZERO_MARK, False):
            with rank_zero_block(trainer, f"{type(module).__name__}.{hook}"):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)
    finally:
        enter_hook(module, previous)  # self.log after it takes the enclosing hook's defaults again


def rank_zero_block(trainer: Any, name: str) -> Any:
    """What every rank enters around a hook wrapped in `rank_zero_only` (it runs on rank 0 alone).

    FSDP: a forward the hook makes on rank 0 gathers each unit it goes through with the other ranks, which
    wait for rank 0 to name the units one at a time and join each all-gather (fsdp_compat.gather_for_rank_zero);
    a hook that runs no forward costs one small broadcast and gathers nothing. Elsewhere (DDP, one device,
    DeepSpeed) nothing is done: the hook runs on rank 0 as written. `name` (the hook's) is not needed: no
    strategy refuses a marked hook."""
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module):
        return gather_for_rank_zero(model)
    return contextlib.nullcontext()


def module_overrides(module: Any, hook: str) -> bool:
    """Whether the module's `hook` is its own (a subclass's method, or a function set on the instance), not
    ModuleHooks' default: for the hooks the loop prepares work for only when the module has its own."""
    fn = getattr(module, hook, None)
    return callable(fn) and getattr(fn, "__func__", None) is not getattr(ModuleHooks, hook, None)


def _does_nothing(fn: Any) -> bool:
    """Whether a function's body only returns None (a docstring, `...` or `pass`), read from its bytecode."""
    for ins in dis.get_instructions(fn):
        if ins.opname in ("RESUME", "NOP", "RETURN_VALUE", "CACHE"):
            continue
        if ins.opname in ("LOAD_CONST", "RETURN_CONST") and ins.argval is None:
            continue
        return False
    return True


# The hooks whose ModuleHooks default does nothing and returns None, found by their code rather than listed.
_EMPTY_DEFAULTS: Dict[str, Any] = {
    name: fn for name, fn in vars(ModuleHooks).items() if inspect.isfunction(fn) and _does_nothing(fn)
}


def call_datamodule(trainer: Any, hook: str, *args: Any, **kwargs: Any) -> Any:
    """Call the fit's datamodule's `hook` if there is a datamodule and it defines the hook."""
    datamodule = getattr(trainer, "datamodule", None)
    fn = getattr(datamodule, hook, None)
    return fn(*args, **kwargs) if callable(fn) else None


def takes_batch_idx(fn: Any) -> bool:
    """Whether a training_step / validation_step takes (batch, batch_idx) or only (batch)."""
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def is_plateau(entry: dict) -> bool:
    """Whether a scheduler steps on a metric (ReduceLROnPlateau, or an entry saying reduce_on_plateau=True)."""
    return bool(
        entry.get("reduce_on_plateau", isinstance(entry["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau))
    )


def update_lr_schedulers(trainer: Any, interval: str, plateau: bool) -> None:
    """Step the schedulers of this `interval` ("step" or "epoch") whose turn it is, through the module's
    lr_scheduler_step(scheduler, metric), where Lightning does:

    - the others (StepLR, cosine, ...): "step" ones after each optimizer step, "epoch" ones after the
      epoch's last optimizer step, before the end-of-epoch validation;
    - the plateau ones (they read a metric, usually a validation one): "step" ones after any validation
      that follows the step, "epoch" ones after the end-of-epoch validation and on_train_epoch_end.

    A plateau scheduler's `monitor` missing from callback_metrics is an error naming what was logged,
    or, with `strict: False` in its entry, a warning and no step (as in Lightning).
    """
    if not trainer.module.automatic_optimization:
        return  # manual optimization steps its schedulers itself (self.lr_schedulers()), as in Lightning
    counter = trainer.global_step if interval == "step" else trainer.current_epoch + 1
    for entry in trainer.strategy.lr_schedulers:
        if entry["interval"] != interval or is_plateau(entry) != plateau or counter % entry["frequency"]:
            continue
        metric = None
        if plateau:
            monitor = entry["monitor"]
            logged = trainer.callback_metrics
            if monitor not in logged:
                message = (
                    f"The LR scheduler {type(entry['scheduler']).__name__} monitors {monitor!r}, which is not "
                    f"among the logged metrics {sorted(logged)} at this {interval}."
                )
                if entry.get("strict", True):
                    raise KeyError(
                        f"{message} Log it with self.log({monitor!r}, ...) (a validation metric needs a "
                        "validation loader), or set 'strict': False in the scheduler's dict to skip steps without it."
                    )
                warnings.warn(f"{message} strict=False: the scheduler does not step.", RuntimeWarning, stacklevel=2)
                continue
            metric = torch.tensor(logged[monitor])
        call_module(trainer, "lr_scheduler_step", entry["scheduler"], metric)
