# Built-in callbacks. Callbacks are duck-typed: the Trainer calls
# `getattr(cb, hook)(trainer, module, ...)` for every callback that defines the hook,
# so a user callback is any object with some of the hook methods; subclassing
# `Callback` (Lightning's hook names and signatures, all no-ops) is optional.
# trainer/lightning_hooks.py lists every hook, where it is called or why it is refused.
# Every name `lightning.pytorch.callbacks` exports can be imported from here: the ones
# shardwise does not provide refuse at construction, saying why and what to use instead,
# rather than run as a silent no-op that would change what a script computes.
from typing import Any, Callable

from shardwise.callbacks.base import Callback
from shardwise.callbacks.checkpoint import ModelCheckpoint
from shardwise.callbacks.device_stats import DeviceStatsMonitor
from shardwise.callbacks.early_stopping import EarlyStopping
from shardwise.callbacks.fingerprint import BatchFingerprint
from shardwise.callbacks.lr_monitor import LearningRateMonitor
from shardwise.callbacks.model_summary import ModelSummary, RichModelSummary
from shardwise.callbacks.progress import RichProgressBar, TQDMProgressBar
from shardwise.callbacks.throughput import ThroughputMonitor
from shardwise.utilities.refusal import build_refused_class


class LambdaCallback(Callback):
    """A callback made of functions: LambdaCallback(on_train_epoch_end=lambda trainer, module: ...)."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, fn in hooks.items():
            if not callable(getattr(Callback, name, None)) or name.startswith("_"):
                raise TypeError(f"LambdaCallback({name}=...): {name!r} is not a hook of Callback.")
            if not callable(fn):
                raise TypeError(f"LambdaCallback({name}={fn!r}): pass a function.")
            setattr(self, name, fn)


_HERE = "shardwise.callbacks"
_NOT_PROVIDED = {
    "ProgressBar": "the progress bar is RichProgressBar; a custom one is any Callback with `is_progress_bar = True` "
    "(the Trainer then adds none of its own).",
    "Checkpoint": "ModelCheckpoint is the checkpoint callback; subclass it, or Callback for your own.",
    "OnExceptionCheckpoint": "a preemption signal saves a checkpoint and exits 75 (Trainer(preemption_signals=...)); "
    "ModelCheckpoint(save_last=True) keeps the last step.",
    "Timer": "use Trainer(max_time='DD:HH:MM:SS') to stop after a duration.",
    "SpikeDetection": "Trainer(non_finite='error' | 'skip' | 'warn') stops, skips or reports a NaN / inf loss.",
    "GradientAccumulationScheduler": "accumulation is fixed for a run: Trainer(accumulate_grad_batches=N); "
    "change it by resuming a checkpoint with another value.",
    "StochasticWeightAveraging": "average the weights yourself with torch.optim.swa_utils.AveragedModel in "
    "on_train_batch_end (and update_bn after fit).",
    "WeightAveraging": "average the weights yourself with torch.optim.swa_utils.AveragedModel in on_train_batch_end.",
    "EMAWeightAveraging": "keep an EMA yourself with torch.optim.swa_utils.AveragedModel(model, "
    "multi_avg_fn=get_ema_multi_avg_fn(decay)) in on_train_batch_end.",
    "ModelPruning": "apply torch.nn.utils.prune in a callback of your own.",
    "BackboneFinetuning": "freeze layers yourself (requires_grad_(False)) in on_train_epoch_start, and add their "
    "parameters to the optimizer when unfreezing.",
    "BaseFinetuning": "freeze layers yourself (requires_grad_(False)) in on_train_epoch_start.",
    "BatchSizeFinder": "the memory planner suggests a batch split that fits: Trainer(device_memory='80GiB') or "
    "`shardwise plan`.",
    "LearningRateFinder": "run a short fit with a rising LR (torch.optim.lr_scheduler.LambdaLR) and pick the LR "
    "from the logged losses.",
    "BasePredictionWriter": "trainer.predict returns the predictions; write them in on_predict_batch_end of a "
    "Callback of your own.",
}
for _name, _reason in _NOT_PROVIDED.items():
    globals()[_name] = build_refused_class(_name, _HERE, _reason)

__all__ = [
    "BatchFingerprint",
    "Callback",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "RichModelSummary",
    "RichProgressBar",
    "TQDMProgressBar",
    "ThroughputMonitor",
    *_NOT_PROVIDED,
]
