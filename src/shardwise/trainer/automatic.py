"""Automatic optimization through the module's hooks, in Lightning's order.

A micro-batch that ends an accumulation window goes through the module's
`optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)`: the
closure runs training_step and its backward, and `optimizer.step(closure=...)`
runs the closure, then the Trainer's update (on_before_optimizer_step, the
non-finite check, configure_gradient_clipping, the strategy's step). A
module that overrides optimizer_step (LR warm-up written there, a step
skipped on a condition) is honoured: a step it does not take drops that
window's gradients, and a closure it never calls is an error, as in
Lightning. The other micro-batches of a window run training_step and backward
directly. Around every backward: on_before_zero_grad / optimizer_zero_grad on
a window's first micro-batch, on_before_backward, on_after_backward.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from shardwise.distributed.progress import mark as mark_progress
from shardwise.trainer.hooks import call_callbacks, call_module, module_overrides


class ClosureOptimizer:
    """The optimizer optimizer_step receives (Lightning's LightningOptimizer): step(closure) runs the
    closure, then the Trainer's update; everything else is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, update: Callable[[], None]) -> None:
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_update", update)
        object.__setattr__(self, "stepped", False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.optimizer, name, value)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        result = closure() if closure is not None else None
        object.__setattr__(self, "stepped", True)
        self._update()
        return result


def run(trainer: Any, micro_batch: Callable[[], Any], batch_idx: int, update: Callable[[], None]) -> Any:
    """One micro-batch of automatic optimization; returns training_step's output.

    micro_batch: training_step and its backward (returns the output); update: the optimizer step.
    """
    if not trainer.is_last_microbatch:
        return micro_batch()
    outputs: List[Any] = []

    def closure() -> Optional[torch.Tensor]:
        if outputs:
            raise RuntimeError(
                "optimizer_step ran its closure twice: it runs training_step and backward once per step. "
                "Optimizers that re-evaluate the closure (LBFGS) are not supported."
            )
        outputs.append(micro_batch())
        loss = _loss(outputs[0])
        return None if loss is None else loss.detach()

    optimizers = trainer.strategy.optimizers
    mark_progress("optimizer_step", trainer.state.global_step)
    wrapped = ClosureOptimizer(optimizers[0], update)
    call_module(trainer, "optimizer_step", trainer.current_epoch, batch_idx, wrapped, closure)
    if not outputs:
        raise RuntimeError(
            f"{type(trainer.module).__name__}.optimizer_step did not run its optimizer_closure (it runs "
            "training_step and backward): call optimizer.step(closure=optimizer_closure), or "
            "optimizer_closure() when skipping the step."
        )
    if not wrapped.stepped:  # the module skipped this step: nothing may accumulate into the next window
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
    return outputs[0]


def _loss(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, dict):
        return output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def check_trainable(loss: torch.Tensor, global_step: int, batch_idx: int) -> None:
    """A loss that does not require grad trains nothing: say why it happens, before its backward."""
    if not loss.requires_grad:
        raise RuntimeError(
            f"training_step returned a loss that does not require grad (step {global_step + 1}, "
            f"batch_idx {batch_idx}): nothing can be trained from it. It was computed under "
            "torch.no_grad() or from detached tensors, or every parameter has requires_grad=False. "
            "Return the loss computed from the model's output; return None to skip a batch."
        )


def before_backward(trainer: Any, loss: torch.Tensor, batch_idx: int, window: int, scale: Any = None) -> None:
    """The hooks before a backward: zero-grad ones on a window's first micro-batch, then on_before_backward
    with the loss as it is backpropagated (divided by the window, or scaled to the global batch)."""
    module = trainer.module
    if batch_idx % window == 0:
        for optimizer in trainer.strategy.optimizers:
            call_callbacks(trainer, "on_before_zero_grad", optimizer)
            call_module(trainer, "on_before_zero_grad", optimizer)
            if module_overrides(module, "optimizer_zero_grad") or _may_hold_gradients(optimizer):
                call_module(trainer, "optimizer_zero_grad", trainer.current_epoch, batch_idx, optimizer)
    # The loss as backpropagated is a tensor operation of its own: made only when some hook receives it.
    if module_overrides(module, "on_before_backward") or any(
        callable(getattr(callback, "on_before_backward", None)) for callback in trainer.callbacks
    ):
        backpropagated = loss / window if scale is None else loss * scale
        call_callbacks(trainer, "on_before_backward", backpropagated)
        call_module(trainer, "on_before_backward", backpropagated)


def _may_hold_gradients(optimizer: Any) -> bool:
    """False only when the default optimizer_zero_grad would do nothing: a torch optimizer whose zero_grad is
    torch's own and none of whose parameters holds a gradient (the loop sets them to None after each step).
    An engine's optimizer (DeepSpeed's keeps gradients elsewhere) or an overridden zero_grad is always called."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad:
        return True
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def after_backward(trainer: Any, loss: Optional[torch.Tensor]) -> None:
    if loss is not None:  # a None loss skipped the backward
        call_callbacks(trainer, "on_after_backward")
        call_module(trainer, "on_after_backward")


def clip(trainer: Any, optimizer: torch.optim.Optimizer) -> None:
    """The module's configure_gradient_clipping(optimizer, ...) with the Trainer's clip value and algorithm."""
    call_module(
        trainer,
        "configure_gradient_clipping",
        optimizer,
        gradient_clip_val=trainer.gradient_clip_val,
        # None without clipping, as Lightning passes it (its Trainer has no default algorithm)
        gradient_clip_algorithm=trainer.gradient_clip_algorithm if trainer.gradient_clip_val is not None else None,
    )
