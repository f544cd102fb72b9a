"""Optimization as the user's training_step sees it: `self.optimizers()`, and manual optimization.

Lightning's two modes. Automatic (the default): the loop runs backward, clips,
steps and zeroes, and `configure_optimizers` returns ONE optimizer (several
would all step on the same loss: refused, with the fix). Manual
(`automatic_optimization = False` on the module): `training_step` calls
`self.manual_backward(loss)`, `opt.step()` and `opt.zero_grad()` itself, any
number of times and with any number of optimizers (a GAN's generator and
discriminator). What the module reaches through `self.optimizers()` is a
`StepThrough` around each optimizer, whose `step()` goes through the strategy
(the fp16 scaler, DeepSpeed's engine), runs the on_before_optimizer_step hooks
and the non-finite check, and counts `trainer.global_step` (one per optimizer
step, as in Lightning: two optimizers stepping every batch advance it by two).
`manual_backward` goes through the strategy too (precision scaling, FSDP's
reduce-scatter, DeepSpeed's engine; under DDP, which synchronises gradients in
a forward/backward pair that a training_step with several backward passes
does not make, the strategy averages them after each backward itself).
Manual mode leaves LR schedulers to the user (`self.lr_schedulers()`), as
Lightning does, and refuses what the loop would otherwise do for it
(accumulate_grad_batches, gradient_clip_val: use `self.clip_gradients`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch

from shardwise.trainer.hooks import call_callbacks, call_module


class StepThrough:
    """An optimizer whose step() and zero_grad() go through the Trainer (Lightning's LightningOptimizer).

    Everything else (param_groups, state, state_dict, add_param_group, ...) is the optimizer's own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optimization: "UserOptimization") -> None:
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "optimization", optimization)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.optimizer, name, value)

    def __repr__(self) -> str:
        return f"StepThrough({self.optimizer!r})"

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run `closure` (if given: it computes the loss and calls manual_backward), then step through the strategy."""
        return self.optimization.step(self.optimizer, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class UserOptimization:
    """The Trainer's side of `self.optimizers()`, `self.lr_schedulers()`, `self.manual_backward(...)`."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._wrappers: Dict[int, StepThrough] = {}
        self._losses: List[Any] = []  # (batch_idx, loss) given to manual_backward since the last step
        self._toggled: Dict[int, bool] = {}

    # ------------------------------------------------------------ set-up checks
    def check(self, module: Any, optimizers: List[torch.optim.Optimizer]) -> None:
        """Refuse what each mode cannot do, naming the fix (called once the optimizers exist)."""
        trainer = self.trainer
        if module.automatic_optimization:
            if len(optimizers) > 1:
                raise ValueError(
                    f"configure_optimizers() returned {len(optimizers)} optimizers, but with automatic "
                    "optimization one loss is backpropagated and every optimizer would step on it. Either "
                    "return one optimizer (several parameter groups are fine), or optimize manually: set "
                    "`self.automatic_optimization = False` in __init__ and in training_step take "
                    "`opt_a, opt_b = self.optimizers()`, call `self.manual_backward(loss)`, `opt_a.step()` "
                    "and `opt_a.zero_grad()` yourself (docs/trainer.md, 'Manual optimization')."
                )
            return
        refused = []
        if trainer.accumulate_grad_batches != 1:
            refused.append(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} (step every N batches in "
                "training_step instead: `if (batch_idx + 1) % N == 0: opt.step(); opt.zero_grad()`)"
            )
        if trainer.gradient_clip_val is not None:
            refused.append(
                f"gradient_clip_val={trainer.gradient_clip_val} (call `self.clip_gradients(opt, "
                "gradient_clip_val=..., gradient_clip_algorithm=...)` before `opt.step()`)"
            )
        if callable(getattr(module, "loss_weight", None)):
            refused.append("a loss_weight hook (normalise the loss you pass to manual_backward yourself)")
        if refused:
            raise ValueError(
                f"{type(module).__name__} optimizes manually (automatic_optimization = False), where the "
                f"loop runs no backward and takes no step, so it cannot honour: {'; '.join(refused)}."
            )

    # ---------------------------------------------------------------- access
    def optimizers(self, use_wrapper: bool = True) -> Union[Any, List[Any]]:
        """One optimizer, or the list of them, wrapped unless use_wrapper=False (Lightning's use_pl_optimizer)."""
        raw = list(self.trainer.strategy.optimizers)
        if not raw:
            raise RuntimeError("self.optimizers() has nothing to return: configure_optimizers() has not run yet.")
        out = [self._wrap(opt) for opt in raw] if use_wrapper else raw
        return out[0] if len(out) == 1 else out

    def _wrap(self, optimizer: torch.optim.Optimizer) -> StepThrough:
        wrapper = self._wrappers.get(id(optimizer))
        if wrapper is None or wrapper.optimizer is not optimizer:
            wrapper = self._wrappers[id(optimizer)] = StepThrough(optimizer, self)
        return wrapper

    def lr_schedulers(self) -> Union[None, Any, List[Any]]:
        """The LR scheduler, the list of them, or None (in manual mode the user steps them)."""
        schedulers = [entry["scheduler"] for entry in self.trainer.strategy.lr_schedulers]
        if not schedulers:
            return None
        return schedulers[0] if len(schedulers) == 1 else schedulers

    # ------------------------------------------------------- manual optimization
    def training_step(self, args: tuple) -> Any:
        """One batch of a manually optimizing module: training_step runs its own backward and steps."""
        trainer = self.trainer
        strategy, model = trainer.strategy, trainer.model
        # Every backward completes its gradients (DeepSpeed: an accumulation boundary each time).
        with strategy.no_backward_sync(model, enabled=False), strategy.autocast():
            return strategy.call(strategy.manual_model(model), "training_step", *args)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """self.manual_backward(loss): the strategy's backward (scaling, sharded reduction), with the hooks."""
        trainer = self.trainer
        self._require_manual("manual_backward")
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise RuntimeError(
                "manual_backward() got a loss that does not require grad: compute it from the model's output "
                "(not under torch.no_grad(), not detached)."
            )
        call_callbacks(trainer, "on_before_backward", loss)
        call_module(trainer, "on_before_backward", loss)
        self._losses.append((trainer.state.batch_idx, loss.detach()))
        trainer.strategy.manual_backward(loss, trainer.model, *args, **kwargs)
        call_callbacks(trainer, "on_after_backward")
        call_module(trainer, "on_after_backward")

    def step(self, optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]]) -> Any:
        trainer = self.trainer
        output = closure() if closure is not None else None
        if trainer.module is None or trainer.module.automatic_optimization:
            # The loop's own step (an optimizer_step hook calling optimizer.step(closure)): the loop runs
            # the hooks, the check and the count around it.
            trainer.strategy.optimizer_step(optimizer)
            return output
        call_callbacks(trainer, "on_before_optimizer_step", optimizer)
        call_module(trainer, "on_before_optimizer_step", optimizer)
        losses, self._losses = self._losses, []
        if trainer.non_finite != "off" and not self._finite(losses):  # non_finite='skip' and not sound
            optimizer.zero_grad(set_to_none=True)
            return output
        trainer.strategy.optimizer_step(optimizer)
        trainer.state.global_step += 1
        return output

    def _finite(self, losses: List[Any]) -> bool:
        """The automatic loop's check (nonfinite.StepCheck) for a manual step: this step's losses and gradients,
        read a step later unless needed now; False only when non_finite='skip' drops the step."""
        return self.trainer.health.check(self.trainer, losses)

    def clip_gradients(
        self, optimizer: Any, gradient_clip_val: Optional[float] = None, gradient_clip_algorithm: Optional[str] = None
    ) -> Optional[torch.Tensor]:
        """self.clip_gradients(opt, val, algorithm): clip through the strategy (across shards)."""
        if gradient_clip_val is None:
            return None
        optimizer = getattr(optimizer, "optimizer", optimizer)
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={algorithm!r}: use 'norm' or 'value'.")
        strategy, model = self.trainer.strategy, self.trainer.model
        if algorithm == "norm":
            return strategy.clip_gradients(model, optimizer, max_norm=gradient_clip_val)
        return strategy.clip_gradients(model, optimizer, max_value=gradient_clip_val)

    # ------------------------------------------------------------ toggling
    def toggle(self, optimizer: Any) -> None:
        """Only `optimizer`'s parameters require grad until untoggle (Lightning's toggle_optimizer)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for opt in self.trainer.strategy.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in mine:
                        self._toggled.setdefault(id(p), p.requires_grad)
                        p.requires_grad_(False)

    def untoggle(self, optimizer: Any) -> None:
        """Restore requires_grad as it was before toggle()."""
        for opt in self.trainer.strategy.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) in self._toggled:
                        p.requires_grad_(self._toggled.pop(id(p)))

    @contextlib.contextmanager
    def toggled(self, optimizer: Any) -> Iterator[None]:
        self.toggle(optimizer)
        try:
            yield
        finally:
            self.untoggle(optimizer)

    def _require_manual(self, what: str) -> None:
        module = self.trainer.module
        if module is not None and module.automatic_optimization:
            raise RuntimeError(
                f"{what}() is for manual optimization: set `self.automatic_optimization = False` in "
                f"{type(module).__name__}.__init__, or return the loss from training_step and let the "
                "Trainer run backward."
            )
