"""The Trainer: `from shardwise.trainer import Trainer` (also `shardwise.Trainer`).

- loop.py: the Trainer and its loop, to read top to bottom: fit() -> set-up
  -> epochs -> micro-batches -> optimizer steps -> validation, checkpoints.
- arguments.py: the arguments checked when the Trainer is built, and
  Lightning 1.x spellings mapped onto today's.
- setup.py: launching the workers, building the model on the strategy, the
  optimizers, the default callbacks and loggers.
- loaders.py: where the loaders come from and how many batches the loop takes.
- validation.py: one validation pass, apart from training's metrics and RNG.
- nonfinite.py: the NaN/inf check before every optimizer step.
- weighting.py: a summed loss (a module's `loss_weight`) normalised over each
  optimizer step's global batch, its window of micro-batches taken together.
- preemption.py: a stop signal turned into one step at which every rank stops.
- hooks.py: calling callbacks, the module's hooks and the LR schedulers.
- lightning_hooks.py: the table of every Lightning hook (called where
  Lightning calls it, or refused by name) and the calling sequences.
- automatic.py: automatic optimization through the module's optimizer_step,
  its closure and the zero-grad / backward / clipping hooks.
- manual.py: `self.optimizers()` and manual optimization (manual_backward,
  the user's optimizer steps), and the refusal of several optimizers otherwise.
- evaluation.py: trainer.test and trainer.predict.
- options.py: fast_dev_run, the sanity check, overfit_batches, max_time,
  min_epochs / min_steps, detect_anomaly, estimated_stepping_batches.

Nothing below this package imports it: the Trainer hands the lower layers
(strategies, checkpoint, plan) what they need and applies what they return.
"""

from shardwise.trainer.loop import Trainer

__all__ = ["Trainer"]
