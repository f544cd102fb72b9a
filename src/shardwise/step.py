"""The core of one training step, shared by the Trainer and the memory planner.

`Trainer._train_batch` / `_optimizer_step` and the planner's fake-tensor
trace (plan/trace.py) both run these two functions, so a change to how a
micro-batch runs or how the optimizers step changes the prediction with it:

- `forward_backward`: one micro-batch. `training_step` runs through the
  strategy (so wrappers' forward hooks fire) under its autocast, then the
  backward of loss / window (or of loss x loss_scale, for a summed loss the
  Trainer normalises over the global batch: trainer/weighting.py); on a
  non-final micro-batch of an accumulation window the strategy skips the
  gradient communication that can wait.
- `optimizer_update`: for each optimizer, clip (if asked), step, zero the
  gradients (set to None, so their memory is freed before the next forward).

What only the Trainer does -- callbacks, the non-finite check, progress marks,
metrics -- happens in the hooks these functions call (`before_backward`,
`before_step`); the planner uses the same hooks to name the phases it records.
What `self.log` recorded during a step is emptied by the caller
(module.drain_logs): the Trainer turns it into metrics, the planner drops it.
Nothing here imports the module or the run state above it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["forward_backward", "loss_of", "optimizer_update"]


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss in what training_step returned: the tensor, output["loss"], or None (skip the batch)."""
    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    raise TypeError("training_step must return a loss tensor, a dict with a 'loss' key, or None (skip the batch).")


def forward_backward(
    strategy: Any,
    model: nn.Module,
    args: Sequence[Any],
    window: int = 1,
    last: bool = True,
    before_backward: Optional[Callable[[torch.Tensor], None]] = None,
    loss_scale: Optional[torch.Tensor] = None,
) -> Tuple[Any, Optional[torch.Tensor]]:
    """Run `training_step(*args)` and its backward for one micro-batch; return (output, loss).

    window: micro-batches per optimizer step (the loss is divided by it, so the
    accumulated gradient is the window's mean); last: whether this micro-batch
    ends the window (only then is every gradient communicated). loss_scale, when
    given, multiplies the loss instead of the division by window. A None loss
    skips the backward. before_backward(loss) runs between forward and backward.
    """
    with strategy.no_backward_sync(model, enabled=not last):
        with strategy.autocast():
            output = strategy.call(model, "training_step", *args)
        loss = loss_of(output)
        if loss is not None:
            if before_backward is not None:
                before_backward(loss)
            backpropagated = loss
            if loss_scale is not None:
                backpropagated = loss * loss_scale
            elif window > 1:  # x / 1 is x: no extra operation in the graph of a step without accumulation
                backpropagated = loss / window
            strategy.backward(backpropagated, model)
    return output, loss


def optimizer_update(
    strategy: Any,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    gradient_clip_val: Optional[float] = None,
    gradient_clip_algorithm: str = "norm",
    before_step: Optional[Callable[[int, torch.optim.Optimizer], bool]] = None,
) -> bool:
    """Clip, step and zero each optimizer in turn; return False if `before_step` cancelled the update.

    before_step(i, optimizer) runs first for each optimizer; when it returns
    False no further optimizer steps and every optimizer's gradients are
    dropped (a skipped step leaves nothing to accumulate into the next one).
    gradient_clip_algorithm: "norm" (global norm, the strategy's, across
    shards) or "value".
    """
    for i, optimizer in enumerate(optimizers):
        if before_step is not None and not before_step(i, optimizer):
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            return False
        if gradient_clip_val is not None:
            if gradient_clip_algorithm == "norm":
                strategy.clip_gradients(model, optimizer, max_norm=gradient_clip_val)
            else:
                strategy.clip_gradients(model, optimizer, max_value=gradient_clip_val)
        strategy.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    return True
