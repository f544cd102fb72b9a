"""`plan()`: does it fit, and which configuration is fastest that fits?

The steps, in order:
1. resolve the model (preset, config.json, python:module.Class, TrainModule)
   and validate the layout before anything is traced;
2. trace every FSDP / DDP configuration on fake tensors with the real strategy
   code (trace.py), at 3 and 4 blocks (one AC period apart for every-N-th-block
   checkpointing) extrapolated to the depth. Each engine's accounting
   (strategies/accounting.py) says what is traced: ZeRO rides on the DDP trace,
   FSDP CPU offload on FULL_SHARD's;
3. only when the whole per-device batch does not fit, trace once more with
   two micro-batches (gradient accumulation holds gradients between them)
   and read every smaller micro-batch size off that trace's scaled envelopes;
4. attach a step-time estimate (cost.py) and pick the fastest configuration
   whose *reserved* memory (allocator.py's model) fits with headroom (recommend.py);
   when that leaves something on the table, try the optimizer variants (variants.py).
The target's kernels and defaults are traced, not the planning machine's (kernels.py:
attention, dropout; optim.py: the optimizer's implementation, paged / 8-bit state).
If the model cannot run under fake tensors, every row falls back to the
analytic per-block estimate and the plan says so.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from shardwise.plan import analytic, moe, parallel, variants
from shardwise.plan.adapters import build_adapters, check_candidates, compute_dtype_name
from shardwise.plan.allocator import Allocator, expandable_segments_from_env
from shardwise.plan.candidates import Candidate, batch_splits, check_layout, from_strategy, requested_candidates
from shardwise.plan.cost import Hardware, gpu_of_this_machine, step_cost
from shardwise.plan.errors import PlanError
from shardwise.plan.inputs import validate_inputs
from shardwise.plan.jobs import Setting, TraceJob, run_jobs
from shardwise.plan.optim import OptimizerChoice, resolve_optimizer
from shardwise.plan.parallel import group_batch, layer_shape, replicated_flops, search_parallel, with_parallel_degrees
from shardwise.plan.presets import ModelSpec, describe, resolve_model
from shardwise.plan.recommend import DEFAULT_HEADROOM, binding_limit, format_seconds, recommend, usable
from shardwise.plan.rows import fsdp_offload_row, identity_view, split_breakdown, view_key
from shardwise.plan.trace import Trace, TraceFailed, extrapolate
from shardwise.strategies.accounting import accounting_for
from shardwise.strategies.parallel import ParallelPlan

RESERVED_FACTOR = 1.25  # the old flat factor; only used when asked for (reserved_factor=1.25)
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")


@dataclass
class Estimate:
    """One candidate at one micro-batch split. Bytes are per device (per rank)."""

    candidate: Candidate
    allocated: float
    reserved: float
    breakdown: Dict[str, float]
    cpu_per_node: float
    step_seconds: float
    comm_bytes: float
    method: str
    fits: Optional[bool] = None
    phase: str = ""  # where the peak is: fwd2.0 / bwd2.0 (forward / backward of micro-batch 0, step 2), opt
    device_fits: Optional[bool] = None  # reserved <= (1 - headroom) x device memory
    host_fits: Optional[bool] = None  # host memory per node <= (1 - headroom) x cpu_memory (None: not given)

    @property
    def label(self) -> str:
        return self.candidate.label

    def to_dict(self) -> Dict[str, Any]:
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "candidate"}
        return {"candidate": self.candidate.to_dict(), **d}


@dataclass
class Plan:
    model: str
    params: int
    world_size: int
    devices: int
    num_nodes: int
    precision: str
    batch_size: int
    seq_len: int
    device_memory: Optional[int]
    cpu_memory: Optional[int]
    reserved_factor: Optional[float]  # None: the allocator model (allocator.py) decides reserved memory
    hardware: Dict[str, str]
    estimates: List[Estimate]
    recommended: Optional[Estimate]
    reason: str
    notes: List[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    block_classes: Tuple[Any, ...] = ()  # what the FSDP / checkpointing candidates wrapped
    optimizer: str = ""  # as traced: name (implementation, paged / 8-bit state)
    allocator: str = ""  # how reserved memory is derived
    assumptions: List[str] = field(default_factory=list)  # printed under the table
    headroom: float = DEFAULT_HEADROOM  # fraction of device / host memory a fitting row leaves free
    binding: Optional[str] = None  # when nothing fits: "device", "host" or "both"
    variants: List[Dict[str, Any]] = field(default_factory=list)  # optimizer variants that change the verdict

    @property
    def fits_uses(self) -> str:
        how = self.allocator or f"reserved = allocated x {self.reserved_factor:g}"
        return how + (f"; fits = reserved <= {1 - self.headroom:.0%} of device memory" if self.headroom else "")

    def to_dict(self) -> Dict[str, Any]:
        skip = ("estimates", "recommended", "block_classes")
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in skip}
        d["block_classes"] = [getattr(b, "__name__", str(b)) for b in self.block_classes]
        d["fits_uses"] = self.fits_uses
        d["estimates"] = [e.to_dict() for e in self.estimates]
        d["recommended"] = self.recommended.to_dict() if self.recommended else None
        return d


def plan(
    model: Any,
    example_batch: Any = None,
    *,
    batch_size: int = 1,
    seq_len: Optional[int] = None,
    devices: int = 1,
    num_nodes: int = 1,
    device_memory: Union[None, str, int] = None,
    precision: str = "bf16-mixed",
    cpu_memory: Union[None, str, int] = None,
    candidates: Optional[Iterable[Union[str, ParallelPlan, Candidate, Any]]] = None,
    accelerator: str = "cuda",
    gpu: Optional[str] = None,
    interconnect: str = "nvlink",
    network: str = "infiniband",
    reserved_factor: Optional[float] = None,
    deepspeed_config: Optional[Dict[str, Any]] = None,
    optimizer: str = "adamw",
    all_micro_batches: bool = False,
    workers: Optional[int] = None,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
    paged_resident: float = 0.0,
    expandable_segments: Optional[bool] = None,
    strategy: Any = None,
    lora_r: int = 0,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    lora_target_modules: Optional[List[str]] = None,
    load_in_4bit: bool = False,
    headroom: float = DEFAULT_HEADROOM,
    optimizer_variants: bool = True,
    tp_size: Optional[int] = None,
    sp_size: Optional[int] = None,
    ep_size: Optional[int] = None,
) -> Plan:
    """Predict per-device memory and step time for each configuration; recommend the fastest that fits.

    Args:
        model: preset name, path to a Hugging Face config.json, "python:module.Class", a GPTConfig,
            or a TrainModule (then `example_batch` is one batch of its training_step).
        batch_size: sequences per device per optimizer step (split into micro-batches when needed).
        seq_len: tokens per sequence (default: the model's context length).
        devices, num_nodes: devices per node and nodes.
        device_memory: e.g. "80GiB"; without it nothing is judged to fit or not.
        cpu_memory: host memory per node, checked against offload and loading needs.
        candidates: names like "ddp", "fsdp_ac", "deepspeed_stage_3_offload", ParallelPlans, or
            Strategy objects (default: all, seed order).
        accelerator: "cuda" (GPU target: its attention kernels, optimizer defaults, caching allocator) or "cpu".
        reserved_factor: a flat reserved / allocated ratio instead of the allocator model.
        optimizer: adamw, adam, sgd, adamw_fused, adamw_foreach, adamw_forloop, paged_adamw_32bit,
            paged_adamw_8bit, adamw_8bit (plan/optim.py). For a TrainModule its own optimizer is
            traced; foreach / fused still override its implementation.
        foreach, fused: the optimizer implementation (default: PyTorch's on the target: foreach on CUDA).
        paged_resident: fraction of a paged optimizer's state counted as resident on the device (default 0).
        expandable_segments: the allocator setting (default: PYTORCH_CUDA_ALLOC_CONF, else off as in PyTorch).
        strategy: a Strategy object (or a name, or a ParallelPlan) to plan exactly, instead of the candidate list.
        all_micro_batches: evaluate every micro-batch split, not only when the full batch does not fit.
        workers: processes tracing in parallel (default: 2 on a machine with 2+ cores, for 4+ traces).
        lora_r, lora_alpha, lora_dropout, lora_target_modules, load_in_4bit: plan LoRA (lora_r > 0) or
            QLoRA (and load_in_4bit) fine-tuning, as the finetune recipe's flags (plan/adapters.py).
        headroom: fraction of the device (and host) memory a configuration must leave free to fit
            (default 0.1; 0 judges against the whole device).
        optimizer_variants: when nothing fits or a faster configuration misses, also plan the 8-bit /
            paged AdamW variants and report those that change the verdict (plan.variants, plan.notes).
        tp_size, sp_size: plan the FSDP configurations at these tensor / sequence parallel degrees (1 turns
            one off); neither given, when nothing in the default comparison fits, the degrees are searched
            (plan/parallel.py).
        ep_size: expert parallel degree of a mixture-of-experts model's FSDP rows (default: searched; plan/moe.py).
    """
    start = time.perf_counter()
    if not 0.0 <= headroom < 1.0:
        raise PlanError(f"headroom={headroom!r}: a fraction of device memory to leave free, 0 <= headroom < 1.")
    spec = resolve_model(model, example_batch)
    adapters = build_adapters(lora_r, lora_alpha, lora_dropout, lora_target_modules, load_in_4bit)
    if adapters is not None:
        spec = replace(spec, adapters=replace(adapters, compute_dtype=compute_dtype_name(precision)))
    layout = validate_inputs(
        spec,
        batch_size,
        seq_len,
        devices,
        num_nodes,
        device_memory,
        cpu_memory,
        precision,
        accelerator,
        reserved_factor,
    )
    world, seq_len, dev_mem, cpu_mem, factor = layout
    gpu = gpu or gpu_of_this_machine()  # the step-time model's and cuBLAS workspaces' GPU
    hw = Hardware(gpu=gpu if accelerator == "cuda" else "cpu", interconnect=interconnect, network=network)
    if strategy is not None:
        if candidates is not None:
            raise PlanError("plan(strategy=...) plans that one strategy; leave candidates unset.")
        cands = [from_strategy(strategy)]
        if deepspeed_config is None:  # a DeepSpeedStrategy's resolved config (other strategies have none)
            deepspeed_config = getattr(cands[0].strategy, "config", None)
        check_layout(cands, world, num_nodes)
    else:
        cands = requested_candidates(candidates, world, num_nodes)
        if candidates is None and accelerator == "cpu":
            # Offload moves state from device to host memory; on a CPU both are the same memory
            # (FSDPStrategy says so and does nothing): it saves nothing, so it is never a choice.
            cands = [c for c in cands if not c.plan.offload_optimizer]
    requested = candidates is not None or strategy is not None
    cands, parallel_notes = with_parallel_degrees(
        cands, spec, seq_len, world, num_nodes, tp_size, sp_size, requested=requested
    )
    cands, ep_notes = parallel.with_expert_degrees(cands, spec, world, num_nodes, ep_size, requested=requested)
    cands, adapter_notes = check_candidates(adapters, cands, requested=requested)
    opt = resolve_optimizer(optimizer, foreach=foreach, fused=fused, paged_resident=paged_resident, target=accelerator)
    expandable = expandable_segments_from_env() if expandable_segments is None else bool(expandable_segments)
    alloc = Allocator(accelerator=accelerator, expandable_segments=expandable, factor=factor, gpu=hw.gpu)
    shared = dict(world=world, num_nodes=num_nodes, precision=precision, seq_len=seq_len, batch_size=batch_size)
    shared.update(device_memory=dev_mem, cpu_memory=cpu_mem, allocator=alloc, hw=hw, target=accelerator)
    shared.update(deepspeed_config=deepspeed_config, workers=workers, headroom=headroom)
    planner = _Planner(spec, cands, optimizer=opt, all_micro=all_micro_batches, **shared)
    planner.notes += adapter_notes + parallel_notes + ep_notes
    estimates = planner.run()
    if any(accounting_for(c.plan).analytic_states for c in cands) and (
        opt.paged or opt.state_scale != 1.0 or opt.name != "adamw"
    ):
        planner.notes.append(
            f"ZeRO rows use DeepSpeed's own Adam accounting (fp32 moments, its step temporaries), "
            f"not {opt.name}: DeepSpeed builds its optimizer from its config."
        )
    best, reason = recommend(estimates, dev_mem, headroom=headroom, cpu_memory=cpu_mem)
    if best is None and dev_mem is not None and not requested and (tp_size, sp_size, adapters) == (None,) * 3:
        # Nothing fits: at long sequences activations decide that, and sequence / tensor parallel split them.
        extra, search_notes = search_parallel(spec, seq_len, world, num_nodes, offload=accelerator == "cuda")
        if extra:
            more = _Planner(spec, extra, optimizer=opt, all_micro=all_micro_batches, **shared)
            estimates += more.run()
            planner.notes += search_notes + [n for n in more.notes if n not in planner.notes]
            best, reason = recommend(estimates, dev_mem, headroom=headroom, cpu_memory=cpu_mem)
    planner.notes += moe.worst_case_notes(moe.moe_facts(spec), estimates, seq_len, precision)
    tried: List[Dict[str, Any]] = []
    if optimizer_variants and variants.worth_trying(opt.name, estimates, best, spec.kind, adapters):

        def replan(name: str, retry: List[Candidate]) -> Tuple[Optional[Estimate], List[Estimate]]:
            other = resolve_optimizer(name, paged_resident=paged_resident, target=accelerator)
            rows = _Planner(spec, retry, optimizer=other, all_micro=all_micro_batches, **shared).run()
            return recommend(rows, dev_mem, headroom=headroom, cpu_memory=cpu_mem)[0], rows

        retry = variants.candidates_to_retry(estimates, best, lambda c: not accounting_for(c.plan).analytic_states)
        tried, variant_notes = variants.try_variants(replan, retry, best)
        planner.notes += variant_notes
    opt_text = (
        opt.describe()
        if spec.kind != "module" or foreach is not None or fused is not None
        else (f"the module's own ({opt.implementation} on {accelerator})")
    )
    assumptions = [
        f"optimizer: {opt_text}",
        "attention: "
        + (
            "SDPA flash / memory-efficient kernels (no seq x seq matrix)"
            if accelerator == "cuda"
            else "the CPU kernels"
        ),
        *alloc.assumptions(),
    ]
    return Plan(
        model=describe(spec),
        params=planner.params,
        world_size=world,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        device_memory=dev_mem,
        cpu_memory=cpu_mem,
        reserved_factor=factor,
        hardware=dict(gpu=hw.gpu, interconnect=hw.interconnect, network=hw.network, accelerator=accelerator),
        estimates=estimates,
        recommended=best,
        reason=reason,
        notes=planner.notes,
        elapsed_s=time.perf_counter() - start,
        block_classes=tuple(spec.block_classes),
        optimizer=opt_text,
        allocator=alloc.describe(),
        assumptions=assumptions,
        headroom=headroom,
        binding=binding_limit(estimates),
        variants=tried,
    )


# ------------------------------------------------------------------ the planner
class _Planner:
    def __init__(
        self,
        spec: ModelSpec,
        cands: List[Candidate],
        *,
        world: int,
        num_nodes: int,
        precision: str,
        seq_len: int,
        batch_size: int,
        device_memory: Optional[int],
        cpu_memory: Optional[int],
        allocator: Allocator,
        hw: Hardware,
        deepspeed_config: Optional[Dict[str, Any]],
        optimizer: OptimizerChoice,
        target: str,
        all_micro: bool,
        workers: Optional[int],
        headroom: float = DEFAULT_HEADROOM,
    ) -> None:
        self.spec, self.cands, self.world, self.num_nodes = spec, cands, world, num_nodes
        self.precision, self.seq_len, self.batch_size = precision, seq_len, batch_size
        self.device_memory, self.cpu_memory, self.allocator, self.hw = device_memory, cpu_memory, allocator, hw
        self.deepspeed_config = deepspeed_config
        self.all_micro, self.workers, self.headroom = all_micro, workers, headroom
        self.setting = Setting(
            world_size=world,
            num_nodes=num_nodes,
            seq_len=seq_len,
            foreach=optimizer.foreach,
            optimizer=optimizer,
            target=target,
        )
        self.notes: List[str] = []
        self.per_node = max(1, world // num_nodes)
        full = spec.depth
        # 3 and 4, not 2 and 3: with two blocks FSDP's backward prefetch has no steady state yet.
        self.depths: Tuple[Optional[int], ...] = (3, 4) if spec.kind != "module" and full and full > 4 else (full,)
        if len(self.depths) == 2:
            self.notes.append(f"Traced at 3 and 4 blocks and extrapolated linearly to {full}.")
        self.threshold = analytic.zero_settings(deepspeed_config)["stage3_param_persistence_threshold"]
        self.stats = {d: analytic.spec_param_stats(spec, d, self.threshold) for d in self.depths}
        self.full_stats = self._at_full(lambda d: self.stats[d])
        self.params = self.full_stats.total
        self.zero = analytic.zero_settings(deepspeed_config, self.full_stats)
        self.traces: Dict[Tuple[Candidate, str, int, int], Trace] = {}
        self.failed: Optional[str] = None

    def _depths_for(self, traced: Candidate) -> Tuple[Optional[int], ...]:
        """The depths `traced` is traced at: 3 and 4 blocks, or one whole period apart for every-N-th-block AC.

        Checkpointing every N-th block makes memory periodic in depth: 3 -> 4 blocks adds an
        un-checkpointed block when N = 2, and extrapolating that slope charges every block as
        un-checkpointed. Two depths that are multiples of N (at least 3 blocks, for FSDP's
        prefetch steady state) have the same pattern, so their difference is one period's cost.
        """
        option = traced.plan.selective_ac_option if traced.plan.ac == "selective" else None
        if len(self.depths) < 2 or not isinstance(option, int) or option < 2:
            return self.depths
        first = option * -(-3 // option)
        if first + option > self.spec.depth:
            return (self.spec.depth,)  # a period as deep as the model: trace it whole
        return (first, first + option)

    def _stats_at(self, depth: Optional[int]) -> Any:
        if depth not in self.stats:
            self.stats[depth] = analytic.spec_param_stats(self.spec, depth, self.threshold)
        return self.stats[depth]

    def _at_full(self, fn: Any) -> Any:
        if len(self.depths) == 1:
            return fn(self.depths[0])
        return fn(3).scaled(fn(4), float(self.spec.depth - 3))

    # ---------------------------------------------------------- what is traced
    def _traced(self, cand: Candidate) -> Tuple[Candidate, str]:
        """(configuration, precision) whose trace answers for `cand` (its accounting's traced_plan).

        ZeRO stages ride on a plain data-parallel trace in DeepSpeed's own
        precision; FSDP CPU offload on its on-device part (FULL_SHARD's trace).
        """
        acct = accounting_for(cand.plan)
        plan, precision = acct.traced_plan(cand.plan), acct.trace_precision(self.precision)
        if plan == cand.plan:
            return cand.config_key, precision
        if cand.strategy is not None and plan.engine == cand.plan.engine:  # the user's object, on-device part
            return replace(cand.config_key, plan=plan, custom=cand.custom + " (on device)"), precision
        return Candidate(plan).config_key, precision

    def _views(self, traced: Candidate, precision: str, depth: Optional[int]) -> Tuple[Tuple[str, Any], ...]:
        # One process: DDPStrategy does not wrap, so there are no buckets to outlive zero_grad.
        views = [("identity", identity_view(traced, self.world))]
        grad_bytes = 2.0 if precision in ("bf16-true", "16-true") else 4.0
        for c in self.cands:  # configurations whose model states are accounted, on this trace's activations
            acct = accounting_for(c.plan)
            if acct.analytic_states and self._traced(c) == (traced, precision):
                terms = acct.terms(c.plan, self._stats_at(depth), self.world, self.precision, self.zero)
                views.append((view_key(c), acct.view(c.plan, terms, grad_bytes, self.zero)))
        return tuple(views)

    def _jobs(
        self, traced: Candidate, precision: str, micro: int, accumulation: int, scales: Tuple[float, ...]
    ) -> List[TraceJob]:
        return [
            TraceJob(traced, precision, micro, accumulation, d, scales, self._views(traced, precision, d))
            for d in self._depths_for(traced)
        ]

    def _run(self, groups: List[Tuple[Candidate, str, int, int, Tuple[float, ...]]]) -> None:
        """Trace every (configuration, precision, micro-batch, accumulation) group at each depth."""
        todo = [g for g in dict.fromkeys(groups) if g[:4] not in self.traces]
        jobs = {g: self._jobs(*g) for g in todo}
        results = run_jobs(self.spec, self.setting, [j for js in jobs.values() for j in js], self.workers)
        for g, js in jobs.items():
            runs = [results[j] for j in js]
            failed = next((r for r in runs if isinstance(r, TraceFailed)), None)
            if failed is not None:
                raise failed
            self.traces[g[:4]] = runs[0] if len(runs) == 1 else extrapolate(runs[0], runs[1], self.spec.depth)

    # ---------------------------------------------------------- estimates
    def run(self) -> List[Estimate]:
        # A tp x sp group's data-parallel rank takes the group's sequences (plan/parallel.py).
        splits = {c: batch_splits(group_batch(c.plan, self.batch_size)) for c in self.cands}
        try:
            self._run([(*self._traced(c), splits[c][0][0], 1, (1.0,)) for c in self.cands])
            for c in self.cands:
                depths = self._depths_for(self._traced(c)[0])
                if len(depths) == 2 and depths != self.depths:
                    self.notes.append(
                        f"{c.config_label}: checkpoints one block in {c.plan.selective_ac_option}, so it is "
                        f"traced at {depths[0]} and {depths[1]} blocks (a whole period apart) and extrapolated."
                    )
            full = {c: splits[c][0][0] for c in self.cands}
            rows = {
                c: [self._estimate(c.with_batch(full[c], 1), self.traces[(*self._traced(c), full[c], 1)], 1.0)]
                for c in self.cands
            }
            # Smaller micro-batches only where the whole batch does not fit: one more trace with
            # two micro-batches (accumulation keeps gradients between them) answers every size.
            need = [c for c in self.cands if len(splits[c]) > 1 and (self.all_micro or rows[c][0].fits is False)]
            m1 = {c: splits[c][1][0] for c in need}
            self._run([(*self._traced(c), m1[c], 2, tuple(m / m1[c] for m, _ in splits[c][1:])) for c in need])
            for c in need:
                tr = self.traces[(*self._traced(c), m1[c], 2)]
                rows[c] += [self._estimate(c.with_batch(m, k), tr, m / m1[c]) for m, k in splits[c][1:]]
            return [e for c in self.cands for e in rows[c]]
        except TraceFailed as exc:
            self.failed = str(exc)
            self.notes.append(
                f"The model does not run under fake tensors ({exc}); every row is the analytic "
                "per-block estimate instead of a trace."
            )
            return [e for cand in self.cands for e in self._fallback_for(cand, splits[cand])]

    def _estimate(self, cand: Candidate, tr: Trace, r: float) -> Estimate:
        if accounting_for(cand.plan).analytic_states:
            allocated, phase, breakdown, host, method = self._zero(cand, tr, r)
        elif cand.plan.offload_optimizer:
            allocated, phase, breakdown, host, method = fsdp_offload_row(self.spec, tr, r)
        else:
            allocated, phase, breakdown, host, method = self._traced_estimate(cand, tr, r)
        depths = self._depths_for(self._traced(cand)[0])
        if len(depths) == 2:
            method += f", extrapolated from {depths[0]}-{depths[1]} blocks"
        return self._finish(cand, allocated, phase, breakdown, host, method, self._transient(cand, tr, r))

    def _transient(self, cand: Candidate, tr: Trace, r: float) -> float:
        """The largest transient block at activation scale r (a smaller micro-batch read off a larger one's
        trace): a batch-sized block (logits) shrinks with the batch, none below a parameter-sized one (a
        gathered unit, an optimizer temporary: at most a block's or the largest layer's fp32 bytes)."""
        if r >= 1:
            return tr.largest_transient
        counts = self.spec.param_counts()
        state = 4.0 * max(counts["per_block"], counts["largest_layer"]) / cand.plan.tp
        return min(tr.largest_transient, max(r * tr.largest_transient, state))

    def _finish(
        self,
        cand: Candidate,
        allocated: float,
        phase: str,
        breakdown: Dict[str, float],
        host: float,
        method: str,
        largest_transient: float = 0.0,
    ) -> Estimate:
        sync = getattr(cand.strategy, "accumulation_sync", "reduce_scatter")
        cost = step_cost(
            cand,
            self.hw,
            params=self.params,
            flops_per_token=self.spec.flops_per_token(self.seq_len),
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            world=self.world,
            num_nodes=self.num_nodes,
            precision=self.precision,
            accumulation_sync=sync,
            shape=layer_shape(self.spec),
            replicated_flops_per_token=replicated_flops(self.spec, cand.plan),
            experts=moe.moe_facts(self.spec),
        )
        load = self.params * (2 if self.precision in ("bf16-true", "16-true") else 4)
        cpu = host * self.per_node + load  # offloaded state of this node's ranks + one full copy for loading
        workspaces = self.allocator.workspace_bytes  # cuBLAS', held from the first matmul on (allocator.py)
        if workspaces:
            breakdown = {**breakdown, "temporary": breakdown.get("temporary", 0.0) + workspaces}
            allocated += workspaces
        steady = sum(breakdown.get(k, 0.0) for k in ("parameters", "gradients", "optimizer")) + workspaces
        if not largest_transient:  # no trace (fallback): the largest activation-sized block it counts
            largest_transient = breakdown.get("temporary", 0.0) / 2
        reserved = self.allocator.reserved(allocated, steady, largest_transient)
        fits = device_fits = host_fits = None
        if self.cpu_memory is not None:
            host_fits = cpu <= usable(self.cpu_memory, self.headroom)
        if self.device_memory is not None:
            device_fits = reserved <= usable(self.device_memory, self.headroom)
            fits = device_fits and host_fits is not False
        return Estimate(
            candidate=cand,
            allocated=allocated,
            reserved=reserved,
            breakdown=breakdown,
            cpu_per_node=cpu,
            step_seconds=cost.seconds,
            comm_bytes=cost.comm_bytes,
            method=method,
            fits=fits,
            phase=phase,
            device_fits=device_fits,
            host_fits=host_fits,
        )

    def _traced_estimate(self, cand: Candidate, tr: Trace, r: float):
        value, phase, parts = tr.peak("identity", r)
        p, g, o, b, a = parts
        breakdown = split_breakdown(
            value, params=min(p, tr.params) + b, grads=min(g, tr.grads), opt=min(o, tr.optimizer), acts=r * a
        )
        return value, phase, breakdown, 0.0, "traced"

    def _zero(self, cand: Candidate, tr: Trace, r: float):
        acct = accounting_for(cand.plan)
        terms = acct.terms(cand.plan, self.full_stats, self.world, self.precision, self.zero)
        best = (0.0, "", (0.0,) * 5)
        for (phase, view, scale), (value, parts) in tr.envelope.items():
            if view == view_key(cand) and scale == r and phase != "opt" and value > best[0]:
                best = (value, phase, parts)
        value, phase, (p, g, o, b, a) = best
        value += acct.unviewed_bytes(cand.plan, terms)
        traced_grad_bytes = 2.0 if self._traced(cand)[1] in ("bf16-true", "16-true") else 4.0
        grads = acct.held_gradients(cand.plan, terms, g, traced_grad_bytes)
        breakdown = split_breakdown(
            value, params=terms.weights + terms.master + b, grads=grads, opt=terms.optimizer, acts=r * a
        )
        step = acct.step_bytes(cand.plan, terms) + tr.buffers
        if step > value:
            value, phase = step, "opt"
            breakdown = split_breakdown(
                step,
                params=terms.weights + terms.master + tr.buffers,
                grads=terms.step_grads,
                opt=terms.optimizer,
                acts=0.0,
            )
        return value, phase, breakdown, terms.host, "ZeRO accounting + traced activations"

    def _fallback_for(self, cand: Candidate, splits: List[Tuple[int, int]]) -> List[Estimate]:
        rows = []
        for i, (m, k) in enumerate(splits):
            if i > 0 and not (self.all_micro or rows[0].fits is False):
                break
            value, breakdown = analytic.fallback_estimate(
                self.spec, cand, self.full_stats, self.world, self.num_nodes, self.precision, m, self.seq_len, self.zero
            )
            host = 0.0
            if cand.plan.offload_optimizer:  # per rank on the host
                host = accounting_for(cand.plan).fallback_host_bytes(self.full_stats.total / self.world)
            breakdown = {k2: breakdown.get(k2, 0.0) for k2 in CATEGORIES}
            rows.append(self._finish(cand.with_batch(m, k), value, "", breakdown, host, "analytic per-block fallback"))
        return rows


__all__ = ["plan", "Plan", "Estimate", "RESERVED_FACTOR", "format_seconds"]
