"""A summed loss normalised over the global batch, for a module that defines `loss_weight(batch)`.

A module whose training_step returns a SUMMED loss (over tokens, labels, ...)
and whose `loss_weight(batch)` says how many items that sum covers gets, at
every optimizer step, the gradient of the mean over the whole global batch:
every micro-batch of the accumulation window on every data-parallel rank.
Averaging each micro-batch's mean instead weighs a micro-batch of 3 items as
much as one of 40, so the step would change with the batch size, the
accumulation and the number of ranks.

How: when the loop asks for the first micro-batch of a window, `batches`
takes the window's micro-batches from the loader at once (the same ones, a
few micro-batches early, as the batches the loader yields), sums their
weights and all-reduces that one number: the step's global weight G (one
scalar all-reduce per optimizer step; none on one process). Each
micro-batch's loss is multiplied by strategy.gradient_sum_scale / G before
its backward: the strategy's own averaging over ranks is undone, the window's
micro-batches add up, and the gradient at the step is the gradient of (sum of
every item's loss) / G. The step's global mean loss is the sum over ranks of
each rank's summed losses / G; the Trainer's health-check all-reduce carries
it (nonfinite.agree), so logging it costs no collective of its own.

An epoch that does not divide over the ranks leaves a rank one batch short;
the sampler gives it a batch of one repeated sample (data.ResumableSampler),
which counts here with weight zero and a loss scale of zero: every sample of
the epoch counts once, and N ranks give the one-process step.

Resume stays exact: nothing is taken from the loader before the loop asks for
a window's first batch (a checkpoint, saved after an optimizer step, finds
the loader where the loop without prefetching leaves it), and nothing once
the loop is done (max_steps, a stop request, the epoch's last batch).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable, Iterator, List, Optional

import torch

from shardwise.data import find_sampler
from shardwise.module import LoggedValue

LOSS_METRIC = "train_loss"  # the step's global mean loss, as the Trainer logs it


def maybe_build(module: Any, strategy: Any, loader: Any = None) -> Optional["StepWeighting"]:
    """A StepWeighting when the module defines `loss_weight`, else None (the loss is a mean: as always).
    `loader`: the train loader, whose sampler says which batch of the epoch is a padding repeat."""
    loss_weight = getattr(module, "loss_weight", None)
    if not callable(loss_weight):
        return None
    sampler = find_sampler(loader)
    padded = sampler.padded_batch if sampler is not None and sampler.padding else None
    return StepWeighting(loss_weight, strategy, padded)


class StepWeighting:
    """The current optimizer step's global weight, the loss scale it gives, and the step's mean loss."""

    def __init__(
        self, loss_weight: Callable[[Any], Any], strategy: Any, padded: Optional[Callable[[int], bool]] = None
    ) -> None:
        self.loss_weight = loss_weight
        self.strategy = strategy
        self.padded = padded  # batch_idx -> whether that batch is the sampler's padding repeat (weight zero)
        self._scales: Any = None  # (loss_scale, inverse) of the step's real micro-batches
        self.total: Optional[torch.Tensor] = None  # G: sum of loss_weight over the step, all ranks
        self.loss_scale: Optional[torch.Tensor] = None  # gradient_sum_scale / G, what each loss is multiplied by
        self.inverse: Optional[torch.Tensor] = None  # 1 / G (0 when G is 0: nothing to average)
        self.local_loss: Optional[torch.Tensor] = None  # this rank's summed losses of the step / G
        self.step_loss: Any = None  # the step's global mean loss (a float, or a device value), once agreed

    def batches(
        self, loader_iter: Iterable, state: Any, window: int, num_batches: float, stop: Callable[[], bool]
    ) -> Iterator[Any]:
        """The loader's batches, each window taken whole when its first batch is asked for.

        A window ends where the loop's does (trainer.is_last_microbatch): at a
        multiple of `window` batches into the epoch, at `num_batches`, or where
        the loader ends. `state.batch_idx` is the loop's position (a resumed
        run may start inside a window); `stop()` says the loop takes no more.
        """
        iterator = iter(loader_iter)
        while not stop():
            first = state.batch_idx
            size = window - first % window
            if math.isfinite(num_batches):
                size = min(size, int(num_batches) - first)
            taken = list(itertools.islice(iterator, max(size, 0)))
            if not taken:
                return
            padding = [self.padded is not None and self.padded(first + i) for i in range(len(taken))]
            self.begin(taken, padding)
            for batch, repeat in zip(taken, padding):
                self._for_batch(repeat)  # read by the loop as it trains this batch
                yield batch

    def begin(self, window: List[Any], padding: Optional[List[bool]] = None) -> None:
        """Start a step over `window` (this rank's micro-batches; `padding` marks the sampler's repeats,
        which weigh nothing): agree on G across ranks."""
        local = torch.zeros((), dtype=torch.float64)
        for batch, repeat in zip(window, padding or [False] * len(window)):
            if repeat:
                continue
            weight = self.loss_weight(batch)
            # A tensor stays where it is (a CUDA count is not read back here); a number is a CPU scalar.
            local = local + (
                weight.detach().double().reshape(()) if isinstance(weight, torch.Tensor) else float(weight)
            )
        strategy = self.strategy
        total = strategy.reduce(local, "sum") if strategy.world_size > 1 else local
        total = total.to(strategy.root_device)
        # An empty step (every item masked) has summed losses of 0: its gradient is 0, not 0 / 0.
        self.inverse = torch.where(total > 0, 1.0 / total.clamp_min(1e-300), torch.zeros_like(total)).float()
        self.loss_scale = self.inverse * strategy.gradient_sum_scale
        self.total = total
        self._scales = (self.loss_scale, self.inverse)
        self.local_loss = torch.zeros((), device=strategy.root_device)
        self.step_loss = None

    def _for_batch(self, repeat: bool) -> None:
        """The loss scale and share of the batch about to be trained: zero for a padding repeat."""
        scale, inverse = self._scales
        self.loss_scale, self.inverse = (torch.zeros_like(scale), torch.zeros_like(inverse)) if repeat else self._scales

    def add(self, loss: torch.Tensor) -> None:
        """Count one micro-batch's summed loss (before its backward) in this rank's share of the step's mean."""
        self.local_loss = self.local_loss + loss.detach().float() * self.inverse

    def logs(self, due: bool) -> List[LoggedValue]:
        """The step's global mean loss as the Trainer logs it: every step when the health check agreed on
        it, else (non_finite="off") only when a log line is `due`, in one all-reduce of its own."""
        if self.step_loss is None and due:
            share = self.local_loss
            self.step_loss = float(self.strategy.reduce(share, "sum") if self.strategy.world_size > 1 else share)
        if self.step_loss is None:
            return []
        # The health check leaves it on the device (read with the step's other values, when logged).
        value = self.step_loss if isinstance(self.step_loss, torch.Tensor) else torch.tensor(self.step_loss)
        return [LoggedValue(LOSS_METRIC, value, True, True, False, False, "mean", None)]
