"""Ulysses sequence-parallel primitives: the autograd all-to-all, attention over a split sequence, document masks.

One sequence is split across the ranks of an sp group. Between attention layers every rank holds a
contiguous chunk of it (all heads); around attention an all-to-all trades that for the full sequence
of 1/sp of the heads, attention runs as on one device (causal, grouped-query, and block-diagonal when
packed documents must not see each other), and a second all-to-all trades back. These pieces sit low
(they import only torch) because both sides use them: the bundled GPT calls them from its own forward,
and the engines' Hugging Face path (strategies/sequence_parallel_hf.py) routes a transformers model's
attention through `ulysses_attention`. No DeepSpeed: its ALST classes run on `deepspeed.comm`, take a
fixed batch and sequence shape at construction and the [S, B, H, D] layout, and mask documents only
through flash-attention's varlen or flex attention; what is needed here is ~100 lines over
`torch.distributed`, autograd-correct on gloo and NCCL.

`split_sequence` (a plain slice) and `gather_sequence` (an all-gather whose backward is a
reduce-scatter SUM) serve a model that receives the full batch on every sp rank: with a loss
replicated over the sp group, each rank's chunk then receives sp x its true gradient, so the gradient
summed over the group is sp x the true one for every parameter, blocks and head alike, which the
Trainer's sp-fold token count (or FSDP's mean over the dp x sp mesh) cancels.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.sdpa import attention

__all__ = [
    "Group",
    "check_heads_divisible",
    "document_ids_from_positions",
    "gather_sequence",
    "group_size",
    "heads_to_sequence",
    "sequence_to_heads",
    "split_sequence",
    "ulysses_attention",
]

Group = Any  # a ProcessGroup, a 1-D DeviceMesh, or None (no sequence parallel)


def _process_group(group: Group) -> Optional[dist.ProcessGroup]:
    if group is None:
        return None
    if hasattr(group, "get_group"):  # a 1-D DeviceMesh
        return group.get_group()
    return group


def group_size(group: Group) -> int:
    """The sp degree of `group` (1 for None)."""
    pg = _process_group(group)
    return 1 if pg is None else dist.get_world_size(pg)


def _rank(group: Group) -> int:
    pg = _process_group(group)
    return 0 if pg is None else dist.get_rank(pg)


def check_heads_divisible(n_head: int, n_kv_head: int, degree: int, tensor_parallel: int = 1) -> None:
    """Raise a ValueError naming the fix when the sp degree does not divide both head counts (the
    counts each tensor-parallel rank holds, when `tensor_parallel` > 1)."""
    if n_head % degree == 0 and n_kv_head % degree == 0:
        return
    fits = [d for d in range(1, n_kv_head + 1) if n_head % d == 0 and n_kv_head % d == 0]
    per = f" per tensor-parallel rank (tp_size={tensor_parallel})" if tensor_parallel > 1 else ""
    raise ValueError(
        f"sequence parallel degree sp_size={degree} must divide the number of attention heads ({n_head}) and "
        f"of key/value heads ({n_kv_head}){per}: Ulysses attention gives each sp rank whole heads. Choose sp_size "
        f"among {fits}, or split the model further with FSDP (more dp_shard) or tensor parallel instead."
    )


# ------------------------------------------------------------------ the all-to-all
def _exchange(x: Tensor, pg: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    """Split `x` into P chunks along scatter_dim, send chunk i to rank i, concatenate what arrives
    along gather_dim in rank order."""
    world = dist.get_world_size(pg)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()  # [P, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=pg)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The exchange; its gradient is the inverse exchange (gather and scatter dims swapped)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pg: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.pg, ctx.scatter_dim, ctx.gather_dim = pg, scatter_dim, gather_dim
        return _exchange(x, pg, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.pg, ctx.gather_dim, ctx.scatter_dim), None, None, None


def sequence_to_heads(x: Tensor, group: Group) -> Tensor:
    """[B, H, S_local, D] sequence-sharded -> [B, H / sp, S, D] head-sharded (rank r keeps heads r*H/sp...)."""
    pg = _process_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return x
    return _AllToAll.apply(x, pg, 1, 2)


def heads_to_sequence(x: Tensor, group: Group) -> Tensor:
    """[B, H / sp, S, D] head-sharded -> [B, H, S_local, D] sequence-sharded: the inverse of sequence_to_heads."""
    pg = _process_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return x
    return _AllToAll.apply(x, pg, 2, 1)


# ------------------------------------------------------------------ attention
def document_ids_from_positions(position_ids: Tensor) -> Tensor:
    """Packed position ids ([B, S], restarting at 0 at each document, Hugging Face's convention) to
    document ids ([B, S]): equal ids share a document. Tokens before the first 0 form one document."""
    return (position_ids == 0).to(torch.int32).cumsum(dim=-1)


def _document_mask(document_ids: Tensor) -> Tensor:
    """[B, 1, S, S] boolean: causal and inside one document (True = may attend)."""
    S = document_ids.size(-1)
    causal = torch.ones(S, S, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: Group,
    *,
    document_ids: Optional[Tensor] = None,
    scale: Optional[float] = None,
) -> Tensor:
    """Causal attention over a sequence split across `group`.

    q: [B, Hq, S_local, D]; k, v: [B, Hkv, S_local, D] (SDPA's and Hugging Face's layout), each rank
    holding its contiguous chunk (rank r: positions r*S_local ...). `document_ids` ([B, S_full], the
    whole sequence's document index per token, the same on every rank) restricts attention to
    tokens of the same document. Returns [B, Hq, S_local, D]. With `group` None (or of size 1) it is
    plain causal attention, with the document mask when given.
    """
    degree = group_size(group)
    check_heads_divisible(q.size(1), k.size(1), degree)
    if document_ids is not None and document_ids.size(-1) != q.size(2) * degree:
        raise ValueError(
            f"document_ids cover {document_ids.size(-1)} positions but the sequence is {q.size(2)} x sp "
            f"{degree} = {q.size(2) * degree}: pass the FULL sequence's document ids (the same on every sp rank)"
        )
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    # sdpa.attention: grouped k/v heads with the document mask would run the math kernel (S x S) on a GPU.
    if document_ids is None:
        out = attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = _document_mask(document_ids.to(q.device))
        out = attention(q, k, v, attn_mask=mask, scale=scale)
    return heads_to_sequence(out, group)


# ------------------------------------------------------------------ split and gather the sequence
def split_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """This rank's contiguous chunk of `x` along `dim` (a plain slice; its gradient is zero elsewhere,
    which is right when `x` is replicated over the group and `gather_sequence` closes the region)."""
    degree = group_size(group)
    if degree == 1:
        return x
    length = x.size(dim)
    if length % degree != 0:
        raise ValueError(
            f"sequence length {length} is not divisible by the sequence parallel degree sp_size={degree}: "
            f"pad or pack the sequences to a multiple of {degree}, or choose an sp_size that divides {length}"
        )
    return x.narrow(dim, _rank(group) * (length // degree), length // degree)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dim; backward reduce-scatters (SUM) the gradient back to each rank's chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pg: dist.ProcessGroup, dim: int) -> Tensor:
        ctx.pg, ctx.dim = pg, dim
        world = dist.get_world_size(pg)
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((world * local.size(0), *local.shape[1:]))
        _all_gather_single(out, local, pg)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        world = dist.get_world_size(ctx.pg)
        full = grad.movedim(ctx.dim, 0).contiguous()
        out = full.new_empty((full.size(0) // world, *full.shape[1:]))
        _reduce_scatter_single(out, full, ctx.pg)
        return out.movedim(0, ctx.dim), None, None


def _all_gather_single(out: Tensor, x: Tensor, pg: dist.ProcessGroup) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there); earlier versions have only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=pg)


def _reduce_scatter_single(out: Tensor, x: Tensor, pg: dist.ProcessGroup) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x, group=pg)


def gather_sequence(x: Tensor, group: Group, dim: int = 1) -> Tensor:
    """Concatenate every rank's chunk along `dim` (rank order). The backward is a reduce-scatter SUM, not
    a slice: with a replicated loss each rank's chunk gets the sum of all ranks' gradients (sp x its own)."""
    pg = _process_group(group)
    if pg is None or dist.get_world_size(pg) == 1:
        return x
    return _GatherSequence.apply(x, pg, dim)
