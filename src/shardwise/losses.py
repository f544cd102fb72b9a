"""Cross entropy for language models whose logits are too large for a float32 copy.

With a 128k vocabulary, (batch * seq) x vocab logits in bf16 are already
gigabytes, and `F.cross_entropy` on them upcast to float32 keeps a float32
log-softmax of the same shape alive until backward. `chunked_cross_entropy`
computes the same mean loss chunk by chunk in float32 and recomputes each
chunk's softmax during backward, so nothing logits-sized is saved beyond the
logits themselves.
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
) -> Tensor:
    """Mean cross entropy over all targets that are not `ignore_index`.

    Args:
        logits: (B, T, V) or (N, V), or a list of (B, t_i, V) chunks along the
            sequence (as produced by a chunked output head), sum t_i == T.
        targets: (B, T) or (N,) class indices.
        chunk_size: rows of the flattened (tokens, V) logits processed at once;
            0 means one plain `F.cross_entropy` call.
        ignore_index: targets with this value contribute neither loss nor count.

    Returns a float32 scalar equal to `F.cross_entropy(logits.float(), targets)`
    up to summation order. Like F.cross_entropy it is NaN when every target is ignored.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0, got {chunk_size}")
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
        return F.cross_entropy(flat_logits.float(), flat_targets, ignore_index=ignore_index)

    total = torch.zeros((), dtype=torch.float32, device=targets.device)
    count = torch.zeros((), dtype=torch.float32, device=targets.device)
    for lg, tg in pairs:
        if lg.size(0) != tg.size(0):
            raise ValueError(f"logits have {lg.size(0)} positions but targets have {tg.size(0)}")
        total = total + _ChunkedCrossEntropySum.apply(lg, tg, chunk_size, ignore_index)
        count = count + (tg != ignore_index).sum()
    return total / count


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum of per-token cross entropy; forward and backward both walk the rows in chunks.

    Saves only the logits (already alive), the targets and one float32
    log-sum-exp per row. The gradient softmax(x) - onehot(target) is rebuilt
    chunk by chunk in backward and written into one tensor of the logits'
    dtype, which is the smallest a gradient of the logits can be.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, targets: Tensor, chunk_size: int, ignore_index: int) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        lse_chunks = []
        for x, t in zip(logits.split(chunk_size), targets.split(chunk_size)):
            x = x.float()
            valid = t != ignore_index
            # Ignored rows gather column 0 and are masked out; other targets are
            # left as they are so out-of-range indices still raise.
            picked = x.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
            lse = torch.logsumexp(x, dim=-1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            lse_chunks.append(lse)
        ctx.save_for_backward(logits, targets, torch.cat(lse_chunks))
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_total: Tensor) -> tuple[Tensor | None, None, None, None]:
        logits, targets, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.empty_like(logits)
        rows = zip(
            logits.split(ctx.chunk_size),
            targets.split(ctx.chunk_size),
            lse.split(ctx.chunk_size),
            grad.split(ctx.chunk_size),
        )
        for x, t, chunk_lse, out in rows:
            valid = t != ctx.ignore_index
            g = torch.exp(x.float() - chunk_lse.unsqueeze(1))
            g.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1), torch.full_like(chunk_lse, -1.0).unsqueeze(1))
            g.mul_((valid.to(g.dtype) * grad_total).unsqueeze(1))
            out.copy_(g)
        return grad, None, None, None
