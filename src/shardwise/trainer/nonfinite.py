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
loss is checked then. The same read-back also says whether every rank's
gradients were all zero: a step that trains nothing (a loss multiplied by 0,
LoRA adapters with A and B both zero, frozen layers in the way) is the
silent failure of adapter training, and is treated like a non-finite one
(ZeroGradientError under 'error'), its message saying "zero", not "non-finite".

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
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from shardwise import health
from shardwise.distributed import ops


class ZeroGradientError(RuntimeError):
    """Every trainable gradient of an optimizer step was zero on every rank: the step would train nothing."""


class Verdict(NamedTuple):
    bad: bool  # some rank non-finite, or every gradient zero on every rank
    signalled: bool  # some rank was sent a preemption signal
    loss: Optional[float]  # the sum of the ranks' loss shares, when one was given
    zero_grads: bool  # gradients exist and every one of them is zero, on every rank


def grad_flags(grads: List[Optional[torch.Tensor]]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(any element non-finite, any element non-zero) over this rank's gradients, as 0-dim bool tensors on
    the first gradient's device, from one norm per gradient; None when this rank holds no gradient element."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
    by_device: Dict[Any, List[torch.Tensor]] = {}
    for g in local:
        if g.numel():
            by_device.setdefault((g.device, g.dtype), []).append(g)
    if not by_device:
        return None
    sums = [torch.stack(torch._foreach_norm(group)).float().sum() for group in by_device.values()]
    total = torch.stack([t.to(sums[0].device) for t in sums]).sum()
    return ~torch.isfinite(total), total != 0  # a NaN or inf norm is non-zero too


def agree(
    strategy: Any,
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    signalled: bool,
    loss_share: Optional[torch.Tensor] = None,
) -> Verdict:
    """Whether any rank saw a non-finite loss or gradient, or every rank's gradients are all zero; whether
    any rank was signalled; the sum of the ranks' `loss_share` -- agreed across ranks in one read-back."""
    flags = [~torch.isfinite(torch.stack([t.float().reshape(()) for _, t in losses])).any()] if losses else []
    device = flags[0].device if flags else None
    checked = grad_flags(strategy.gradients(model))
    has_grads, nonzero = (torch.tensor(False), torch.tensor(False)) if checked is None else (True, checked[1])
    # With fp16 loss scaling an inf gradient is the scaler's overflow signal, not an error.
    if checked is not None and getattr(strategy, "grad_scaler", None) is None:
        flags.append(checked[0].to(device) if device is not None else checked[0])
    local = torch.stack(flags).any().float() if flags else torch.zeros(())
    values = [local, torch.tensor(float(signalled), device=local.device)]
    if loss_share is not None:
        values.append(loss_share.detach().float().reshape(()).to(local.device))
    # Folded into the same read-back: "this rank holds gradients" and "one of them is not zero".
    values += [torch.as_tensor(has_grads).float().to(local.device), nonzero.float().to(local.device)]
    both = torch.stack(values)
    if strategy.world_size > 1:
        # The verdicts are 0 or 1, so their sum is positive exactly when their max is; a share is summed.
        both = strategy.reduce(both, "max" if loss_share is None else "sum")
    numbers = both.tolist()
    zero = numbers[-2] > 0 and not numbers[-1] > 0
    return Verdict(numbers[0] > 0 or zero, numbers[1] > 0, numbers[2] if loss_share is not None else None, zero)


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
    verdict = agree(strategy, model, losses, preemption.signalled, share)
    preemption.agreed = verdict.signalled
    if weighting is not None:
        weighting.step_loss = verdict.loss
    if verdict.bad:
        report(model, losses, mode, step, epoch, zero_grads=verdict.zero_grads)
    return not verdict.bad


def _zero_grads_here(model: nn.Module) -> str:
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return f"{len(local)} gradient tensor(s), {sum(g.numel() for g in local):,} element(s) held here, all zero"


def report(
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    mode: str,
    step: int,
    epoch: int,
    zero_grads: bool = False,
) -> None:
    """Name what was non-finite (or that every gradient was zero) on which rank (collective), then raise
    (mode 'error') or warn."""
    if zero_grads:
        reports = ops.all_gather_object(_zero_grads_here(model))
        what = "; ".join(f"rank {r}: {text}" for r, text in enumerate(reports))
        causes = (
            "The loss does not depend on any trainable parameter: it was multiplied by 0, no token of the "
            "step had a label (all -100), the layers between the loss and the trainable parameters are frozen, "
            "or LoRA adapters whose A and B are both zero (PEFT's init_lora_weights=True keeps A random)."
        )
        message = f"Every trainable gradient is zero at optimizer step {step} (epoch {epoch}): {what}."
        if mode == "error":
            raise ZeroGradientError(
                f"{message} The step was not taken (trainer.global_step stays {step - 1}): nothing would be "
                f"trained. {causes} Trainer(non_finite='skip') skips such steps, 'warn' only reports them."
            )
        action = "skipped (no update)" if mode == "skip" else "taken anyway (non_finite='warn')"
        warnings.warn(f"{message} The step was {action}. {causes}", stacklevel=3)
        return
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
