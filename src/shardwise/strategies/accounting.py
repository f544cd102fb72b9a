"""What each engine costs in memory and communication, beside the strategies: pure arithmetic.

The memory planner (plan/) runs DDP and FSDP on fake tensors and models
DeepSpeed's ZeRO from DeepSpeed's own partitioning rules. What differs per
engine lives here, one class per engine, looked up from a ParallelPlan's
`engine` (`accounting_for`): which configuration a trace runs for it (ZeRO on
a plain data-parallel trace, FSDP offload on its on-device part), at which
world size and precision; the per-device weights, gradients and optimizer
bytes when nothing can be traced; ZeRO's partitions; the host bytes of
offload; the bytes each rank communicates per optimizer step and the
host<->device traffic of offload. The planner asks these objects and never
branches on an engine's name; a new engine or parallel dimension extends a
class here. Imports neither torch nor plan/.

Communication per optimizer step, ring collectives (all-reduce 2(n-1)/n of
the buffer, all-gather and reduce-scatter (n-1)/n), k micro-batches; each
engine's `collectives` gives the counts and `comm_bytes` prices them (for
DDP and FSDP, tests/distributed/test_collective_counts.py counts the same
collectives in training):

  DDP, FSDP NO_SHARD  all-reduce gradients once per step (no_sync between micro-batches)
  FSDP FULL_SHARD     all-gather parameters in forward and again in backward, per micro-batch;
                      reduce-scatter gradients every micro-batch (FSDPStrategy's default
                      accumulation_sync="reduce_scatter"), once per step with "none"
  FSDP SHARD_GRAD_OP  one all-gather per micro-batch (kept for backward); reduce-scatter as FULL_SHARD
  FSDP HYBRID_SHARD   FULL_SHARD inside a node, all-reduce of the shards across nodes once per step
  ZeRO-1              reduce-scatter gradients at the boundary, all-gather parameters after the step
  ZeRO-2              as ZeRO-1, but gradients are reduced every micro-batch
  ZeRO-3              all-gather in forward and backward, reduce-scatter, per micro-batch

ZeRO's per-rank model states (`ZeROAccounting.terms`), measured against
DeepSpeed on CPU: bf16 / fp16 weights, an fp32 master partition, two fp32 Adam
moments per partition element; gradients partitioned (stage 2: in the training
dtype; stage 3: fp32) and reduced through a bucket of `reduce_bucket_size`
elements; at stage 3 parameters under `stage3_param_persistence_threshold`
stay whole on every rank and up to `stage3_max_live_parameters` are gathered
at once; the optimizer step on one flat fp32 partition makes two
partition-sized temporaries (at stage 3 only for the partitioned parameters,
plus one more gradient-partition copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, Tuple

from shardwise.strategies.parallel import ParallelPlan

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


def weight_bytes(precision: str) -> int:
    """Bytes per parameter DeepSpeed trains in: bf16 / fp16 for the half modes, fp32 otherwise."""
    return 4 if precision in ("32-true", "64-true") else 2


def _gather_bytes(precision: str) -> float:
    return 2.0 if precision not in ("32-true", "64-true") else 4.0  # bytes a gathered parameter travels in


def _reduce_bytes(precision: str) -> float:
    return 2.0 if precision in ("bf16-true", "16-true") else 4.0  # gradient reduction dtype


def _recomputed(plan: ParallelPlan) -> float:
    """Fraction of the layers whose forward activation checkpointing runs again ("op": none whole)."""
    if plan.ac == "full":
        return 1.0
    option = plan.selective_ac_option
    return 1.0 / option if plan.ac == "selective" and isinstance(option, int) else 0.0


@dataclass(frozen=True)
class View:
    """bytes = cp*params + cg*grads + co*optimizer + buffers + r*ca*activations + const, at one moment.

    `buckets`: from the second step on the gradients never drop below their
    full size (DDP's gradient buckets outlive zero_grad; .grad are views into
    them). Subclasses (ZeroView) may compute anything from the same
    five category totals; cg / co / buckets tell `synthesize_second_step` how
    step 1's leftovers enter the view.
    """

    cp: float = 1.0
    cg: float = 1.0
    co: float = 1.0
    ca: float = 1.0
    const: float = 0.0
    buckets: bool = False

    def __call__(self, p: float, g: float, o: float, b: float, a: float, r: float) -> float:
        return self.cp * p + self.cg * g + self.co * o + b + self.const + self.ca * r * a

    def without_grads(self) -> "View":
        return View(self.cp, 0.0, self.co, self.ca, self.const, False)


class Accounting:
    """DDP (and one device): every rank holds the whole model; gradients are all-reduced once per step."""

    engine = "ddp"
    #: the strategy has an activation-checkpointing option (DDPStrategy has none: a trace of it
    #: checkpoints the blocks by hand, as DeepSpeed's own wrapper would)
    has_ac_option = False
    #: model states come from this class's arithmetic, only activations from a trace (ZeRO)
    analytic_states = False
    #: parameters are sharded (DTensors) on meta before the fake mode starts (FSDP); traces that
    #: share a depth share the sharded layout, and a process's op caches
    shards_on_meta = False
    #: relative CPU cost of one trace (FSDP adds DTensor dispatch)
    trace_cost = 1.0

    # ---------------------------------------------------------------- how it is traced
    def traced_plan(self, plan: ParallelPlan) -> ParallelPlan:
        """The configuration whose fake-tensor trace answers for `plan`."""
        return plan

    def trace_precision(self, precision: str) -> str:
        return precision

    def trace_world(self, world: int, num_nodes: int) -> Tuple[int, int]:
        """(world size, nodes) the trace sets up. DDP runs unwrapped, as one process:
        DistributedDataParallel's C++ reducer reads parameter data at construction, which fake
        tensors do not have; its gradient buckets are accounted for by `grad_buckets`."""
        return 1, 1

    def grad_buckets(self, world: int) -> bool:
        """Whether gradient buckets outlive zero_grad (DDP's, with more than one rank)."""
        return world > 1

    def planner_notes(self, strategy: Any) -> str:
        """What a user's strategy object adds to its plan's label (options the plan does not carry)."""
        bucket_view = (getattr(strategy, "ddp_kwargs", None) or {}).get("gradient_as_bucket_view", True)
        return "" if bucket_view else " (gradient_as_bucket_view=False)"

    # ---------------------------------------------------------------- memory without a trace
    def shard_degree(self, plan: ParallelPlan, world: int, num_nodes: int) -> int:
        return 1

    def autocast_copies(self, params: int, precision: str) -> float:
        """Saved activations beyond the blocks': autocast's bf16 weight copies, kept for the backward."""
        return 2 * params if precision in ("bf16-mixed", "16-mixed") else 0.0

    def fallback_states(
        self,
        plan: ParallelPlan,
        stats: Any,
        world: int,
        num_nodes: int,
        precision: str,
        depth: int,
        block_params: float,
        settings: Dict[str, int],
    ) -> Dict[str, float]:
        """Per-device parameters, gradients, optimizer state and gathered temporaries, from the counts alone."""
        n, w = stats.total, max(1, world)
        act_bytes = 2 if precision not in ("32-true", "64-true") else 4
        store = 2 if precision in ("bf16-true", "16-true") else (8 if precision == "64-true" else 4)
        shard = self.shard_degree(plan, w, num_nodes)
        unit = block_params / plan.tp  # a gathered block: this rank's tp slice of it
        gathered = 0.0 if shard == 1 else 2 * unit * act_bytes + (n - depth * block_params) / plan.tp * act_bytes
        states = dict(
            parameters=store * n / shard,
            gradients=store * n / shard,
            optimizer=8 * n / shard,
            temporary=gathered + (2 * unit * 4 if shard > 1 else 0),
        )
        if plan.offload_optimizer:
            states["parameters"] = 0.0
            states["optimizer"] = 0.0
        return states

    def fallback_host_bytes(self, params_per_rank: float) -> float:
        """Bytes per rank on the host when offloaded (without a trace)."""
        return 0.0

    # ---------------------------------------------------------------- communication
    def collectives(
        self, plan: ParallelPlan, accumulation: int, accumulation_sync: str = "reduce_scatter"
    ) -> Dict[str, int]:
        """Collectives per optimizer step of `accumulation` micro-batches, each over one FSDP unit's (DDP
        bucket's) parameters or gradients, keyed "kind/group" (group: the mesh's `shard` dimension or the
        `replicate` one). `comm_bytes` prices exactly these; tests/distributed/test_collective_counts.py
        counts them in training. DDP: one all-reduce per bucket per step (no_sync before the last)."""
        return {"all_reduce/replicate": 1}

    def comm_bytes(
        self,
        plan: ParallelPlan,
        n: float,
        world: int,
        num_nodes: int,
        accumulation: int,
        precision: str,
        accumulation_sync: str = "reduce_scatter",
    ) -> Tuple[float, float, float]:
        """Bytes each rank sends per optimizer step: (over the whole ring, inside a node, across nodes)."""
        w = max(1, world // plan.tp)  # replicas of each rank's tp slice
        ring = (w - 1) / w
        reduces = self.collectives(plan, accumulation, accumulation_sync)["all_reduce/replicate"]
        return reduces * 2 * ring * n / plan.tp * _reduce_bytes(precision), 0.0, 0.0

    def host_traffic(self, plan: ParallelPlan, shard: float, accumulation: int, precision: str) -> float:
        """Host <-> device bytes per step when offloaded."""
        return 0.0

    # ---------------------------------------------------------------- sequence / tensor parallel
    def activation_collectives(self, plan: ParallelPlan, layers: int, accumulation: int) -> Dict[str, float]:
        """Collectives over activations per optimizer step, keyed "kind/group" (sp / tp mesh dimension).

        Sequence parallel (Ulysses) all-to-alls q, k, v and the attention output in every layer's
        forward and their gradients in its backward (4 + 4); tensor parallel with sequence-parallel
        norms all-gathers the inputs of attention and of the MLP and reduce-scatters their outputs in
        the forward, and the reverse in the backward (2 + 2 each way). Activation checkpointing runs
        the checkpointed layers' forward again, collectives included.
        """
        passes = accumulation * layers * (2 + _recomputed(plan))
        counts: Dict[str, float] = {}
        if plan.sp > 1:
            counts["all_to_all/sp"] = 4 * passes
        if plan.tp > 1:
            counts["all_gather/tp"] = counts["reduce_scatter/tp"] = 2 * passes
        return counts

    def activation_comm_bytes(
        self, plan: ParallelPlan, tokens: int, hidden: int, kv_dim: int, layers: int, accumulation: int, precision: str
    ) -> float:
        """Bytes each rank sends per step in `activation_collectives`; `tokens` per micro-batch of its group.

        A rank's slice of q and the output is tokens/sp x hidden/tp, of k and v tokens/sp x kv_dim/tp,
        of a layer input tokens/sp x hidden; an all-to-all or a ring collective sends all but 1/n of it.
        """
        counts, act = self.activation_collectives(plan, layers, accumulation), _gather_bytes(precision)
        local = tokens / plan.sp * act
        out = 0.0
        if plan.sp > 1:  # per pass: q, k, v and the output
            qkvo = (2 * hidden + 2 * kv_dim) / plan.tp
            out += counts["all_to_all/sp"] / 4 * local * qkvo * (plan.sp - 1) / plan.sp
        if plan.tp > 1:
            ring = (plan.tp - 1) / plan.tp
            out += (counts["all_gather/tp"] + counts["reduce_scatter/tp"]) * local * hidden * ring
        return out


class FSDPAccounting(Accounting):
    """FSDP2: parameters, gradients and optimizer state sharded over the shard dimension of the mesh."""

    engine = "fsdp"
    has_ac_option = True
    shards_on_meta = True
    trace_cost = 1.5

    def traced_plan(self, plan: ParallelPlan) -> ParallelPlan:
        # CPU offload is CUDA-only, so never traced: its on-device part is (the planner moves the
        # sharded states to the host).
        return replace(plan, offload_params=False, offload_optimizer=False)

    def trace_world(self, world: int, num_nodes: int) -> Tuple[int, int]:
        return world, num_nodes

    def grad_buckets(self, world: int) -> bool:
        return False

    def planner_notes(self, strategy: Any) -> str:
        wrap = "" if getattr(strategy, "auto_wrap_policy", None) is not None else ", no auto_wrap_policy: one unit"
        sync = getattr(strategy, "accumulation_sync", "reduce_scatter")
        return wrap + ("" if sync == "reduce_scatter" else f", accumulation_sync={sync}")

    def shard_degree(self, plan: ParallelPlan, world: int, num_nodes: int) -> int:
        # tp splits every matrix first; FSDP shards what a rank holds over the rest of the mesh.
        if plan.sharding == "HYBRID_SHARD":
            return world // max(1, num_nodes)
        return world if plan.sharding in ("FULL_SHARD", "SHARD_GRAD_OP") else plan.tp

    def autocast_copies(self, params: int, precision: str) -> float:
        return 0.0  # FSDP's MixedPrecisionPolicy casts per unit instead of autocast

    def fallback_host_bytes(self, params_per_rank: float) -> float:
        return 16 * params_per_rank  # fp32 parameters, gradients and Adam's two moments

    def collectives(
        self, plan: ParallelPlan, accumulation: int, accumulation_sync: str = "reduce_scatter"
    ) -> Dict[str, int]:
        """FSDP2 as FSDPStrategy sets it up: every micro-batch all-gathers each unit's parameters (again for
        backward unless SHARD_GRAD_OP kept them; the strategy passes reshard_after_forward explicitly, so
        the root unit too) and, with accumulation_sync="reduce_scatter", reduce-scatters its gradients;
        the replica all-reduce (HYBRID_SHARD; NO_SHARD's only collective) runs once, on the last."""
        if plan.sharding == "NO_SHARD":  # a shard dimension of one rank: nothing to gather or scatter
            return {"all_reduce/replicate": 1}
        k = accumulation
        gathers = 1 if plan.sharding == "SHARD_GRAD_OP" else 2
        counts = {
            "all_gather/shard": k * gathers,
            "reduce_scatter/shard": k if accumulation_sync == "reduce_scatter" else 1,
        }
        if plan.sharding == "HYBRID_SHARD":
            counts["all_reduce/replicate"] = 1
        return counts

    def comm_bytes(
        self,
        plan: ParallelPlan,
        n: float,
        world: int,
        num_nodes: int,
        accumulation: int,
        precision: str,
        accumulation_sync: str = "reduce_scatter",
    ) -> Tuple[float, float, float]:
        if plan.sharding == "NO_SHARD":
            return super().comm_bytes(plan, n, world, num_nodes, accumulation, precision, accumulation_sync)
        # Under tp FSDP shards each rank's 1/tp of the parameters over the other world / tp ranks.
        w, n, wb, rb = max(1, world // plan.tp), n / plan.tp, _gather_bytes(precision), _reduce_bytes(precision)
        counts = self.collectives(plan, accumulation, accumulation_sync)
        gathers, scatters = counts["all_gather/shard"], counts["reduce_scatter/shard"]
        if plan.sharding == "HYBRID_SHARD":
            per_node = max(1, w // max(1, num_nodes))
            inner = (per_node - 1) / per_node
            intra_bytes = gathers * inner * n * wb + scatters * inner * n * rb
            nodes = max(1, num_nodes)
            reduces = counts["all_reduce/replicate"]
            inter_bytes = reduces * 2 * (nodes - 1) / nodes * n / per_node * rb
            return 0.0, intra_bytes, inter_bytes
        ring = (w - 1) / w
        return gathers * ring * n * wb + scatters * ring * n * rb, 0.0, 0.0

    def host_traffic(self, plan: ParallelPlan, shard: float, accumulation: int, precision: str) -> float:
        # fp32 shards up for every micro-batch's forward and backward, the gradient shard down
        return accumulation * 2 * shard * 4 + shard * 4


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
    stage: int, offload: bool, stats: Any, world: int, precision: str, settings: Dict[str, int]
) -> ZeroTerms:
    """ZeRO's per-rank model states for `stats` (total, small, largest_leaf parameter counts)."""
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


def zero_step_bytes(stage: int, terms: ZeroTerms) -> float:
    """Bytes during the optimizer step (activations are gone, parameters released, bucket kept at stage 3)."""
    bucket = terms.bucket if stage == 3 else 0.0
    return terms.weights + terms.master + terms.optimizer + terms.step_grads + terms.step_temps + bucket


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


class ZeROAccounting(Accounting):
    """DeepSpeed ZeRO: model states from DeepSpeed's partitioning, activations from a plain DDP trace."""

    engine = "deepspeed"
    has_ac_option = True
    analytic_states = True

    def traced_plan(self, plan: ParallelPlan) -> ParallelPlan:
        # A plain data-parallel trace with the same checkpointing: DeepSpeed checkpoints the same
        # blocks with its own wrapper (same saved tensors).
        return ParallelPlan("ddp", ac="full" if plan.uses_ac else "none")

    def trace_precision(self, precision: str) -> str:
        # With bf16 enabled DeepSpeed casts the module to bf16 and runs without autocast (so no
        # bf16 weight copies are saved, unlike DDP + autocast).
        return "bf16-true" if precision not in ("32-true", "64-true") else precision

    def planner_notes(self, strategy: Any) -> str:
        return ""

    def terms(self, plan: ParallelPlan, stats: Any, world: int, precision: str, settings: Dict[str, int]) -> ZeroTerms:
        return zero_terms(plan.zero_stage or 0, plan.offload_optimizer, stats, world, precision, settings)

    def step_bytes(self, plan: ParallelPlan, terms: ZeroTerms) -> float:
        return zero_step_bytes(plan.zero_stage or 0, terms)

    def view(self, plan: ParallelPlan, terms: ZeroTerms, trace_grad_bytes: float, settings: Dict[str, int]) -> View:
        """How a plain data-parallel trace reads as this stage's forward/backward bytes."""
        return zero_view(plan.zero_stage or 0, terms, trace_grad_bytes, settings)

    def unviewed_bytes(self, plan: ParallelPlan, terms: ZeroTerms) -> float:
        """Forward/backward bytes a trace's view leaves out: ZeRO-3's gathered parameters are capped, so
        not linear in depth, and are added (with its bucket) at the full depth."""
        return terms.bucket + terms.gathered if plan.zero_stage == 3 else 0.0

    def held_gradients(
        self, plan: ParallelPlan, terms: ZeroTerms, traced_grads: float, traced_grad_bytes: float
    ) -> float:
        """Gradient bytes at a moment of the backward: the partition, plus ZeRO-1's fp32 accumulators for
        the gradients produced so far (`traced_grads` bytes of them in the trace)."""
        return terms.grad_partition + (traced_grads * 4.0 / traced_grad_bytes if plan.zero_stage == 1 else 0.0)

    def autocast_copies(self, params: int, precision: str) -> float:
        return 0.0

    def fallback_states(
        self,
        plan: ParallelPlan,
        stats: Any,
        world: int,
        num_nodes: int,
        precision: str,
        depth: int,
        block_params: float,
        settings: Dict[str, int],
    ) -> Dict[str, float]:
        t = self.terms(plan, stats, world, precision, settings)
        grads = 4 * stats.total if plan.zero_stage == 1 else 0.0
        return dict(
            parameters=t.weights + t.master,
            gradients=t.grad_partition + grads,
            optimizer=t.optimizer,
            temporary=t.bucket + t.gathered,
        )

    def fallback_host_bytes(self, params_per_rank: float) -> float:
        return 18 * params_per_rank  # fp32 parameters, gradients, Adam, and the bf16 partition

    def collectives(
        self, plan: ParallelPlan, accumulation: int, accumulation_sync: str = "reduce_scatter"
    ) -> Dict[str, int]:
        """Passes over all the parameters (DeepSpeed buckets them; not counted by the tests): ZeRO-3
        gathers in forward and backward and reduce-scatters every micro-batch; ZeRO-2 reduces every
        micro-batch, ZeRO-1 at the boundary; both gather the updated parameters once after the step."""
        k = accumulation
        if plan.zero_stage == 3:
            return {"all_gather/shard": 2 * k, "reduce_scatter/shard": k}
        return {"reduce_scatter/shard": k if plan.zero_stage == 2 else 1, "all_gather/shard": 1}

    def comm_bytes(
        self,
        plan: ParallelPlan,
        n: float,
        world: int,
        num_nodes: int,
        accumulation: int,
        precision: str,
        accumulation_sync: str = "reduce_scatter",
    ) -> Tuple[float, float, float]:
        ring, wb = (world - 1) / world, _gather_bytes(precision)
        counts = self.collectives(plan, accumulation, accumulation_sync)
        gathers, reductions = counts["all_gather/shard"], counts["reduce_scatter/shard"]
        if plan.zero_stage == 3:
            return (gathers + reductions) * ring * n * wb, 0.0, 0.0
        return reductions * ring * n * wb + gathers * ring * n * wb, 0.0, 0.0

    def host_traffic(self, plan: ParallelPlan, shard: float, accumulation: int, precision: str) -> float:
        return accumulation * 2 * shard * _gather_bytes(precision) + shard * 4


ACCOUNTING: Dict[str, Accounting] = {
    "single": Accounting(),
    "ddp": Accounting(),
    "fsdp": FSDPAccounting(),
    "deepspeed": ZeROAccounting(),
}


def accounting_for(plan: ParallelPlan) -> Accounting:
    """The accounting of the plan's engine."""
    return ACCOUNTING[plan.engine]


__all__ = [
    "Accounting",
    "FSDPAccounting",
    "ZeROAccounting",
    "ZeroTerms",
    "View",
    "ZeroView",
    "accounting_for",
    "zero_terms",
    "zero_step_bytes",
    "weight_bytes",
    "ZERO_DEFAULTS",
]
