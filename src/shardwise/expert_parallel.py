"""Mixture-of-experts arithmetic shared by every MoE model here: token dispatch, the experts' compute, router losses.

Experts are stored stacked, in transformers 5.x's fused layout (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], gate first), so one `experts_forward` serves the bundled GPT-MoE and Hugging Face's
Qwen3-MoE / Mixtral experts alike. Under expert parallel each rank of an ep group holds E / ep whole
experts (a DTensor Shard(0) on the ep mesh, strategies/experts.py places it): a token's hidden state is
sent to the rank holding each expert it was routed to by one all-to-all with uneven splits (the counts are
exchanged first: nothing is padded or dropped), computed there, and sent back by a second all-to-all;
the routing weights are applied on the token's own rank. Both all-to-alls are differentiable (backward is
the reverse exchange). Without a group the same code computes every expert locally, so one process and ep
ranks run the same arithmetic. `router_losses` computes the load-balancing and z losses over the global
batch: tokens per expert are all-reduced (detached) over the data-parallel ranks, and the losses are
returned SUMMED over this rank's tokens, to be added to a summed main loss that the Trainer divides by the
step's global token count (TrainModule.loss_weight), so the same global batch gives the same step at any
data-parallel / ep split with the same accumulation. `ExpertLoad` keeps the per-expert token counts for
logging (callbacks/expert_load.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ExpertLoad",
    "RouterLosses",
    "all_to_all",
    "experts_forward",
    "grouped_mlp",
    "is_experts",
    "local_weight",
    "router_losses",
]


def is_experts(module: Any) -> bool:
    """Whether `module` holds stacked experts in the fused layout: 3-D gate_up_proj and down_proj, same E."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.nn.Parameter)
        and isinstance(down, torch.nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[0] == down.shape[0]
    )


def local_weight(weight: Tensor) -> Tensor:
    """This rank's experts of a stacked weight: a DTensor's local rows (differentiable), a tensor as it is."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if callable(to_local) else weight


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits along dim 0; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: List[int], in_splits: List[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Optional[Tensor], None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group: Any) -> Tensor:
    """Send rows [sum(in_splits[:j]), ...) of `x` to rank j of `group`; receive out_splits[j] rows from each."""
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def grouped_mlp(x: Tensor, counts: Sequence[int], gate_up: Tensor, down: Tensor, act: Callable) -> Tensor:
    """SwiGLU-style experts on rows grouped by expert (`counts[j]` rows for local expert j), fused layout.

    gate_up [E, 2I, H] (gate rows first), down [E, H, I]: act(x W_gate^T) * (x W_up^T) W_down^T, as
    transformers' fused experts compute. An expert without a row still takes part (its gradient is zero)."""
    out = []
    start = 0
    for j, (w1, w2) in enumerate(zip(gate_up.unbind(0), down.unbind(0))):
        rows = x[start : start + counts[j]]
        start += counts[j]
        gate, up = F.linear(rows, w1).chunk(2, dim=-1)
        out.append(F.linear(act(gate) * up, w2))
    return torch.cat(out, dim=0) if out else x[:0]


def experts_forward(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    num_experts: int,
    act: Callable = F.silu,
    group: Any = None,
) -> Tensor:
    """Every token through its top-k experts, weighted: hidden [N, H], top_k_index / top_k_weights [N, K] -> [N, H].

    gate_up / down: the stacked weights (a DTensor sharded over the ep mesh, or every expert); group: the
    ep process group (None: every expert is here). Rows are sorted by expert (so by the rank that holds
    it), the per-expert counts are exchanged, the rows travel by one all-to-all, are grouped by local
    expert, computed, and travel back; the weights are applied here."""
    gate_up, down = local_weight(gate_up), local_weight(down)
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden.index_select(0, order // k)
    counts = torch.bincount(flat, minlength=num_experts)
    ep = 1 if group is None else dist.get_world_size(group)
    if ep == 1:
        y = grouped_mlp(rows, counts.tolist(), gate_up, down, act)
    else:
        local = num_experts // ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # [src, local expert]: rows each rank sends me
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = all_to_all(rows, recv, send, group)  # grouped by source rank, then by expert
        expert_of_row = (
            torch.arange(ep * local, device=flat.device).remainder(local).repeat_interleave(received.reshape(-1))
        )
        by_expert = torch.argsort(expert_of_row, stable=True)
        computed = grouped_mlp(arrived.index_select(0, by_expert), received.sum(0).tolist(), gate_up, down, act)
        y = all_to_all(computed.index_select(0, torch.argsort(by_expert)), send, recv, group)
    y = y.index_select(0, torch.argsort(order)).view(n, k, -1)
    return (y * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(1).to(hidden.dtype)


@dataclass
class RouterLosses:
    """What `router_losses` returns: the two losses summed over this rank's tokens, and the global counts.

    balance: num_experts x sum_e f_e x (this rank's sum of the router probability of e over its tokens),
        f_e the fraction of the global micro-batch's routed tokens that went to expert e, averaged over
        the layers. Summed over ranks and divided by the step's global token count it is the usual
        load-balancing loss of the global batch (HF's load_balancing_loss_func, Switch's auxiliary loss).
    z: sum over this rank's tokens of logsumexp(router logits)^2, averaged over the layers (ST-MoE's z-loss).
    counts: [layers, E] tokens routed to each expert over the data-parallel ranks (detached), one row per
        layer (an entry of `rows_per_token` concatenated layers gives that many rows).
    tokens: routed tokens over the data-parallel ranks (detached), per layer.
    """

    balance: Tensor
    z: Tensor
    counts: Tensor
    tokens: Tensor


def router_losses(
    layers: Sequence[Tuple[Tensor, Tensor]],
    num_experts: int,
    group: Any = None,
    mask: Optional[Tensor] = None,
    rows_per_token: int = 1,
) -> RouterLosses:
    """Global-batch router losses of one micro-batch from each MoE layer's (router logits [n, E], top_k_index [n, K]).

    group: the ranks that read different tokens (None: the whole world when a process group is up, i.e.
    data-parallel, ep and sp ranks together; pass the data-parallel group under tensor parallel, whose
    ranks hold the same tokens). mask [n]: rows that count (False: padding). rows_per_token: how many rows
    one token has in each entry (a Hugging Face model's layers concatenated into one entry, layer after
    layer: their number), so the losses stay per token; the counts are still kept per layer (`counts` has
    one row per layer of every entry). One all-reduce of [layers, E + 1] counts per micro-batch."""
    count_rows, prob_sums, z_sums, spans = [], [], [], []
    for logits, top_k_index in layers:
        logits = logits.float()
        keep = None if mask is None else mask.reshape(-1).to(torch.bool)
        start = len(count_rows)
        for part, kept in _per_layer(top_k_index, keep, rows_per_token):
            chosen = part if kept is None else part[kept]
            counted = torch.bincount(chosen.reshape(-1), minlength=num_experts).to(torch.float64)
            tokens = torch.tensor([float(chosen.shape[0])], dtype=torch.float64, device=counted.device)
            count_rows.append(torch.cat([counted, tokens]))
        spans.append((start, len(count_rows)))
        probs = logits.softmax(dim=-1)
        lse = torch.logsumexp(logits, dim=-1)
        if keep is not None:
            probs, lse = probs[keep], lse[keep]
        prob_sums.append(probs.sum(0))
        z_sums.append(lse.square().sum())
    counts = torch.stack(count_rows).detach()
    if group is not None or (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        dist.all_reduce(counts, group=group)
    per_layer, tokens = counts[:, :num_experts], counts[:, num_experts]
    per_expert = torch.stack([per_layer[a:b].sum(0) for a, b in spans]) if spans else per_layer  # per entry
    assignments = per_expert.sum(1, keepdim=True).clamp_min(1.0)
    # f_e: the share of the global micro-batch's routed (token, expert) pairs; summing over k counts each
    # token's k choices, as HF's formula does (its f sums to top_k, ours is scaled the same way).
    top_k = layers[0][1].shape[-1] if layers else 1
    fraction = (per_expert / assignments * top_k).float()
    balance = torch.stack([(f * p).sum() for f, p in zip(fraction, prob_sums)]) * num_experts
    scale = 1.0 / (len(layers) * rows_per_token)
    return RouterLosses(balance.sum() * scale, torch.stack(z_sums).sum() * scale, per_layer, tokens)


def _per_layer(top_k_index: Tensor, keep: Optional[Tensor], layers: int) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """An entry's (top-k indices, mask) split into its `layers` consecutive blocks of rows (one per layer)."""
    if layers == 1 or top_k_index.shape[0] % layers:
        return [(top_k_index, keep)]
    keeps = [None] * layers if keep is None else list(keep.chunk(layers))
    return list(zip(top_k_index.chunk(layers), keeps))


class ExpertLoad:
    """Tokens per expert since the last `pop`, summed over micro-batches ([layers, E], detached, global)."""

    def __init__(self) -> None:
        self.counts: Optional[Tensor] = None

    def add(self, counts: Tensor) -> None:
        counts = counts.detach()
        self.counts = counts.clone() if self.counts is None else self.counts + counts

    def pop(self) -> Optional[Tensor]:
        counts, self.counts = self.counts, None
        return counts
