"""Memory that is accounted rather than traced: DeepSpeed ZeRO, CPU offload, and the per-block fallback.

DeepSpeed's engine cannot run on fake tensors (it allocates flat buffers and
reads data pointers in C++), so ZeRO stages are modelled from ZeRO's published
accounting -- mixed-precision Adam costs 2 + 2 + 12 bytes per parameter
(bf16 weights, bf16 gradients, fp32 master + two moments), split by stage --
refined by what DeepSpeed 0.19's code allocates on top (read from
runtime/zero/stage_1_and_2.py and stage3.py, checked by measured CPU runs in
benchmarks/plan_accuracy.py):
- stages 1-2 keep the whole model flat in its training dtype and clone this
  rank's fp32 partition as the master copy (also in fp32 training); stage 3
  keeps a partition plus the master copy, and gathers parameters per module;
- the gradient reduction buffer is `reduce_bucket_size` elements, allocated
  whole at the first backward whatever the model size (5e8 by default: 1 GB
  in bf16, 2 GB in fp32) -- often the largest ZeRO term for small models;
- ZeRO-1 accumulates full fp32 gradients through the backward, ZeRO-2/3
  reduce them bucket by bucket into this rank's partition;
- stage 3 keeps parameters under `stage3_param_persistence_threshold`
  elements whole on every rank (besides their partition), and keeps up to
  `stage3_max_live_parameters` of the others gathered;
- these size limits are DeepSpeed's defaults capped for the model's size by
  shardwise's DeepSpeedStrategy (strategies/deepspeed_config.size_limits),
  then the user's config -- the values the engine will actually get;
- the optimizer step on one flat fp32 partition makes two partition-sized
  temporaries (Adam's sqrt and division); at stage 3 only for the partitioned
  (non-persistent) parameters, plus one more gradient-partition copy.
Activations are not modelled here: they come from the DDP trace of the same
model (same activation checkpointing), through the linear "views" trace.py
evaluates at every recorded moment.

The fallback, for models that cannot run under fake tensors (some Hugging
Face models branch on tensor values), is a per-block estimate: saved
activations per transformer block from its shapes, plus logits and the
float32 cross entropy over the vocabulary (about 10 bytes x batch x seq x
vocab), plus model states per strategy. The report marks such rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from shardwise.plan.candidates import Candidate
from shardwise.plan.presets import ModelSpec
from shardwise.plan.trace import View

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py); a user's config overrides them.
ZERO_DEFAULTS = {
    "reduce_bucket_size": int(5e8),
    "allgather_bucket_size": int(5e8),
    "stage3_prefetch_bucket_size": int(5e7),
    "stage3_param_persistence_threshold": int(1e5),
    "stage3_max_live_parameters": int(1e9),
    "stage3_max_reuse_distance": int(1e9),
}
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter
ADAM_TEMP_BYTES = 8  # two fp32 partition-sized temporaries in the step


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


def weight_bytes(precision: str) -> int:
    """Bytes per parameter DeepSpeed trains in: bf16 / fp16 for the half modes, fp32 otherwise."""
    return 4 if precision in ("32-true", "64-true") else 2


# ------------------------------------------------------------------ ZeRO
@dataclass
class ZeroTerms:
    """Per-rank bytes of one ZeRO configuration (one world size, one model build)."""

    weights: float  # the model's parameters as the forward sees them (full, or partition + persistent)
    master: float  # fp32 master partition
    optimizer: float  # optimizer state partition
    grad_partition: float  # gradient partition held through forward/backward (ZeRO-2: bf16, ZeRO-3: fp32)
    bucket: float  # gradient reduction buffer
    gathered: float  # ZeRO-3: parameters kept gathered between modules
    step_grads: float  # gradient bytes during the optimizer step
    step_temps: float  # optimizer-step temporaries
    host: float = 0.0  # per rank, on the host, when offloaded


def zero_terms(
    stage: int, offload: bool, stats: ParamStats, world: int, precision: str, settings: Dict[str, int]
) -> ZeroTerms:
    n, w = stats.total, max(1, world)
    pb = weight_bytes(precision)
    part = n / w
    if stage < 3:
        # ZeRO-1 reduces through an fp32 accumulator bucket, ZeRO-2 in the training dtype. In the
        # step the gradient partition is fp32; ZeRO-2 in half precision also still holds its
        # half-precision partition then (in fp32 the two are one tensor).
        return ZeroTerms(
            weights=pb * n,
            master=4 * part,
            optimizer=ADAM_STATE_BYTES * part,
            grad_partition=(pb * part if stage == 2 else 0.0),
            bucket=settings["reduce_bucket_size"] * (4 if stage == 1 else pb),
            gathered=0.0,
            step_grads=4 * part + (pb * part if stage == 2 and pb != 4 else 0.0),
            step_temps=ADAM_TEMP_BYTES * part,
        )
    # Parameters under the persistence threshold stay whole on every rank besides their partition
    # (measured; on one rank the partition is the whole parameter, so nothing is extra).
    small = stats.small if w > 1 else 0
    # Gathered at once: DeepSpeed replays its recorded module order and keeps what it will reuse soon,
    # up to stage3_max_live_parameters (never less than the module running).
    live = min(max(0, n - small), max(settings["stage3_max_live_parameters"], stats.largest_leaf))
    # Step temporaries: measured, they scale with the partition of the *partitioned* parameters
    # only (persistent ones add none), on top of one more partition-sized gradient copy.
    terms = ZeroTerms(
        weights=pb * (part + small),
        master=4 * part,
        optimizer=ADAM_STATE_BYTES * part,
        grad_partition=4 * part,
        bucket=settings["reduce_bucket_size"] * pb,
        gathered=pb * live,
        step_grads=4 * part + pb * part,
        step_temps=ADAM_TEMP_BYTES * max(0, n - small) / w,
    )
    if offload:
        # Partitions, master weights, optimizer state and gradients live on the host; the device
        # keeps persistent small parameters, what is gathered, and the reduction bucket.
        terms.host = pb * part + terms.master + terms.optimizer + terms.grad_partition
        terms.weights = pb * small
        terms.master = terms.optimizer = terms.grad_partition = terms.step_grads = terms.step_temps = 0.0
    return terms


@dataclass(frozen=True)
class ZeroView(View):
    """A ZeRO stage's bytes at one moment of a plain data-parallel trace (forward / backward).

    Activations (and the activation-sized temporaries of backward) come from
    the trace; model states are replaced by ZeRO's. Gradient buffers appear as
    DeepSpeed allocates them: the reduction bucket with the first gradient of
    a backward, ZeRO-2's gradient partition at the first bucket flush (after
    `reduce_bucket_size` elements of gradients), ZeRO-1's fp32 accumulators as
    the gradients are produced. Both are freed at the end of the backward
    (ZeRO-3's partition and bucket stay, and are part of `const`).
    """

    stage: int = 1
    grad_elem_bytes: float = 4.0  # bytes per gradient element in the trace
    bucket_bytes: float = 0.0
    partition_bytes: float = 0.0
    first_flush: float = 0.0  # elements produced before the first bucket flush

    def __call__(self, p: float, g: float, o: float, b: float, a: float, r: float) -> float:
        produced = g / self.grad_elem_bytes
        value = self.const + b + r * a
        if produced > 0:
            value += self.bucket_bytes
            if self.stage == 1:
                value += 4.0 * produced
            elif self.stage == 2 and produced >= self.first_flush:
                value += self.partition_bytes
        return value


def zero_view(stage: int, terms: ZeroTerms, trace_grad_bytes: float, settings: Dict[str, int]) -> ZeroView:
    """The view of a data-parallel trace that gives this ZeRO stage's forward/backward bytes.

    ZeRO-3's gathered parameters are capped, so not linear in depth: the
    planner adds them (and ZeRO-3's bucket) at the full depth, not through
    the extrapolated trace.
    """
    const = terms.weights + terms.master + terms.optimizer + (terms.grad_partition if stage == 3 else 0.0)
    return ZeroView(
        cp=0.0,
        cg=0.0,
        co=0.0,
        ca=1.0,
        const=const,
        stage=stage,
        grad_elem_bytes=trace_grad_bytes,
        bucket_bytes=terms.bucket if stage < 3 else 0.0,
        partition_bytes=terms.grad_partition if stage == 2 else 0.0,
        first_flush=float(settings["reduce_bucket_size"]),
    )


def zero_step_bytes(stage: int, terms: ZeroTerms) -> float:
    """Bytes during the optimizer step (activations are gone, parameters released, bucket kept at stage 3)."""
    bucket = terms.bucket if stage == 3 else 0.0
    return terms.weights + terms.master + terms.optimizer + terms.step_grads + terms.step_temps + bucket


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
    n, w = stats.total, max(1, world)
    half = precision not in ("32-true", "64-true")
    mixed = precision in ("bf16-mixed", "16-mixed")
    act_bytes = 2 if half else 4
    store = 2 if precision in ("bf16-true", "16-true") else (8 if precision == "64-true" else 4)
    depth = spec.depth or 1
    acts = depth * block_activation_bytes(spec, micro_batch, seq_len, act_bytes, cand.activation_checkpointing, mixed)
    if cand.activation_checkpointing:  # one block is recomputed at a time
        acts += block_activation_bytes(spec, micro_batch, seq_len, act_bytes, False, mixed)
    if cand.kind == "ddp" and mixed:  # autocast's bf16 weight copies are saved for the backward
        acts += 2 * n
    logits = 10.0 * micro_batch * seq_len * spec.vocab_size  # bf16 logits + fp32 copy + fp32 gradient
    block_params = (n - stats.small) / depth if depth else n
    if cand.kind == "deepspeed":
        t = zero_terms(cand.stage, cand.offload, stats, world, precision, settings)
        grads = 4 * n if cand.stage == 1 else 0.0
        states = dict(
            parameters=t.weights + t.master,
            gradients=t.grad_partition + grads,
            optimizer=t.optimizer,
            temporary=t.bucket + t.gathered,
        )
    else:
        shard = w if cand.kind == "fsdp" and cand.sharding in ("FULL_SHARD", "SHARD_GRAD_OP") else 1
        if cand.kind == "fsdp" and cand.sharding == "HYBRID_SHARD":
            shard = w // max(1, num_nodes)
        gathered = 0.0 if shard == 1 else 2 * block_params * act_bytes + (n - depth * block_params) * act_bytes
        states = dict(
            parameters=store * n / shard,
            gradients=store * n / shard,
            optimizer=8 * n / shard,
            temporary=gathered + (2 * block_params * 4 if shard > 1 else 0),
        )
        if cand.offload:
            states["parameters"] = 0.0
            states["optimizer"] = 0.0
    breakdown = dict(states, activations=acts + logits)
    return sum(breakdown.values()), breakdown
