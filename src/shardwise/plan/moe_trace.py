"""The token exchange of mixture-of-experts layers in a fake-tensor trace: balanced routing.

Fake tensors carry no values, so which expert a token goes to -- and how many rows each expert and each
expert-parallel rank gets -- is unknown in a trace; the dispatch reads those counts as Python numbers
(`torch.bincount(...).tolist()`) to size its all-to-all, which a fake tensor cannot answer. The planner
therefore runs the experts' compute and exchange with the counts of balanced routing: every expert gets
tokens x top_k / experts rows, every ep rank sends and receives tokens x top_k rows. Everything else is
the engine's own: the experts' weights as expert parallel placed and FSDP sharded them (strategies/
experts.py), the same sort, the engine's differentiable all-to-all and grouped expert MLP
(expert_parallel.all_to_all, grouped_mlp) on the same shapes, the weighting on the token's rank. The
worst case of dropless routing is accounted beside the trace (plan/moe.dispatch_bytes).

`balanced_dispatch(model)` replaces the forward of every experts module that routes through the dispatch
(one with an ep group, or the bundled GPT-MoE's, whose local path counts tokens too) for the trace, and
returns the undo. While it is in place, `torch.bincount(ids, minlength=E)` of a fake tensor (the router
losses count tokens per expert) gives E counts: its length when every id is an expert's, which routing
guarantees; real tensors are counted as ever. A Hugging Face experts module without expert parallel
keeps its own forward: its grouped matmul sizes its work from offsets inside the op, which fake tensors
trace as they are; the trace runs transformers' own fallback op for it (same shapes, registered for fake
tensors, any dtype), since the CPU kernel takes only bf16 and a trace runs on the CPU device.
"""

from __future__ import annotations

import sys
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.expert_parallel import all_to_all, grouped_mlp, local_weight
from shardwise.strategies.experts import find_experts


def even(total: int, parts: int) -> List[int]:
    """`total` rows over `parts` groups as evenly as they go (the first groups take the remainder)."""
    base, extra = divmod(int(total), max(1, int(parts)))
    return [base + (1 if i < extra else 0) for i in range(max(1, int(parts)))]


def _balanced_forward(self: nn.Module, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """expert_parallel.experts_forward with the counts of balanced routing (the module's weights and group)."""
    gate_up, down = local_weight(self.gate_up_proj), local_weight(self.down_proj)
    act: Callable = getattr(self, "act_fn", F.silu)
    group = getattr(self, "expert_group", None)
    n, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden.index_select(0, order // k)
    local = int(gate_up.shape[0])
    ep = 1 if group is None else dist.get_world_size(group)
    if ep == 1:
        y = grouped_mlp(rows, even(n * k, local), gate_up, down, act)
    else:
        counts = torch.zeros(local * ep, dtype=torch.long, device=flat.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)  # the engine exchanges its counts first
        sizes = even(n * k, ep)  # balanced: each rank sends and receives n x k rows
        arrived = all_to_all(rows, sizes, sizes, group)
        by_expert = torch.argsort(received.new_zeros(n * k), stable=True)
        computed = grouped_mlp(arrived.index_select(0, by_expert), even(n * k, local), gate_up, down, act)
        y = all_to_all(computed.index_select(0, torch.argsort(by_expert)), sizes, sizes, group)
    y = y.index_select(0, torch.argsort(order)).view(n, k, -1)
    return (y * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(1).to(hidden.dtype)


def _fake_bincount(real: Callable) -> Callable:
    from torch._subclasses.fake_tensor import FakeTensor

    def bincount(input: Tensor, weights: Optional[Tensor] = None, minlength: int = 0) -> Tensor:
        if isinstance(input, FakeTensor) and minlength > 0:
            dtype = torch.long if weights is None else weights.dtype
            return torch.zeros(minlength, dtype=dtype, device=input.device)
        return real(input, weights, minlength=minlength)

    return bincount


def _routes_through_dispatch(module: nn.Module) -> bool:
    return getattr(module, "expert_group", None) is not None or type(module).__module__.startswith("shardwise.")


def balanced_dispatch(model: nn.Module) -> Callable[[], None]:
    """Give `model`'s dispatching experts modules the balanced forward for a trace; returns the undo."""
    patched = []
    found = find_experts(model)
    real_bincount = torch.bincount
    hf_moe = sys.modules.get("transformers.integrations.moe")
    real_can_use = getattr(hf_moe, "_can_use_grouped_mm", None)
    if found:
        torch.bincount = _fake_bincount(real_bincount)
        if real_can_use is not None:
            hf_moe._can_use_grouped_mm = lambda *args: False
    for _, experts in found:
        if _routes_through_dispatch(experts):
            had = "forward" in experts.__dict__
            patched.append((experts, had, experts.__dict__.get("forward")))
            experts.forward = _balanced_forward.__get__(experts)

    def undo() -> None:
        torch.bincount = real_bincount
        if real_can_use is not None:
            hf_moe._can_use_grouped_mm = real_can_use
        for experts, had, old in patched:
            if had:
                experts.forward = old
            else:
                del experts.forward

    return undo


__all__ = ["balanced_dispatch", "even"]
