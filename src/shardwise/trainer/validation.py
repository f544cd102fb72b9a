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
from shardwise.distributed.device import move_to_device
from shardwise.distributed.progress import mark as mark_progress
from shardwise.module import drain_logs, enter_hook
from shardwise.trainer.hooks import call_callbacks, call_module, takes_batch_idx
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
    state.rng_outside_validation = capture_rng_states()
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        with trainer.metrics.separate_epoch():
            call_callbacks(trainer, "on_validation_start")
            call_module(trainer, "on_validation_epoch_start")
            pass_idx = takes_batch_idx(module.validation_step)
            for batch_idx, batch in enumerate(loader):
                if batch_idx >= trainer.num_val_batches:
                    break
                batch = strategy.precision.convert_input(move_to_device(batch, strategy.root_device))
                enter_hook(module, "validation_step")
                mark_progress("validation_step", state.global_step)
                with strategy.autocast():
                    args = (batch, batch_idx) if pass_idx else (batch,)
                    output = strategy.call(trainer.model, "validation_step", *args)
                trainer.metrics.record(drain_logs(module))
                call_callbacks(trainer, "on_validation_batch_end", output, batch, batch_idx)
            call_module(trainer, "on_validation_epoch_end")
            trainer.metrics.record(drain_logs(module))
            results = trainer.metrics.finish_epoch(suffix=False)
            trainer.log_metrics(results)
            call_callbacks(trainer, "on_validation_epoch_end")
            call_callbacks(trainer, "on_validation_end")
    finally:
        restore_rng_states(state.rng_outside_validation)
        state.rng_outside_validation = None
        trainer.validating = False
        trainer.model.train(was_training)
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
