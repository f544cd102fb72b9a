"""Per-step health: a non-finite loss or gradient stops the run at that step, named.

A NaN that is not caught at its step spreads into every weight, every later
checkpoint and `last.ckpt`, and weeks later nothing says where it began. The
Trainer computes one device-side verdict per optimizer step (the window's
micro-batch losses, one norm per gradient) and the ranks agree on it in the
same tiny all-reduce as the preemption flag; it is read to the host one step
later, or at once where values are read anyway, and always before a checkpoint
is written (trainer/nonfinite.py). Only when it fires does the slow part run:
every rank looks for its first non-finite loss, gradient or parameter, and the
message names the step, the rank and the tensor.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch
from torch import nn

MODES = ("error", "skip", "warn")


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN or infinite; the optimizer step was not taken."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _describe(kind: str, name: str, t: torch.Tensor) -> str:
    nan = int(torch.isnan(t).sum())
    inf = int(torch.isinf(t).sum())
    parts = [f"{nan} NaN" if nan else "", f"{inf} inf" if inf else ""]
    return f"{kind} of {name} ({', '.join(p for p in parts if p)} of {t.numel()} elements)"


def first_nonfinite(model: nn.Module, losses: Iterable[Tuple[int, float]]) -> Optional[str]:
    """The first non-finite thing this rank holds: a micro-batch loss, then a gradient, then a parameter."""
    for batch_idx, value in losses:
        if not torch.isfinite(torch.tensor(value)):
            return f"the loss of batch_idx {batch_idx} ({value})"
    named = list(model.named_parameters())
    for kind, pick in (("the gradient", lambda p: p.grad), ("the parameter", lambda p: p)):
        for name, p in named:
            t = pick(p)
            if t is None:
                continue
            local = _local(t.detach())
            if (
                local.numel()
                and (local.is_floating_point() or local.is_complex())
                and not bool(torch.isfinite(local).all())
            ):
                return _describe(kind, name, local)
    return None
