"""Memory that is accounted rather than traced: ZeRO's view of a trace, parameter counts, the fallback.

DeepSpeed's engine cannot run on fake tensors (it allocates flat buffers and
reads data pointers in C++), so ZeRO stages are modelled: the per-rank model
states are DeepSpeed's own partitioning rules (strategies/accounting.py,
beside the strategy: read from DeepSpeed 0.19's runtime/zero/stage_1_and_2.py
and stage3.py, checked by measured CPU runs in benchmarks/plan_accuracy.py),
with the size limits DeepSpeed's engine will actually get (`zero_settings`:
its defaults, capped for the model's size by shardwise's DeepSpeedStrategy,
then the user's config). Activations come from the DDP trace of the same
model (same activation checkpointing), through the `ZeroView` trace.py
evaluates at every recorded moment (`ZeROAccounting.view`).

The fallback, for models that cannot run under fake tensors (some Hugging
Face models branch on tensor values), is a per-block estimate: saved
activations per transformer block from its shapes, plus logits and the
float32 cross entropy over the vocabulary (about 10 bytes x batch x seq x
vocab; a Hugging Face model's chunked loss keeps only the logits and their
gradient), plus model states per strategy. The report marks such rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from shardwise.plan.candidates import Candidate
from shardwise.plan.moe import moe_facts
from shardwise.plan.presets import ModelSpec
from shardwise.strategies.accounting import ZERO_DEFAULTS, accounting_for


def zero_settings(deepspeed_config: Optional[Dict[str, Any]], stats: Optional["ParamStats"] = None) -> Dict[str, int]:
    """The size limits DeepSpeed will run with: its defaults, capped by shardwise's DeepSpeedStrategy
    for the model's size (deepspeed_config.size_limits), overridden by the user's config."""
    zero = dict(ZERO_DEFAULTS)
    section = (deepspeed_config or {}).get("zero_optimization") or {}
    if stats is not None:
        from shardwise.strategies.deepspeed_config import size_limits

        # size_limits reads only the largest tensor and the total: stand-in tensors of the largest size.
        big = max(1, stats.largest_param)
        numels = [big] * (stats.total // big) + [stats.total % big]
        zero.update({k: int(v) for k, v in size_limits(numels, section).items() if k in zero})
    for key in ZERO_DEFAULTS:
        value = section.get(key, section.get(key.replace("stage3_", "")))
        if value is not None and value != "auto":
            zero[key] = int(value)
    return zero


@dataclass
class ParamStats:
    """Parameter counts of one (meta) model build."""

    total: int
    small: int  # in tensors under ZeRO-3's persistence threshold (kept gathered on every rank)
    largest_leaf: int  # the largest module's own parameters (ZeRO-3 gathers module by module)
    largest_param: int = 0  # the largest single parameter tensor

    def scaled(self, other: "ParamStats", t: float) -> "ParamStats":
        """Linear inter/extrapolation between two depths (t = 0 -> self, 1 -> other)."""
        return ParamStats(
            total=int(round(self.total + (other.total - self.total) * t)),
            small=int(round(self.small + (other.small - self.small) * t)),
            largest_leaf=max(self.largest_leaf, other.largest_leaf),
            largest_param=max(self.largest_param, other.largest_param),
        )


def param_stats(model: nn.Module, threshold: int) -> ParamStats:
    seen = set()
    total = small = largest = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        small += p.numel() if p.numel() < threshold else 0
        largest = max(largest, p.numel())
    leaf = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ParamStats(total=total, small=small, largest_leaf=leaf, largest_param=largest)


def spec_param_stats(spec: ModelSpec, depth: Optional[int], threshold: int) -> ParamStats:
    """ParamStats of the spec's model at `depth`, from a meta build (nothing allocated)."""
    if spec.kind == "module":
        return param_stats(spec.__dict__.get("probe", spec.module), threshold)
    with torch.device("meta"):
        return param_stats(spec.build(depth), threshold)


def deepspeed_estimator(
    stage: int, offload: bool, stats: ParamStats, gpus_per_node: int, num_nodes: int
) -> Optional[int]:
    """DeepSpeed's own per-GPU model-states estimate (its 'all_cold' functions), for comparison; None if absent."""
    try:
        if stage == 3:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            return int(
                estimate_zero3_model_states_mem_needs(
                    stats.total,
                    stats.largest_leaf,
                    gpus_per_node,
                    num_nodes,
                    cpu_offload=offload,
                    cpu_offload_params=offload,
                )[1]
            )
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return int(estimate_zero2_model_states_mem_needs(stats.total, gpus_per_node, num_nodes, cpu_offload=offload)[1])
    except Exception:  # deepspeed missing or its API moved: the comparison is optional
        return None


# ------------------------------------------------------------------ per-block fallback
def block_activation_bytes(
    spec: ModelSpec, micro_batch: int, seq_len: int, act_bytes: int, checkpointed: bool, mixed: bool = False
) -> float:
    """Saved activations of one transformer block (no attention score matrix: fused attention).

    Counted per token: the attention input and output projections' inputs,
    q / k / v, the attention output, the MLP input, its up (and gate)
    projections and activation; under mixed precision the residual stream and
    the norms' inputs are float32 (autocast promotes the residual adds). With
    checkpointing only the block input is kept.
    """
    tokens = micro_batch * seq_len
    h, f = spec.hidden, spec.ffn
    kv = h * spec.kv_heads / max(1, spec.heads)
    if checkpointed:
        return tokens * h * (4 if mixed else act_bytes)
    mlp = 3 * f if spec.kind == "gpt" and getattr(spec.config, "mlp", "gelu") == "swiglu" else 2 * f
    facts = moe_facts(spec)
    if facts is not None:  # the routed rows: each token's copy per expert, gate / up and activation (plan/moe.py)
        mlp = facts.top_k * (facts.hidden + 3 * facts.expert_ffn) * facts.moe_layers / max(1, facts.depth)
    per_token = (4 * h + 2 * kv + mlp) * act_bytes + 2 * h * (4 if mixed else act_bytes)
    return tokens * per_token


def fallback_estimate(
    spec: ModelSpec,
    cand: Candidate,
    stats: ParamStats,
    world: int,
    num_nodes: int,
    precision: str,
    micro_batch: int,
    seq_len: int,
    settings: Dict[str, int],
) -> Tuple[float, Dict[str, float]]:
    """(peak bytes, breakdown) without a trace: model states per strategy + per-block activations + logits."""
    acct = accounting_for(cand.plan)
    n = stats.total
    half = precision not in ("32-true", "64-true")
    mixed = precision in ("bf16-mixed", "16-mixed")
    act_bytes = 2 if half else 4
    depth = spec.depth or 1
    acts = depth * block_activation_bytes(spec, micro_batch, seq_len, act_bytes, cand.plan.uses_ac, mixed)
    if cand.plan.uses_ac:  # one block is recomputed at a time
        acts += block_activation_bytes(spec, micro_batch, seq_len, act_bytes, False, mixed)
    acts /= cand.plan.tp * cand.plan.sp  # a tp x sp group splits its blocks' activations (not the logits)
    copies = acct.autocast_copies(n, precision)
    if copies:
        acts += copies
    if spec.kind == "hf":  # the recipe's chunked loss (losses.py): the logits and their gradient, same dtype
        logits = 2.0 * act_bytes * micro_batch * seq_len * spec.vocab_size
    else:
        logits = 10.0 * micro_batch * seq_len * spec.vocab_size  # bf16 logits + fp32 copy + fp32 gradient
    block_params = (n - stats.small) / depth if depth else n
    states = acct.fallback_states(cand.plan, stats, world, num_nodes, precision, depth, block_params, settings)
    breakdown = dict(states, activations=acts + logits)
    return sum(breakdown.values()), breakdown
