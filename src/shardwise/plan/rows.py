"""Pieces of the planner's rows that need no planner state: breakdowns, trace views, offload's on-device part.

`plan/core.py` assembles one `Estimate` per configuration and batch split from
a trace; the arithmetic here is what it applies to a trace without needing the
rest of the plan: which view of a trace answers for DDP's buckets, the name a
ZeRO view is recorded under, the breakdown whose parts add up to the peak, and
FSDP CPU offload's on-device bytes read off the FULL_SHARD trace.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from shardwise.plan.candidates import Candidate
from shardwise.plan.presets import ModelSpec
from shardwise.plan.trace import DDP_SEPARATE_BUCKETS_VIEW, DDP_VIEW, IDENTITY, Trace
from shardwise.strategies.accounting import accounting_for


def fsdp_offload_row(spec: ModelSpec, tr: Trace, r: float) -> Tuple[float, str, Dict[str, float], float, str]:
    """FULL_SHARD + CPUOffloadPolicy from the FULL_SHARD trace (offload is CUDA-only, so never traced).

    On the host: the sharded fp32 parameters, their gradients (each
    reduce-scattered shard is copied out as it is produced) and the
    optimizer state, which also steps there. On the device stays what the
    trace shows minus those: gathered parameters, activations, and the
    unsharded gradients of the unit(s) being reduced, capped at two units.
    """
    counts = spec.param_counts()
    unit = max(counts["per_block"], counts["largest_layer"]) if counts["per_block"] else counts["largest_layer"]
    grad_cap = 2 * unit * 4.0
    best = (0.0, "", (0.0,) * 5)
    for (phase, view, scale), (value, parts) in tr.envelope.items():
        if view == "identity" and scale == r and phase != "opt":
            p, g, o, b, a = parts
            on_device = value - min(p, tr.params) - o - g + min(g, grad_cap)
            if on_device > best[0]:
                best = (on_device, phase, parts)
    value, phase, (p, g, o, b, a) = best
    breakdown = split_breakdown(value, params=b, grads=min(g, grad_cap), opt=0.0, acts=r * a)
    host = tr.params + tr.grads + tr.optimizer
    return value, phase, breakdown, host, "FULL_SHARD trace, sharded states on host (modelled)"


def identity_view(traced: Candidate, world: int) -> Any:
    """DDP's gradient buckets: views of them (ours) or beside the .grad tensors (torch's / Lightning's default)."""
    if not accounting_for(traced.plan).grad_buckets(world):
        return IDENTITY
    kwargs = getattr(traced.strategy, "ddp_kwargs", None) or {}
    return DDP_VIEW if kwargs.get("gradient_as_bucket_view", True) else DDP_SEPARATE_BUCKETS_VIEW


def view_key(cand: Candidate) -> str:
    return f"{cand.plan.label} view"


def split_breakdown(total: float, *, params: float, grads: float, opt: float, acts: float) -> Dict[str, float]:
    """Breakdown whose parts add up to `total`: what is not a model state or an activation is temporary."""
    parts = dict(parameters=params, gradients=grads, optimizer=opt, activations=acts)
    parts["temporary"] = max(0.0, total - sum(parts.values()))
    return parts


__all__ = ["identity_view", "view_key", "split_breakdown", "fsdp_offload_row"]
