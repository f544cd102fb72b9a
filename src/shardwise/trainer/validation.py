"""One validation pass: validation_step over the validation loader, without gradients.

It runs between training steps (every `val_check_interval` batches, or at the
end of every `check_val_every_n_epoch` epochs) and from Trainer.validate().
Two things keep training unaffected by when or how often it runs: its epoch
metrics accumulate apart from training's, and it runs on a copy of the random
generators (its DataLoader draws a seed, user code may draw more), so a
resumed run draws the same numbers as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from shardwise.checkpoint.rng import capture_rng_states, restore_rng_states
from shardwise.distributed.progress import mark as mark_progress
from shardwise.module import enter_hook
from shardwise.trainer import lightning_hooks
from shardwise.trainer.hooks import takes_batch_idx
from shardwise.trainer.loaders import length, limit


@torch.no_grad()
def run_validation(trainer: Any) -> Dict[str, float]:
    """Validate `trainer.model` on `trainer.val_dataloaders`; return (and log) the epoch metrics."""
    module, strategy, state = trainer.module, trainer.strategy, trainer.state
    if not callable(getattr(module, "validation_step", None)):
        return {}
    loader = trainer.val_dataloaders
    trainer.num_val_batches = limit(trainer.limit_val_batches, length(loader))
    if trainer.num_val_batches == 0:
        return {}
    trainer.validating = True
    if getattr(trainer, "stage", "fit") == "validate":
        trainer.metrics.clear()  # trainer.validate()'s metrics are its own, as in Lightning
    state.rng_outside_validation = capture_rng_states()
    modes = None
    try:
        # Lightning's order: the model-mode hooks, then callbacks' hook before the module's at every point.
        modes = lightning_hooks.enter_validation(trainer)
        with trainer.metrics.separate_epoch():
            lightning_hooks.call_both(trainer, "on_validation_start")
            lightning_hooks.call_both(trainer, "on_validation_epoch_start")
            pass_idx = takes_batch_idx(module.validation_step)
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= trainer.num_val_batches:
                    break
                batch = lightning_hooks.transfer_batch(trainer, strategy.precision.convert_input(batch))
                lightning_hooks.call_both(trainer, "on_validation_batch_start", batch, batch_idx)
                enter_hook(module, "validation_step")
                mark_progress("validation_step", state.global_step)
                with strategy.autocast():
                    args = (batch, batch_idx) if pass_idx else (batch,)
                    output = strategy.call(trainer.model, "validation_step", *args)
                lightning_hooks.record_logs(trainer, batch)
                lightning_hooks.call_both(trainer, "on_validation_batch_end", output, batch, batch_idx)
                lightning_hooks.record_logs(trainer, batch)
            # Lightning's names: `name_epoch` for a value logged per step too, `name` for one logged per epoch only
            results = lightning_hooks.end_epoch(trainer, "on_validation_epoch_end")
            lightning_hooks.call_both(trainer, "on_validation_end")
    finally:
        restore_rng_states(state.rng_outside_validation)
        state.rng_outside_validation = None
        trainer.validating = False
        lightning_hooks.leave_validation(trainer, modes)
    return results


def validation_due(trainer: Any, batches_done: int) -> bool:
    """Whether val_check_interval asks for a validation pass after `batches_done` training batches."""
    interval = trainer.val_check_interval
    if interval is None:
        return False
    if not isinstance(interval, int) and not trainer.is_last_microbatch:
        return False  # a float interval validates only between optimizer steps, never mid-window
    if isinstance(interval, float) and interval <= 1.0:
        every = max(1, int(trainer.num_training_batches * interval))
    else:
        every = int(interval)  # every N training batches, as in Lightning
    return batches_done % every == 0


def validation_due_at_epoch_end(trainer: Any) -> bool:
    """Whether this epoch ends with a validation pass (no batch interval set; every n-th epoch)."""
    return (
        trainer.val_dataloaders is not None
        and trainer.val_check_interval is None
        and (trainer.current_epoch + 1) % trainer.check_val_every_n_epoch == 0
    )
