"""The check before every optimizer step: are this step's losses and gradients finite on every rank?

One small all-reduce per step carries two verdicts: "some rank saw a NaN/inf"
and "some rank was sent a preemption signal", so that every rank skips, stops
or saves at the same step without a second collective; for a module with
`loss_weight` it also sums the ranks' shares of the step's mean loss
(weighting.py), which is then known without a collective of its own. What
happens to a non-finite step is Trainer(non_finite=...): 'error' stops there,
naming the rank, the step and the tensor; 'skip' drops the step (as
GradScaler does); 'warn' reports it and takes the step anyway. With fp16
loss scaling an inf gradient is the scaler's overflow signal, so only the
loss is checked then.

Numbers in shardwise's messages follow one convention (issue 26): "step N"
is the optimizer step after which trainer.global_step reads N, the step the
loggers record its values at (the first is step 1), so a check made during
step N, before its update, finds trainer.global_step at N - 1 and says so;
"after step N" is where a rank is while trainer.global_step reads N;
"batch_idx i" is the index the batch hooks receive (0-based in the epoch),
and "epoch e" is trainer.current_epoch.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from shardwise import health
from shardwise.distributed import ops


def agree(
    strategy: Any,
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    signalled: bool,
    loss_share: Optional[torch.Tensor] = None,
) -> Tuple[bool, bool, Optional[float]]:
    """(any rank non-finite, any rank signalled, sum of the ranks' `loss_share` or None), agreed across
    ranks in one read-back."""
    flags = [~torch.isfinite(torch.stack([t.float().reshape(()) for _, t in losses])).any()] if losses else []
    scaled = getattr(strategy, "grad_scaler", None) is not None
    grad_flag = None if scaled else health.nonfinite_norm_flag(strategy.gradients(model))
    if grad_flag is not None:
        flags.append(grad_flag.to(flags[0].device) if flags else grad_flag)
    local = torch.stack(flags).any().float() if flags else torch.zeros(())
    values = [local, torch.tensor(float(signalled), device=local.device)]
    if loss_share is not None:
        values.append(loss_share.detach().float().reshape(()).to(local.device))
    both = torch.stack(values)
    if strategy.world_size > 1:
        # The verdicts are 0 or 1, so their sum is positive exactly when their max is; a share is summed.
        both = strategy.reduce(both, "max" if loss_share is None else "sum")
    numbers = both.tolist()
    return numbers[0] > 0, numbers[1] > 0, (numbers[2] if loss_share is not None else None)


def check_step(
    strategy: Any,
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    preemption: Any,
    weighting: Any,
    mode: str,
    step: int,
    epoch: int,
) -> bool:
    """Whether this step's losses and gradients are finite on every rank; acts on `mode` if not.

    The same read-back carries the preemption vote (the watch takes the agreed answer) and, for a
    module with loss_weight, the step's global mean loss (the weighting takes it).
    """
    share = weighting.local_loss if weighting is not None else None
    bad, preemption.agreed, step_loss = agree(strategy, model, losses, preemption.signalled, share)
    if weighting is not None:
        weighting.step_loss = step_loss
    if bad:
        report(model, losses, mode, step, epoch)
    return not bad


def report(model: nn.Module, losses: List[Tuple[int, torch.Tensor]], mode: str, step: int, epoch: int) -> None:
    """Name what was non-finite on which rank (collective), then raise (mode 'error') or warn."""
    found = health.first_nonfinite(model, [(i, float(t)) for i, t in losses])
    reports = ops.all_gather_object(found)
    named = [f"rank {r}: {what}" for r, what in enumerate(reports) if what]
    what = "; ".join(named) or "a non-finite value on another rank"
    if mode == "error":
        raise health.NonFiniteError(
            f"Non-finite values at optimizer step {step} (epoch {epoch}): {what}. The step was not "
            f"taken (trainer.global_step stays {step - 1}) and nothing after the last checkpoint was saved. "
            "Lower the learning rate, clip gradients "
            "(gradient_clip_val), check the data of that batch, or use bf16 instead of fp16; "
            "Trainer(non_finite='skip') skips such steps, 'warn' only reports them."
        )
    action = "skipped (no update)" if mode == "skip" else "taken anyway (non_finite='warn')"
    warnings.warn(f"Non-finite values at optimizer step {step}: {what}. The step was {action}.", stacklevel=3)
