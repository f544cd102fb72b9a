"""Every hook Lightning 2.x calls, and what the Trainer does with it: called at Lightning's point, or refused.

`HOOKS` is the table: one row per hook Lightning calls on a LightningModule
(its ModelHooks, DataHooks, CheckpointHooks and the optimization methods the
loop calls), on a Callback, and on a LightningDataModule. A row is either
CALLED -- at the point and with the arguments Lightning uses, by the entry
point named in `stage` (fit, validate, test, predict) -- or REFUSED: defining
that hook is an error at fit / validate / test / predict that names it and
says why (`refuse_unsupported`), never a hook silently skipped.
`note` says where we differ from Lightning while still calling the hook.
tests/unit/test_lightning_hooks.py keeps the table complete against a run of
real Lightning recorded in tests/fixtures/lightning_hook_order.json, and
checks the order of a fit with validation against that recording.

The rest of this file is the calling sequences that are more than one call:
preparing data and setting up (`prepare_and_setup`), the batch transfer, the
end of a training batch and epoch, and validation's model-mode hooks.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from shardwise.callbacks import ModelCheckpoint
from shardwise.callbacks.base import Callback
from shardwise.module import drain_logs
from shardwise.module_hooks import ModuleHooks
from shardwise.strategies import Strategy
from shardwise.trainer.datamodules import attach_datamodule
from shardwise.trainer.hooks import (
    call_callbacks,
    call_datamodule,
    call_module,
    forget_callbacks,
    update_lr_schedulers,
)

CALLED, REFUSED = "called", "refused"


@dataclass(frozen=True)
class Hook:
    owner: str  # "module", "callback" or "datamodule"
    name: str
    status: str  # CALLED or REFUSED
    stage: str  # the entry point that calls it: fit, validate, test, predict, any ("" when refused)
    where: str  # when it runs (CALLED) or why it cannot (REFUSED)
    note: str = ""  # how we differ from Lightning while calling it
    moved: bool = False  # called at another point of the order than Lightning's (the order test knows)
    args_differ: bool = False  # called at Lightning's point, with other arguments (the note says which)


def _rows(owner: str, status: str, stage: str, names: str, where: str, note: str = "") -> List[Hook]:
    return [Hook(owner, name, status, stage, where, note) for name in names.split()]


_TRANSFER = "for every batch, before the batch hooks: (batch, dataloader_idx=0), device, then (batch, 0)"
_VAL_BATCH = "around each validation_step: (batch, batch_idx), then (outputs, batch, batch_idx)"
_OUTPUTS = (
    "outputs is what training_step returned, as before (Lightning passes a dict {'loss': loss / "
    "accumulate_grad_batches, ...} even for a tensor)"
)
_TEST = "by trainer.test(), in Lightning's order (test loop)"
_PREDICT = "by trainer.predict(), in Lightning's order (predict loop)"
_SAVE = (
    "when a checkpoint is saved / loaded, with the checkpoint dict; the module's before the callbacks' "
    "(Lightning: callbacks' first)"
)

HOOKS: Tuple[Hook, ...] = tuple(
    # ------------------------------------------------------------ the module
    _rows("module", CALLED, "any", "configure_callbacks", "first in fit / validate / test / predict; its callbacks "
          "replace the Trainer's of the same type, checkpoint callbacks go last")
    + _rows("module", CALLED, "any", "prepare_data", "after configure_callbacks, on local rank 0 of each node "
            "(global rank 0 with prepare_data_per_node=False), the datamodule's first, then a barrier")
    + _rows("module", CALLED, "any", "setup", "(stage=...) after the datamodule's and the callbacks' setup, before "
            "configure_model")
    + _rows("module", CALLED, "any", "configure_model", "after setup, under the strategy's init context (meta device)")
    + _rows("module", CALLED, "fit", "configure_optimizers", "after configure_model, on the wrapped parameters",
            "also in validate / test / predict under DeepSpeed, whose engine is built with the optimizer")
    + _rows("module", CALLED, "fit", "on_fit_start on_train_start on_train_end on_fit_end",
            "after the callbacks' hook of the same name, as in Lightning")
    + [
        Hook("module", "train_dataloader", CALLED, "fit", "after setup", "requested before configure_model (a "
             "DeepSpeed engine is sized by the micro-batch); Lightning requests it after on_fit_start", moved=True),
        Hook("module", "val_dataloader", CALLED, "fit", "after train_dataloader", "before configure_model, as "
             "train_dataloader", moved=True),
    ]
    + _rows("module", CALLED, "any", "on_before_batch_transfer transfer_batch_to_device on_after_batch_transfer",
            _TRANSFER + "; the datamodule's instead when it defines it")
    + _rows("module", CALLED, "fit", "on_train_epoch_start", "after the callbacks'")
    + _rows("module", CALLED, "fit", "on_train_batch_start", "after the callbacks'; returning -1 ends the run")
    + [
        Hook("module", "optimizer_step", CALLED, "fit", "on the last micro-batch of each accumulation window: "
             "(epoch, batch_idx, optimizer, optimizer_closure); the closure runs training_step and backward, "
             "optimizer.step(closure=...) runs it, the hooks, clipping and the strategy's step"),
        Hook("module", "training_step", CALLED, "fit", "(batch, batch_idx) for every micro-batch; in the closure "
             "of optimizer_step on the window's last"),
        Hook("module", "on_before_zero_grad", CALLED, "fit", "on the first micro-batch of each window, after "
             "training_step, before backward: (optimizer)", "the gradients are also set to None right after "
             "each optimizer step (to free their memory before the next forward), so on_train_batch_end sees none"),
        Hook("module", "optimizer_zero_grad", CALLED, "fit", "after on_before_zero_grad: (epoch, batch_idx, "
             "optimizer)"),
        Hook("module", "on_before_backward", CALLED, "fit", "before every backward: (loss as backpropagated, "
             "divided by the accumulation window)"),
        Hook("module", "backward", REFUSED, "", "the strategy runs backward (fp16 loss scaling, DeepSpeed's engine, "
             "FSDP's sharded reduction, no_sync for accumulation); put code around it in on_before_backward or "
             "on_after_backward, or optimize manually (self.manual_backward)"),
        Hook("module", "on_after_backward", CALLED, "fit", "after every backward"),
        Hook("module", "on_before_optimizer_step", CALLED, "fit", "before each optimizer step, gradients complete "
             "(accumulated, reduced), not yet clipped: (optimizer)", "under fp16 loss scaling the gradients are "
             "still scaled here (Lightning unscales them first); bf16 and fp32 have no scaler"),
        Hook("module", "configure_gradient_clipping", CALLED, "fit", "after on_before_optimizer_step: (optimizer, "
             "gradient_clip_val=, gradient_clip_algorithm=) with the Trainer's values; the default clips with them",
             "refused when overridden under a strategy whose engine clips inside its own step (DeepSpeed)"),
        Hook("module", "on_train_batch_end", CALLED, "fit", "after the callbacks': (outputs, batch, batch_idx); "
             "the batch's logs reach the loggers after it", _OUTPUTS, args_differ=True),
        Hook("module", "lr_scheduler_step", CALLED, "fit", "(scheduler, metric) where Lightning steps each scheduler "
             "(trainer/hooks.update_lr_schedulers)", "a 'step' scheduler's frequency counts optimizer steps "
             "(Lightning: batches of the epoch)"),
        Hook("module", "on_train_epoch_end", CALLED, "fit", "after the end-of-epoch validation, between the "
             "callbacks that monitor no metric and those that do (EarlyStopping, ModelCheckpoint)"),
        Hook("module", "on_validation_model_zero_grad", CALLED, "fit", "before a validation that falls between "
             "optimizer steps (never inside an accumulation window)"),
        Hook("module", "on_validation_model_eval", CALLED, "any", "first in every validation pass"),
        Hook("module", "on_validation_model_train", CALLED, "any", "last in every validation pass, when overridden "
             "(else each submodule's training flag is restored, as in Lightning)"),
    ]
    + _rows("module", CALLED, "any", "on_validation_start on_validation_epoch_start on_validation_epoch_end "
            "on_validation_end", "in every validation pass, after the callbacks' hook of the same name")
    + _rows("module", CALLED, "any", "on_validation_batch_start on_validation_batch_end", _VAL_BATCH)
    + _rows("module", CALLED, "any", "validation_step", "(batch, batch_idx) under torch.no_grad, in eval mode")
    + _rows("module", CALLED, "any", "teardown", "(stage=...) last, after the datamodule's and the callbacks'")
    + _rows("module", CALLED, "any", "on_save_checkpoint on_load_checkpoint", _SAVE)
    + _rows("module", REFUSED, "", "configure_sharded_model", "Lightning 2.1 renamed it configure_model (and "
            "refuses a module defining both): rename the method")
    + _rows("module", CALLED, "test", "test_dataloader test_step on_test_model_eval on_test_model_train on_test_start "
            "on_test_epoch_start on_test_batch_start on_test_batch_end on_test_epoch_end on_test_end", _TEST)
    + _rows("module", CALLED, "predict", "predict_dataloader predict_step on_predict_model_eval on_predict_start "
            "on_predict_epoch_start on_predict_batch_start on_predict_batch_end on_predict_epoch_end on_predict_end",
            _PREDICT)
    # ---------------------------------------------------------- callbacks
    + _rows("callback", CALLED, "any", "setup", "(trainer, module, stage=...) after the datamodule's setup, before "
            "the module's")
    + _rows("callback", CALLED, "any", "teardown", "(trainer, module, stage=...) after the datamodule's teardown, "
            "before the module's")
    + _rows("callback", CALLED, "fit", "on_fit_start on_train_start on_train_epoch_start on_train_batch_start "
            "on_before_zero_grad on_before_backward on_after_backward on_before_optimizer_step on_train_end "
            "on_fit_end", "before the module's hook of the same name, same arguments after (trainer, module)")
    + [Hook("callback", "on_train_batch_end", CALLED, "fit", "before the module's: (trainer, module, outputs, "
            "batch, batch_idx)", _OUTPUTS, args_differ=True)]
    + _rows("callback", CALLED, "fit", "on_train_epoch_end", "after the end-of-epoch validation; callbacks that "
            "monitor a metric (EarlyStopping, ModelCheckpoint) after the module's on_train_epoch_end, the others "
            "before it")
    + _rows("callback", CALLED, "any", "on_validation_start on_validation_epoch_start on_validation_batch_start "
            "on_validation_batch_end on_validation_epoch_end on_validation_end", "before the module's hook of "
            "the same name")
    + _rows("callback", CALLED, "fit", "on_sanity_check_start on_sanity_check_end", "around the validation "
            "steps fit runs before training (Trainer(num_sanity_val_steps=...))")
    + _rows("callback", CALLED, "any", "on_exception", "(trainer, module, exception) when fit / validate / test / "
            "predict fails, before the datamodule's")
    + _rows("callback", CALLED, "any", "on_save_checkpoint on_load_checkpoint", _SAVE)
    + _rows("callback", CALLED, "test", "on_test_start on_test_epoch_start on_test_batch_start on_test_batch_end "
            "on_test_epoch_end on_test_end", _TEST)
    + _rows("callback", CALLED, "predict", "on_predict_start on_predict_epoch_start on_predict_batch_start "
            "on_predict_batch_end on_predict_epoch_end on_predict_end", _PREDICT)
    # --------------------------------------------------------- datamodule
    + _rows("datamodule", CALLED, "any", "prepare_data", "before the module's, on local rank 0 of each node")
    + _rows("datamodule", CALLED, "any", "setup", "(stage) first, before the callbacks' and the module's")
    + _rows("datamodule", CALLED, "any", "teardown", "(stage) first, before the callbacks' and the module's")
    + _rows("datamodule", CALLED, "fit", "train_dataloader val_dataloader", "instead of the module's, after setup")
    + _rows("datamodule", CALLED, "test", "test_dataloader", _TEST)
    + _rows("datamodule", CALLED, "predict", "predict_dataloader", _PREDICT)
    + _rows("datamodule", CALLED, "any", "on_before_batch_transfer transfer_batch_to_device on_after_batch_transfer",
            _TRANSFER + ", instead of the module's")
    + _rows("datamodule", CALLED, "any", "on_exception", "(exception) after the callbacks' on_exception")
    + _rows("datamodule", CALLED, "fit", "state_dict load_state_dict", "state_dict() is saved in every "
            "checkpoint beside the callbacks' states; load_state_dict(state) when fit resumes from one")
)  # fmt: skip

_BASES = {"module": ModuleHooks, "callback": Callback}


def defines(obj: Any, name: str, owner: str) -> bool:
    """Whether `obj` (of kind `owner`) defines hook `name` itself, not only as the base class's default."""
    fn = getattr(type(obj), name, None)
    if fn is None:
        return False
    base = _BASES.get(owner)
    return base is None or getattr(base, name, None) is not fn


def engine_owns_step(strategy: Any) -> bool:
    """Whether the strategy's engine takes the optimizer step itself, with its own accumulation and clipping
    (DeepSpeed: the one that overrides Strategy.configure_training to receive them)."""
    return type(strategy).configure_training is not Strategy.configure_training


def refuse_unsupported(trainer: Any, module: Any, callbacks: List[Any], datamodule: Any) -> None:
    """Raise naming every REFUSED hook the module, a callback or the datamodule defines, and why."""
    found = []
    for hook in HOOKS:
        objects = {"module": [module], "callback": callbacks, "datamodule": [datamodule]}[hook.owner]
        for obj in objects:
            if obj is not None and hook.status == REFUSED and defines(obj, hook.name, hook.owner):
                found.append(f"{type(obj).__name__}.{hook.name}: {hook.where}")
    if engine_owns_step(trainer.strategy) and defines(module, "configure_gradient_clipping", "module"):
        found.append(
            f"{type(module).__name__}.configure_gradient_clipping: {type(trainer.strategy).__name__}'s engine clips "
            "inside its own step (at the gradient_clip_val it was built with), so a custom rule could not run; "
            "set Trainer(gradient_clip_val=...) instead"
        )
    if found:
        raise TypeError("These Lightning hooks cannot be honoured here, so they are refused:\n  " + "\n  ".join(found))


# ------------------------------------------------------------------ set-up and teardown
def configure_callbacks(trainer: Any) -> None:
    """Merge the module's configure_callbacks() into the Trainer's (same type: replaced); checkpoints last."""
    extra = call_module(trainer, "configure_callbacks") or []
    extra = list(extra) if isinstance(extra, (list, tuple)) else [extra]
    # A plain Callback() is no type to replace (every callback is one), as in Lightning.
    replaced = {
        type(c) for c in trainer.callbacks if type(c) is not Callback and any(isinstance(e, type(c)) for e in extra)
    }
    merged = [c for c in trainer.callbacks if type(c) not in replaced] + extra
    trainer.callbacks = [c for c in merged if not isinstance(c, ModelCheckpoint)] + [
        c for c in merged if isinstance(c, ModelCheckpoint)
    ]


def prepare_and_setup(trainer: Any, stage: str) -> None:
    """prepare_data (datamodule's, then module's: once per node, behind a barrier), then setup(stage):
    the datamodule's, the callbacks', the module's. Loaders are requested after this."""
    strategy, module = trainer.strategy, trainer.module
    forget_callbacks(trainer)  # the callbacks' hooks are looked up afresh for this run (hooks.py)
    attach_datamodule(trainer.datamodule, trainer)  # dm.trainer, before its prepare_data and setup
    for owner in (trainer.datamodule, module):
        if owner is None or not callable(getattr(owner, "prepare_data", None)):
            continue
        per_node = getattr(owner, "prepare_data_per_node", True)
        if (strategy.local_rank if per_node else strategy.global_rank) == 0:
            if owner is module:
                call_module(trainer, "prepare_data")
            else:
                owner.prepare_data()
        strategy.barrier("prepare_data")  # no rank reads what is being prepared before it exists
    call_datamodule(trainer, "setup", stage=stage)
    call_callbacks(trainer, "setup", stage=stage)
    call_module(trainer, "setup", stage=stage)


def teardown(trainer: Any, stage: str) -> None:
    """teardown(stage): the datamodule's, the callbacks', the module's."""
    call_datamodule(trainer, "teardown", stage=stage)
    call_callbacks(trainer, "teardown", stage=stage)
    if trainer.module is not None:
        call_module(trainer, "teardown", stage=stage)


def on_exception(trainer: Any, exc: BaseException) -> None:
    call_callbacks(trainer, "on_exception", exc)
    call_datamodule(trainer, "on_exception", exc)


@contextlib.contextmanager
def running(trainer: Any, stage: str) -> Iterator[None]:
    """An entry point's run: on_exception (callbacks', datamodule's) if it fails, then teardown(stage) always."""
    try:
        yield
    except BaseException as exc:
        on_exception(trainer, exc)
        raise
    finally:
        teardown(trainer, stage)


# ---------------------------------------------------------------------------- batches
def transfer_batch(trainer: Any, batch: Any, dataloader_idx: int = 0) -> Any:
    """on_before_batch_transfer -> transfer_batch_to_device -> on_after_batch_transfer (datamodule's if defined)."""
    dm = trainer.datamodule
    for hook, args in (
        ("on_before_batch_transfer", ()),
        ("transfer_batch_to_device", (trainer.strategy.root_device,)),
        ("on_after_batch_transfer", ()),
    ):
        if dm is not None and callable(getattr(dm, hook, None)):
            batch = getattr(dm, hook)(batch, *args, dataloader_idx)
        else:
            batch = call_module(trainer, hook, batch, *args, dataloader_idx)
    return batch


def record_logs(trainer: Any, batch: Any = None) -> Dict[str, Any]:
    """What the module (or a callback through it) logged since the last call, into the metrics; the step values."""
    return trainer.metrics.record(drain_logs(trainer.module), batch=batch)


def call_both(trainer: Any, hook: str, *args: Any) -> None:
    """The callbacks' hook, then the module's: Lightning's order at almost every point."""
    call_callbacks(trainer, hook, *args)
    call_module(trainer, hook, *args)


def end_train_batch(trainer: Any, output: Any, batch: Any, batch_idx: int, step_logs: Optional[Dict]) -> None:
    """After a training batch, in Lightning's order: the schedulers that step without a metric (after an
    optimizer step; the 'epoch' ones after the epoch's last batch), on_train_batch_end (callbacks', the
    module's), then the step's values to the loggers when due (step_logs not None) with what those hooks logged."""
    if trainer.is_last_microbatch:
        update_lr_schedulers(trainer, "step", plateau=False)
    if batch_idx + 1 >= trainer.num_training_batches:
        update_lr_schedulers(trainer, "epoch", plateau=False)
    call_both(trainer, "on_train_batch_end", output, batch, batch_idx)
    logged = record_logs(trainer, batch)
    if step_logs is not None:
        trainer.log_metrics({**step_logs, **logged, "epoch": float(trainer.current_epoch)})


def end_epoch(trainer: Any, hook: str, suffix: bool = True, monitoring_last: bool = False) -> Dict[str, float]:
    """An epoch's end: its values close (callbacks see them, as in Lightning), the callbacks' `hook`, the
    module's (what it logs joins the epoch), the values to the loggers; returns them.

    monitoring_last: the callbacks that monitor a metric run after the module's hook, not before
    (on_train_epoch_end), so they can monitor what it logged."""
    results = trainer.metrics.finish_epoch(suffix)
    call_callbacks(trainer, hook, monitoring=False if monitoring_last else None)
    call_module(trainer, hook)
    record_logs(trainer)
    results.update(trainer.metrics.finish_epoch(suffix))
    trainer.metrics.reset_metric_objects()  # torchmetrics objects: after the module's hook, which may compute them
    trainer.log_metrics(results)
    if monitoring_last:
        call_callbacks(trainer, hook, monitoring=True)
    return results


def end_train_epoch(trainer: Any) -> None:
    """The end of a training epoch, after its validation: on_train_epoch_end (end_epoch), then the
    schedulers that step on a metric (ReduceLROnPlateau on val_loss)."""
    if math.isinf(trainer.num_training_batches):  # a loader without a length: its last batch was not known
        update_lr_schedulers(trainer, "epoch", plateau=False)
    end_epoch(trainer, "on_train_epoch_end", monitoring_last=True)
    update_lr_schedulers(trainer, "epoch", plateau=True)


# ------------------------------------------------------------------------- validation
def _modes(model: torch.nn.Module) -> Iterator[Tuple[torch.nn.Module, bool]]:
    return ((m, m.training) for m in model.modules())


def enter_validation(trainer: Any) -> List[Tuple[torch.nn.Module, bool]]:
    """Before a validation pass: in fit, between optimizer steps, free the gradients; then eval mode (the
    hooks' defaults or overrides). Returns each submodule's training flag, restored by `leave_validation`."""
    if getattr(trainer, "stage", "fit") == "fit" and trainer.is_last_microbatch:
        call_module(trainer, "on_validation_model_zero_grad")
    modes = list(_modes(trainer.model))
    call_module(trainer, "on_validation_model_eval")
    return modes


def leave_validation(trainer: Any, modes: Optional[List[Tuple[torch.nn.Module, bool]]]) -> None:
    if defines(trainer.module, "on_validation_model_train", "module"):
        call_module(trainer, "on_validation_model_train")
    elif modes is not None:
        for module, training in modes:
            module.training = training
