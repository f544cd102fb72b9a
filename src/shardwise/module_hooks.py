"""What every Lightning hook does on a TrainModule that does not override it.

`TrainModule` takes these defaults from `ModuleHooks`, so a Lightning module
that calls `super().optimizer_step(...)`, `self.clip_gradients(...)` inside
its `configure_gradient_clipping`, or relies on `on_validation_model_eval`
putting the model in eval mode behaves as it did under Lightning. The
Trainer decides when each hook runs (trainer/lightning_hooks.py holds the
table of every hook, where it is called or why it is refused); this file
only says what the default does. `LOG_LEVELS` is Lightning's rule for
`self.log` inside each hook: the default (on_step, on_epoch), or None where
logging is refused because nothing would receive the value.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from shardwise.distributed.device import move_to_device

STEP_HOOKS = (
    "training_step",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "optimizer_step",
    "configure_gradient_clipping",
    "clip_gradients",
    "on_before_zero_grad",
    "optimizer_zero_grad",
)
EVALUATION_HOOKS = (
    "validation_step",
    "test_step",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
)
# These run once per epoch: a per-step value would mean nothing, so only on_epoch logging is allowed.
EPOCH_ONLY_HOOKS = (
    "on_train_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_test_start",
    "on_test_epoch_start",
    "on_test_epoch_end",
)
# self.log is refused here, as in Lightning: no step or epoch of a loop is open to receive the value.
NO_LOGGING_HOOKS = (
    "lr_scheduler_step",
    "on_fit_start",
    "on_fit_end",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_end",
    "on_validation_end",
    "on_test_end",
    "on_predict_start",
    "on_predict_end",
    "on_predict_epoch_start",
    "on_predict_epoch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
    "predict_step",
    "on_before_batch_transfer",
    "transfer_batch_to_device",
    "on_after_batch_transfer",
    "on_exception",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "state_dict",
    "load_state_dict",
    "setup",
    "teardown",
    "prepare_data",
    "configure_model",
    "configure_optimizers",
    "configure_callbacks",
    "train_dataloader",
    "val_dataloader",
    "test_dataloader",
    "predict_dataloader",
    "on_validation_model_zero_grad",
    "on_validation_model_eval",
    "on_validation_model_train",
    "on_test_model_eval",
    "on_test_model_train",
    "on_predict_model_eval",
)
# hook -> (default on_step, default on_epoch), or None where self.log is refused.
LOG_LEVELS: Dict[str, Optional[Tuple[bool, bool]]] = {
    **dict.fromkeys(STEP_HOOKS, (True, False)),
    **dict.fromkeys(EVALUATION_HOOKS + EPOCH_ONLY_HOOKS, (False, True)),
    **dict.fromkeys(NO_LOGGING_HOOKS, None),
}


class ModuleHooks:
    """Lightning's default behaviour for every hook the Trainer calls on a module (TrainModule inherits it)."""

    trainer: Any  # TrainModule's property: the Trainer running this module
    clip_gradients: Callable[..., Any]  # TrainModule's: through the strategy, across shards

    # --------------------------------------------------------------- run
    def setup(self, stage: str) -> None:
        """Build what needs the process group or the data (datasets, tokenizers); stage: 'fit', 'validate', ..."""

    def teardown(self, stage: str) -> None: ...
    def prepare_data(self) -> None:
        """Download / tokenise to disk: runs on local rank 0 of each node (global rank 0 when
        `prepare_data_per_node = False`), before any rank's setup()."""

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs; they replace the Trainer's callbacks of the same type."""
        return []

    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        """Return -1 to end the epoch (and the run) here."""
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...

    # ---------------------------------------------------------- validation
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_model_zero_grad(self) -> None:
        """Before validation between optimizer steps: free the gradients (never inside an accumulation window)."""
        self.zero_grad(set_to_none=True)

    def on_validation_model_eval(self) -> None:
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        """Called only when overridden: otherwise each submodule's own training flag is restored."""
        self.trainer.model.train()

    # ----------------------------------------------------- test / predict
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_model_eval(self) -> None:
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        self.trainer.model.train()

    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_model_eval(self) -> None:
        self.trainer.model.eval()

    # --------------------------------------------------------------- batches
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    # ---------------------------------------------------------- optimization
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients complete (accumulated, reduced; still scaled under fp16), not yet clipped: log norms here."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Optional[Callable[[], Any]] = None,
    ) -> None:
        """Step; the closure runs the window's last training_step and backward (call it, or pass it to step)."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip before each optimizer step; the Trainer passes its gradient_clip_val / _algorithm."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # TrainModule's

    def lr_scheduler_step(self, scheduler: Any, metric: Optional[Any]) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None: ...
