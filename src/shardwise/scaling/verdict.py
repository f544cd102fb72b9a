"""The comparison behind `shardwise check`, and its verdict: the first cause found, with its fix.

Inputs are the records of the two runs (record.py): the one-process
reference and the N ranks, from the same seed. Per optimizer step the loss of
each run is the loss of its global batch: the mean of the micro-batch losses
over every rank and micro-batch (all micro-batches hold the same number of
samples), or, for a module that defines `loss_weight(batch)` and returns a
summed loss, the sum of the losses over the sum of the weights. The causes are
looked for in this order, and the first one found is the verdict:

1. the initial weights differ (the module's initialisation is not reproducible);
2. ranks trained on the same samples (a loader or sampler that ignores the rank);
3. a loss summed without its weight: from the same weights and samples, the
   N-rank loss of the first step is the one-process loss times the share of
   one micro-batch, 1 / (devices x accumulation);
4. a buffer, or a parameter, that differs across ranks (state only some ranks
   update, or statistics of each rank's own samples);
5. a first-step loss scaled by another factor of the world size or the
   accumulation count (divided by hand, which the Trainer already does);
6. the ranks' samples are disjoint but their union is not the one-process batch;
7. losses or parameters beyond the tolerances (with what else may explain it);
8. a buffer that differs from the one-process run.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from shardwise.scaling.record import MicroBatch, RankRecord

# A first-step loss ratio within this of the expected factor names the cause (fp32 noise is ~1e-7).
_RATIO_TOLERANCE = 1e-3


@dataclass
class Cause:
    kind: str  # init, same_samples, summed_loss, scaled_loss, rank_state, data_order, differs, reference_buffer
    summary: str
    fix: str


@dataclass
class StepRow:
    step: int  # 1-based
    reference: Optional[float]
    run: Optional[float]
    rel_diff: Optional[float]
    shared: int  # samples seen by more than one rank in this step
    identical: bool  # every rank saw exactly the same samples
    union_equal: bool  # the ranks' samples together are the one-process batch of this step


@dataclass
class ScalingReport:
    """What `shardwise.check` found; `ok` is the verdict, `format()` the report `shardwise check` prints."""

    module: str
    strategy: str
    devices: int
    accumulate: int
    micro_batch_size: int
    steps: int
    loss_rtol: float
    param_rtol: float
    rows: List[StepRow] = field(default_factory=list)
    tensors: int = 0
    init_diff: float = 0.0
    init_name: Optional[str] = None
    param_diff: float = 0.0  # ||P_N - P_1|| / ||P_1|| over all parameters after the steps
    param_max: float = 0.0  # the largest element |diff|, and the parameter it is in
    param_name: Optional[str] = None
    buffers_across_ranks: List[Tuple[str, float]] = field(default_factory=list)
    params_across_ranks: List[str] = field(default_factory=list)
    buffers_vs_reference: List[Tuple[str, float]] = field(default_factory=list)
    dropout: List[str] = field(default_factory=list)
    weighted: bool = False
    seconds: Dict[str, float] = field(default_factory=dict)
    cause: Optional[Cause] = None
    reference_accumulate: int = 1  # a module with experts: the run's accumulation (router losses per micro-batch)

    @property
    def ok(self) -> bool:
        return self.cause is None

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.accumulate * self.devices

    @property
    def verdict(self) -> str:
        if self.cause is None:
            return (
                f"verdict: PASS, equivalent within tolerance (loss rel. diff <= {self.loss_rtol:g}, "
                f"parameter rel. diff <= {self.param_rtol:g})"
            )
        return f"verdict: FAIL, {self.cause.summary}"

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["ok"], out["verdict"], out["global_batch"] = self.ok, self.verdict, self.global_batch
        return out

    def format(self) -> str:
        n, run = self.devices, f"{self.devices} x {self.strategy}"
        width = max(16, len(run) + 6)
        lines = [
            f"shardwise check: {self.module}",
            f"  run:       {self.strategy} on {n} process{'es' if n > 1 else ''} (CPU, gloo, fp32), micro-batch "
            f"{self.micro_batch_size} x accumulation {self.accumulate} x {n} = global batch {self.global_batch}, "
            f"{_steps(self.steps)}",
            f"  reference: 1 process, batch {self.global_batch}, accumulation 1, from the same seed"
            if self.reference_accumulate == 1
            else f"  reference: 1 process, micro-batch {self.global_batch // self.reference_accumulate} x accumulation "
            f"{self.reference_accumulate} = batch {self.global_batch}, from the same seed (the module has experts: "
            "its router losses are computed per global micro-batch, so the accumulation is kept)",
            "  loss per step: "
            + ("sum of losses / sum of loss_weight(batch)" if self.weighted else "mean of the micro-batch losses"),
            "  initial weights: "
            + (
                f"identical in both runs ({self.tensors} tensors)"
                if self.init_name is None
                else f"DIFFER ({self.init_name}: max |diff| {self.init_diff:.3g})"
            ),
            "",
            f"  {'step':>4}  {'loss, 1 process':>16}  {'loss, ' + run:>{width}}  {'rel. diff':>9}  samples",
        ]
        for row in self.rows:
            data = "distinct per rank" if row.shared == 0 else f"{row.shared} seen by several ranks"
            data += ", union = 1-process batch" if row.union_equal else ", union != 1-process batch"
            lines.append(
                f"  {row.step:>4}  {_num(row.reference):>16}  {_num(row.run):>{width}}  {_sci(row.rel_diff):>9}  {data}"
            )
        lines += [
            "",
            f"  parameters after {_steps(self.steps)}: rel. diff {self.param_diff:.3g} (||P_ranks - P_1|| / ||P_1||); "
            f"largest element |diff| {self.param_max:.3g}" + (f" in {self.param_name}" if self.param_name else ""),
        ]
        lines.append("  " + self._buffers_line())
        if self.dropout:
            lines.append(f"  dropout (random, differs between the runs): {', '.join(self.dropout[:4])}")
        if self.seconds:
            lines.append(
                "  time: "
                + ", ".join(f"{name} {value:.1f} s" for name, value in self.seconds.items())
                + " (wall clock, including start-up)"
            )
        lines += ["", self.verdict]
        if self.cause is not None:
            lines.append(f"  fix: {self.cause.fix}")
        return "\n".join(lines)

    def _buffers_line(self) -> str:
        if self.buffers_across_ranks:
            name, diff = self.buffers_across_ranks[0]
            return (
                f"buffers: {len(self.buffers_across_ranks)} differ across ranks (first: {name}, rel. diff {diff:.3g})"
            )
        if self.buffers_vs_reference:
            name, diff = self.buffers_vs_reference[0]
            return f"buffers: equal across ranks; {name} differs from the 1-process run (rel. diff {diff:.3g})"
        return "buffers: equal on every rank and to the 1-process run"


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.7g}"


def _sci(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1e}"


def step_loss(micro: Sequence[MicroBatch]) -> Optional[float]:
    """The loss of one optimizer step's global batch from its micro-batches (over all ranks)."""
    done = [m for m in micro if m.loss is not None]
    if not done:
        return None
    if all(m.weight is not None for m in done):
        total = sum(m.weight for m in done)  # type: ignore[misc]
        return sum(m.loss for m in done) / total if total else None  # type: ignore[misc]
    return sum(m.loss for m in done) / len(done)  # type: ignore[misc]


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], names: Sequence[str]) -> Tuple[float, str]:
    """The largest |a - b| over `names` (inf for a missing name or another shape) and where it is."""
    worst, where = 0.0, ""
    for name in names:
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape:
            diff = math.inf
        elif x.numel() == 0:
            diff = 0.0
        else:
            diff = float((x.double() - y.double()).abs().max())
            diff = math.inf if math.isnan(diff) else diff
        if diff > worst or not where:
            worst, where = diff, name
    return worst, where


def _relative_diff(
    a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], names: Sequence[str], symmetric: bool = False
) -> float:
    """||a - b|| / ||b|| over the tensors `names` together (inf for a missing name or another shape).

    Over all parameters at once, because Adam-type optimizers turn fp32 rounding in gradients that are
    zero up to rounding (e.g. a key projection's bias, to which softmax is blind) into element-wise
    differences of about 1e-2 x lr in either run, while a real mistake moves the whole update.
    `symmetric`: divide by the larger of ||a|| and ||b|| (buffers, where neither run is the reference).
    """
    diff = norm_a = norm_b = 0.0
    for name in names:
        x, y = a.get(name), b.get(name)
        if x is None or y is None or x.shape != y.shape:
            return math.inf
        x, y = x.double(), y.double()
        diff += float(((x - y) ** 2).sum())
        norm_a += float((x**2).sum())
        norm_b += float((y**2).sum())
    scale = math.sqrt(max(norm_a, norm_b) if symmetric else norm_b)
    if diff == 0:
        return 0.0
    return math.sqrt(diff) / scale if scale > 0 else math.inf


def compare(
    reference: RankRecord,
    ranks: List[RankRecord],
    report: ScalingReport,
) -> ScalingReport:
    """Fill `report` (the settings) with the numbers of the two runs and the first cause found."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    zero = ranks[0]
    report.weighted = bool(reference.micro) and all(m.weight is not None for m in reference.micro)
    report.dropout = zero.dropout
    steps = min(len({m.step for m in reference.micro}), len({m.step for r in ranks for m in r.micro}))
    for s in range(steps):
        ref_micro = [m for m in reference.micro if m.step == s]
        run_micro = [m for r in ranks for m in r.micro if m.step == s]
        ref_loss, run_loss = step_loss(ref_micro), step_loss(run_micro)
        rel = None if ref_loss is None or run_loss is None else abs(run_loss - ref_loss) / max(abs(ref_loss), 1e-30)
        per_rank = [Counter(h for m in r.micro if m.step == s for h in m.samples) for r in ranks]
        owners = Counter(h for counts in per_rank for h in counts)
        union = sum(per_rank, Counter())
        shared = sum(1 for h, n in owners.items() if n > 1)
        ref_samples = Counter(h for m in ref_micro for h in m.samples)
        identical = len(ranks) > 1 and all(c == per_rank[0] for c in per_rank)
        report.rows.append(StepRow(s + 1, ref_loss, run_loss, rel, shared, identical, union == ref_samples))

    everything = sorted(set(reference.initial) | set(zero.initial))
    report.tensors = len(everything)
    init_diff, init_name = _max_diff(reference.initial, zero.initial, everything)
    if init_diff > 0:
        report.init_diff, report.init_name = init_diff, init_name
    params = reference.param_names
    report.param_diff = _relative_diff(zero.final, reference.final, params)
    report.param_max, report.param_name = _max_diff(reference.final, zero.final, params)
    buffer_names = sorted(zero.buffers)
    for name in buffer_names:
        worst = max((_relative_diff(r.buffers, zero.buffers, [name], symmetric=True) for r in ranks[1:]), default=0.0)
        if worst > report.param_rtol:
            report.buffers_across_ranks.append((name, worst))
    report.params_across_ranks = [
        name for name in params if any(r.final_digests.get(name) != zero.final_digests.get(name) for r in ranks[1:])
    ]
    for name in buffer_names:
        diff = _relative_diff(zero.final, reference.final, [name], symmetric=True)
        if diff > report.param_rtol:
            report.buffers_vs_reference.append((name, diff))
    init_across = [n for n in everything if any(r.initial_digests.get(n) != zero.initial_digests.get(n) for r in ranks)]
    report.cause = first_cause(report, init_across)
    return report


def first_cause(report: ScalingReport, init_across: List[str]) -> Optional[Cause]:
    """The first cause found, in the order of this module's docstring; None when the runs are equivalent."""
    n, a = report.devices, report.accumulate
    if report.init_name is not None or init_across:
        where = report.init_name or init_across[0]
        return Cause(
            "init",
            f"the initial weights differ ({where}: "
            + (f"max |diff| {report.init_diff:.3g} between the runs)" if report.init_name else "across ranks)")
            + ": the module's initialisation is not reproducible from the seed, so nothing after it can be compared",
            "build layers in configure_model() (shardwise initialises them from the seed, the same under every "
            "strategy) or draw initial values from torch's generator after seed_everything(); do not seed per "
            "rank, read the clock or os.urandom, or load different weights per process.",
        )
    for row in report.rows:
        if row.shared and not row.union_equal:
            what = "every rank trained on the same samples" if row.identical else "ranks trained on shared samples"
            return Cause(
                "same_samples",
                f"{what} (step {row.step}: {row.shared} samples seen by more than one rank), so the {n} ranks "
                "trained on fewer distinct samples than the 1-process batch",
                "let the Trainer shard the data: return a plain DataLoader (with shuffle=True or a RandomSampler / "
                "SequentialSampler: shardwise gives each rank its share), or make your own sampler or "
                "IterableDataset yield a disjoint share per rank (torch.distributed.get_rank() and get_world_size()).",
            )
    first = report.rows[0] if report.rows else None
    ratio = None
    if first is not None and first.union_equal and first.reference and first.run is not None:
        ratio = first.run / first.reference  # same weights, same samples: only the loss's scale can differ
        share = n * a
        if share > 1 and abs(ratio * share - 1) < _RATIO_TOLERANCE:
            return Cause(
                "summed_loss",
                f"the loss is summed without its weight: at step 1, from the same weights and samples, the {n}-rank "
                f"loss is {ratio:.4g} x the 1-process loss, 1/{share} = 1/(devices x accumulation), the share of one "
                "micro-batch in the global batch; its gradients are off by the same factor",
                "return a mean, or define loss_weight() so the Trainer normalises by the global count: "
                "training_step returns the summed loss and loss_weight(batch) the number of items it sums over.",
            )
    if report.buffers_across_ranks or report.params_across_ranks:
        if report.buffers_across_ranks:
            name, diff = report.buffers_across_ranks[0]
            what = f"buffer {name} differs across ranks after {_steps(report.steps)} (rel. diff {diff:.3g})"
        else:
            what = f"parameter {report.params_across_ranks[0]} differs across ranks after {_steps(report.steps)}"
        return Cause(
            "rank_state",
            f"{what}: state that only some ranks update",
            "update it on every rank (not under `if trainer.is_global_zero` / rank == 0), from values all ranks "
            "agree on: reduce statistics of each rank's samples across ranks (torch.distributed.all_reduce; "
            "BatchNorm: nn.SyncBatchNorm.convert_sync_batchnorm).",
        )
    factors = sorted({n, a, n * a} - {1})
    if ratio is not None and any(abs(ratio * g - 1) < _RATIO_TOLERANCE for f in factors for g in (f, 1 / f)):
        return Cause(
            "scaled_loss",
            f"at step 1, from the same weights and samples, the {n}-rank loss is {ratio:.4g} x the 1-process loss "
            "(a factor of the world size or the accumulation count)",
            "return the loss of the micro-batch as it is: the Trainer already averages over the accumulation "
            "window and the data-parallel ranks (do not divide or multiply by accumulate_grad_batches or the "
            "world size).",
        )
    loss_bad = [r for r in report.rows if r.rel_diff is None or r.rel_diff > report.loss_rtol]
    numbers_bad = bool(loss_bad) or report.param_diff > report.param_rtol
    if numbers_bad and any(not r.union_equal for r in report.rows):
        row = next(r for r in report.rows if not r.union_equal)
        return Cause(
            "data_order",
            f"the ranks' samples are disjoint but at step {row.step} their union is not the 1-process batch, so "
            "the two runs trained on different data",
            "shard one global order across ranks: a plain DataLoader (shardwise's sampler splits one seeded "
            "permutation), or a DistributedSampler with the same seed on every rank.",
        )
    if numbers_bad:
        parts = []
        if loss_bad:
            row = max(loss_bad, key=lambda r: math.inf if r.rel_diff is None else r.rel_diff)
            parts.append(f"loss rel. diff {_sci(row.rel_diff)} at step {row.step} (tolerance {report.loss_rtol:g})")
        if report.param_diff > report.param_rtol:
            parts.append(
                f"parameters rel. diff {report.param_diff:.3g} (tolerance {report.param_rtol:g}; largest in "
                f"{report.param_name}, |diff| {report.param_max:.3g})"
            )
        hints = []
        if report.dropout:
            hints.append(
                f"the module drops at random ({', '.join(report.dropout[:3])}): masks differ between a 1-process "
                "and an N-rank run; check a configuration without dropout (e.g. --init_args.dropout 0)"
            )
        if report.weighted:
            hints.append(
                "the module defines loss_weight(batch): training_step must return the sum of the per-item losses "
                "over exactly the items loss_weight counts (not a mean, and not divided by anything)"
            )
        else:
            hints.append(
                "if training_step averages over a count that varies between micro-batches (target tokens, "
                "unmasked labels), return the sum and define loss_weight(batch) so the Trainer divides by the "
                "global count"
            )
        hints.append("look for randomness or state in training_step that depends on the rank or the batch size")
        return Cause("differs", "differs beyond tolerance: " + "; ".join(parts), "; ".join(hints) + ".")
    if report.buffers_vs_reference:
        name, diff = report.buffers_vs_reference[0]
        return Cause(
            "reference_buffer",
            f"buffer {name} differs from the 1-process run after {_steps(report.steps)} (rel. diff {diff:.3g}): state "
            "computed from each rank's share of the batch",
            "compute it from the global batch: reduce it across ranks (torch.distributed.all_reduce), or use "
            "nn.SyncBatchNorm for BatchNorm statistics.",
        )
    return None
