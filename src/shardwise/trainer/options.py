"""The Trainer options people reach for in their first hour with Lightning, and what each one does here.

- `fast_dev_run` (True or N): N batches (1 for True) of training, validation,
  test and predict, one epoch, no sanity check, no loggers, no checkpoints or
  early stopping: a smoke test of the whole script.
- `num_sanity_val_steps` (N, -1: the whole loader): validation steps run
  before training, so a broken validation_step fails in seconds, not after
  an epoch. Nothing they log reaches the loggers or callback_metrics;
  callbacks see `trainer.sanity_checking`. The default is 0 here (Lightning:
  2): shardwise did not run them before, and a run that resumes would run
  them again at every restart; pass 2 for Lightning's behaviour.
- `overfit_batches` (N or a fraction): train and validate on the same first
  batches of the training loader, unshuffled, epoch after epoch.
- `max_time` ("DD:HH:MM:SS", a dict of timedelta's keywords, or a timedelta):
  training stops after the optimizer step at which rank 0's clock passes it;
  every rank stops at that same step (one scalar all-reduce per step while it
  is set). Without max_epochs it also lifts the default cap of 1000 epochs.
- `min_epochs` / `min_steps`: a stop request (EarlyStopping, max_time,
  on_train_batch_start returning -1) waits until both are reached; max_epochs
  and max_steps still end the run, and a preemption signal still stops it.
- `detect_anomaly`: torch.autograd's anomaly detection during training.
- `estimated_stepping_batches`: the optimizer steps fit will take (the
  OneCycleLR pattern), usable inside configure_optimizers.
- `sync_batchnorm`: every BatchNorm layer becomes torch's SyncBatchNorm
  (statistics over the whole global batch) after configure_model, where
  processes share a batch (DDP, FSDP, DeepSpeed on more than one process);
  on one process nothing changes, as in Lightning. torch's SyncBatchNorm
  runs on CUDA only, so on CPU it is refused before the first step.
- `compile` (not Lightning's; the strategy's option, strategies/compile.py):
  True compiles each repeated block after activation checkpointing and
  before sharding, "model" each network whole; the strategy refuses it
  where its engine cannot compile, before anything runs.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any, Dict, Optional, Union

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from shardwise.data import epoch_length
from shardwise.metrics import MetricStore
from shardwise.trainer.arguments import is_int
from shardwise.trainer.hooks import call_callbacks, call_module
from shardwise.trainer.loaders import length, limit
from shardwise.trainer.validation import run_validation

SANITY_STEPS_DEFAULT = 0  # Lightning's is 2 (see the module docstring)

MaxTime = Union[str, datetime.timedelta, Dict[str, int], None]


def parse_max_time(value: MaxTime) -> Optional[datetime.timedelta]:
    """max_time="DD:HH:MM:SS" | {"hours": 2} | timedelta(...) | None -> a positive timedelta or None."""
    if value is None:
        return None
    try:
        if isinstance(value, datetime.timedelta):
            parsed = value
        elif isinstance(value, dict):
            parsed = datetime.timedelta(**value)
        elif isinstance(value, str):
            days, hours, minutes, seconds = (int(part) for part in value.split(":"))
            parsed = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        else:
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(
            f"Trainer(max_time={value!r}): use 'DD:HH:MM:SS' (e.g. '00:12:00:00'), a dict of timedelta's "
            "keywords ({'hours': 12}), or a datetime.timedelta."
        ) from None
    if parsed.total_seconds() <= 0:
        raise ValueError(f"Trainer(max_time={value!r}): use a positive duration.")
    return parsed


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"Trainer({name}={value!r}): {allowed}.")


def apply(
    trainer: Any,
    fast_dev_run: Union[bool, int],
    num_sanity_val_steps: Optional[int],
    overfit_batches: Union[int, float],
    max_time: MaxTime,
    min_epochs: Optional[int],
    min_steps: Optional[int],
    detect_anomaly: bool,
    limit_test_batches: Union[int, float, None],
    limit_predict_batches: Union[int, float, None],
    compile: Any = None,
) -> None:
    """Check the options and set them on the Trainer (fast_dev_run / overfit_batches override the limits)."""
    trainer.strategy.configure_compile(compile, "Trainer(compile)")
    _check(
        "fast_dev_run",
        fast_dev_run,
        isinstance(fast_dev_run, bool) or (is_int(fast_dev_run) and fast_dev_run >= 0),
        "use True, False, or a number of batches (0 or more)",
    )
    _check(
        "num_sanity_val_steps",
        num_sanity_val_steps,
        num_sanity_val_steps is None or (is_int(num_sanity_val_steps) and num_sanity_val_steps >= -1),
        "use a number of batches (0 or more), -1 for the whole validation loader, or None for 0",
    )
    fraction = isinstance(overfit_batches, float) and 0.0 <= overfit_batches <= 1.0
    _check(
        "overfit_batches",
        overfit_batches,
        fraction or (is_int(overfit_batches) and overfit_batches >= 0),
        "use a number of batches (0 or more) or a fraction of the train loader between 0.0 and 1.0",
    )
    for name, value in (("min_epochs", min_epochs), ("min_steps", min_steps)):
        _check(name, value, value is None or (is_int(value) and value >= 0), "use a whole number, 0 or more, or None")
    for name, value in (("limit_test_batches", limit_test_batches), ("limit_predict_batches", limit_predict_batches)):
        _check(
            name,
            value,
            value is None
            or (is_int(value) and value >= 0)
            or (isinstance(value, float) and not isinstance(value, bool) and 0.0 <= value <= 1.0),
            "use a fraction of the loader between 0.0 and 1.0, a number of batches (0 or more), or None for all",
        )
    if min_steps is not None and trainer.max_steps != -1 and min_steps > trainer.max_steps:
        raise ValueError(
            f"Trainer(min_steps={min_steps}) exceeds max_steps={trainer.max_steps}: nothing could stop it."
        )
    if min_epochs is not None and trainer.max_epochs != -1 and min_epochs > trainer.max_epochs:
        raise ValueError(
            f"Trainer(min_epochs={min_epochs}) exceeds max_epochs={trainer.max_epochs}, which ends the run first."
        )
    trainer.fast_dev_run = fast_dev_run
    trainer.num_sanity_val_steps = SANITY_STEPS_DEFAULT if num_sanity_val_steps is None else num_sanity_val_steps
    trainer.overfit_batches = overfit_batches
    trainer.max_time = parse_max_time(max_time)
    trainer.min_epochs, trainer.min_steps = min_epochs, min_steps
    trainer.detect_anomaly = bool(detect_anomaly)
    trainer.limit_test_batches, trainer.limit_predict_batches = limit_test_batches, limit_predict_batches
    trainer.sanity_checking = False
    trainer.fit_started_at = None  # time.monotonic() when training starts (max_time)
    if overfit_batches:
        for name in ("limit_train_batches", "limit_val_batches"):
            if getattr(trainer, name) is not None:
                raise ValueError(
                    f"Trainer(overfit_batches={overfit_batches!r}) sets {name} itself (to the same batches); "
                    f"leave {name} out."
                )
        trainer.limit_train_batches = trainer.limit_val_batches = overfit_batches
    if fast_dev_run:
        batches = 1 if fast_dev_run is True else int(fast_dev_run)
        trainer.max_steps, trainer.max_epochs = batches, 1
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            setattr(trainer, name, batches)
        trainer.val_check_interval, trainer.check_val_every_n_epoch = None, 1
        trainer.num_sanity_val_steps = 0
        trainer.loggers = []
        # Nothing a smoke test runs is worth keeping or acting on: no checkpoints, no early stop.
        trainer.callbacks = [
            cb for cb in trainer.callbacks if not hasattr(cb, "best_model_path") and not hasattr(cb, "wait_count")
        ]
        if trainer.strategy.is_global_zero:
            print(f"Running with fast_dev_run: {batches} batch(es) of each loop; no loggers, no checkpoints.")


def configure_model(trainer: Any, module: Any) -> None:
    """The module's configure_model, then sync_batchnorm's conversion of the layers it and __init__ built."""
    call_module(trainer, "configure_model")
    if trainer.sync_batchnorm:
        apply_sync_batchnorm(module, trainer.strategy.world_size, trainer.strategy.root_device)


def apply_sync_batchnorm(module: torch.nn.Module, world_size: int, device: torch.device) -> int:
    """Replace every BatchNorm layer below `module` by a SyncBatchNorm (in place); returns how many.

    Nothing to synchronise on one process (Lightning converts nothing there either). torch's
    SyncBatchNorm raises in its first training forward on a CPU tensor, so that is refused here."""
    if world_size <= 1:
        return 0
    batchnorms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not batchnorms:
        return 0
    if device.type == "cpu":
        raise ValueError(
            f"Trainer(sync_batchnorm=True) on CPU: torch's SyncBatchNorm runs on CUDA only (its forward raises "
            f"on CPU tensors), and this module has {len(batchnorms)} BatchNorm layer(s). Use accelerator='cuda', "
            "or sync_batchnorm=False (each process then normalises over its own micro-batch)."
        )
    for name, child in list(module.named_children()):
        setattr(module, name, torch.nn.SyncBatchNorm.convert_sync_batchnorm(child))
    return len(batchnorms)


def train_shuffle(trainer: Any) -> Optional[bool]:
    """overfit_batches trains on the same first batches every epoch: the train loader is not shuffled."""
    return False if trainer.overfit_batches else None


# ---------------------------------------------------------------------------------- during fit
def before_training(trainer: Any) -> None:
    """After on_fit_start: the sanity check, then the clock and anomaly detection for training."""
    sanity_check(trainer)
    trainer.fit_started_at = time.monotonic()
    if trainer.detect_anomaly:
        torch.autograd.set_detect_anomaly(True)


def after_fit(trainer: Any) -> None:
    if trainer.detect_anomaly:
        torch.autograd.set_detect_anomaly(False)


def sanity_check(trainer: Any) -> None:
    """num_sanity_val_steps validation batches before training, with nothing they log kept (Lightning's)."""
    steps = trainer.num_sanity_val_steps
    loader = trainer.val_dataloaders
    if steps == 0 or loader is None or not callable(getattr(trainer.module, "validation_step", None)):
        return
    saved = trainer.limit_val_batches, trainer.metrics, trainer.loggers
    available = limit(trainer.limit_val_batches, length(loader))
    if steps != -1:
        trainer.limit_val_batches = int(min(steps, available)) if math.isfinite(available) else steps
    trainer.metrics, trainer.loggers = MetricStore(), []  # what the sanity steps log is dropped with them
    trainer.sanity_checking = True
    try:
        call_callbacks(trainer, "on_sanity_check_start")
        run_validation(trainer)
        call_callbacks(trainer, "on_sanity_check_end")
    finally:
        trainer.sanity_checking = False
        trainer.limit_val_batches, trainer.metrics, trainer.loggers = saved


def out_of_time(trainer: Any) -> bool:
    """Whether max_time has passed, on rank 0's clock, agreed by every rank (call after each optimizer step)."""
    if trainer.max_time is None or trainer.fit_started_at is None:
        return False
    elapsed = time.monotonic() - trainer.fit_started_at
    over = float(elapsed >= trainer.max_time.total_seconds()) if trainer.strategy.is_global_zero else 0.0
    if trainer.strategy.world_size > 1:
        over = float(trainer.strategy.reduce(torch.tensor(over), "max"))
    return over > 0


_warned_min: Dict[int, bool] = {}


def can_stop(trainer: Any) -> bool:
    """Whether a stop request may end the run now: min_epochs and min_steps reached, or a preemption."""
    if trainer.preempted is not None:
        return True
    epochs_ok = trainer.min_epochs is None or trainer.current_epoch >= trainer.min_epochs
    steps_ok = trainer.min_steps is None or trainer.global_step >= trainer.min_steps
    if not (epochs_ok and steps_ok) and not _warned_min.get(id(trainer)):
        _warned_min[id(trainer)] = True
        trainer.print(
            f"Trainer was asked to stop, but min_epochs={trainer.min_epochs} / min_steps={trainer.min_steps} "
            "are not reached yet: training continues until they are."
        )
    return epochs_ok and steps_ok


def estimated_stepping_batches(trainer: Any, loader: Any) -> Union[int, float]:
    """The optimizer steps fit will take: min(max_steps, epochs x steps per epoch); inf when unbounded.

    Valid from configure_optimizers on (the loaders are resolved before it), for OneCycleLR's total_steps.
    `loader`: the train loader, distributed or not yet (then this rank's share is computed as the
    distributed sampler will make it). Steps per epoch: the epoch's batches (after limit_train_batches)
    over accumulate_grad_batches, a partial window counting as a step, as the loop takes it.
    """
    batches = float("inf")
    if loader is not None:
        world = trainer.strategy.data_parallel_size  # the sampler's replicas (sp/tp groups share a sample)
        dataset = getattr(loader, "dataset", None)
        if (
            world > 1
            and isinstance(loader, DataLoader)
            and not isinstance(loader.sampler, DistributedSampler)
            and not isinstance(dataset, IterableDataset)
        ):
            size = loader.batch_size or 1  # the sampler's shares (data.py): rank 0's is the longest, in batches
            samples = epoch_length(len(loader.sampler), world, size, loader.drop_last)
            batches = math.ceil(math.ceil(samples / world) / size)
        else:
            batches = length(loader)
        batches = limit(trainer.limit_train_batches, batches)
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else float("inf")
    epochs = trainer.max_epochs if trainer.max_epochs != -1 else float("inf")
    total = per_epoch * epochs if per_epoch and epochs else 0
    if trainer.max_steps != -1:
        total = min(total, trainer.max_steps)
    return int(total) if math.isfinite(total) else float("inf")
