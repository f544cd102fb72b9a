"""Cross entropy for language models whose logits are too large for a float32 copy.

With a 128k vocabulary, (batch * seq) x vocab logits in bf16 are already
gigabytes, and `F.cross_entropy` on them upcast to float32 keeps a float32
log-softmax of the same shape alive until backward. `chunked_cross_entropy`
computes the same loss chunk by chunk in float32 and recomputes each chunk's
softmax during backward, so nothing logits-sized is saved beyond the logits
themselves, and the only logits-sized tensor backward makes is their gradient,
in the logits' dtype. The fine-tuning recipe (recipes/causal_lm.py) trains with
its summed form, and the planner traces the same call for Hugging Face models
(plan/presets.py), so what it predicts is what the recipe allocates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

__all__ = ["chunked_cross_entropy"]


def chunked_cross_entropy(
    logits: Tensor | list[Tensor],
    targets: Tensor,
    chunk_size: int = 128,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Cross entropy over all targets that are not `ignore_index`: their mean, or their sum.

    Args:
        logits: (B, T, V) or (N, V), or a list of (B, t_i, V) chunks along the
            sequence (as produced by a chunked output head), sum t_i == T.
        targets: (B, T) or (N,) class indices.
        chunk_size: rows of the flattened (tokens, V) logits processed at once;
            0 means one plain `F.cross_entropy` call.
        ignore_index: targets with this value contribute neither loss nor count.
        reduction: "mean" (over the targets that count) or "sum" (what a loss normalised
            over a larger batch than this one needs).

    Returns a float32 scalar equal to `F.cross_entropy(logits.float(), targets,
    reduction=reduction)` up to summation order. Like F.cross_entropy the mean is NaN
    when every target is ignored (the sum is 0).
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f'reduction must be "mean" or "sum", got {reduction!r}')
    if isinstance(logits, (list, tuple)):
        sizes = [chunk.size(1) for chunk in logits]
        if sum(sizes) != targets.size(1):
            raise ValueError(f"logit chunks cover {sum(sizes)} positions but targets have {targets.size(1)}")
        pairs = list(zip(logits, targets.split(sizes, dim=1)))
    else:
        pairs = [(logits, targets)]
    pairs = [(lg.reshape(-1, lg.size(-1)), tg.reshape(-1)) for lg, tg in pairs]

    if chunk_size == 0:
        flat_logits = torch.cat([lg for lg, _ in pairs]) if len(pairs) > 1 else pairs[0][0]
        flat_targets = torch.cat([tg for _, tg in pairs]) if len(pairs) > 1 else pairs[0][1]
        return F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=ignore_index, reduction=reduction)

    total = torch.zeros((), dtype=torch.float32, device=targets.device)
    count = torch.zeros((), dtype=torch.float32, device=targets.device)
    for lg, tg in pairs:
        if lg.size(0) != tg.size(0):
            raise ValueError(f"logits have {lg.size(0)} positions but targets have {tg.size(0)}")
        total = total + _ChunkedCrossEntropySum.apply(lg, tg, chunk_size, ignore_index)
        count = count + (tg != ignore_index).sum()
    return total if reduction == "sum" else total / count


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of per-token cross entropy; forward and backward both walk the rows in chunks.

    Saves only the logits (already alive), the targets and one float32
    log-sum-exp per row. The gradient softmax(x) - onehot(target) is rebuilt
    chunk by chunk in backward and written into one tensor of the logits'
    dtype, which is the smallest a gradient of the logits can be.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, targets: Tensor, chunk_size: int, ignore_index: int) -> Tensor:
        # Whatever does not need the whole row of a chunk is done once for all rows: the loop
        # runs two ops per chunk forward and six backward, which also keeps the planner's
        # trace of it (fake tensors, one dispatch per op) fast at 256 chunks and more.
        valid = targets != ignore_index
        # Ignored rows gather column 0 and are masked out; other targets are
        # left as they are so out-of-range indices still raise.
        index = torch.where(valid, targets, 0).unsqueeze(1)
        picked = logits.gather(1, index).squeeze(1).float()  # exact: a float32 copy of the same values
        lse = torch.cat([torch.logsumexp(x.float(), dim=-1) for x in logits.split(chunk_size)])
        total = torch.where(valid, lse - picked, 0.0).sum()
        ctx.save_for_backward(logits, index, valid, lse)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_total: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, index, valid, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.empty_like(logits)
        size = ctx.chunk_size
        scale = (valid.to(torch.float32) * grad_total).unsqueeze(1)
        minus_one = torch.full_like(scale, -1.0)
        rows = zip(
            logits.split(size),
            index.split(size),
            lse.unsqueeze(1).split(size),
            scale.split(size),
            minus_one.split(size),
            grad.split(size),
        )
        for x, idx, chunk_lse, chunk_scale, ones, out in rows:
            # float32 logits: the gradient is computed in place in `grad`; else in one float32 chunk.
            g = out.copy_(x) if out.dtype == torch.float32 else x.float()
            g.sub_(chunk_lse).exp_()  # softmax
            g.scatter_add_(1, idx, ones)  # minus one at the target
            g.mul_(chunk_scale)  # ignored rows: 0
            if g is not out:
                out.copy_(g)
        return grad, None, None, None
