"""Run the real model and the real strategy code on fake tensors and record per-rank memory.

One trace = what rank 0 of a `world`-rank job does, with nothing allocated: a
fake process group (torch's "fake" backend: collectives return at once),
FakeTensorMode (tensors carry shape, dtype and device, no data), and the
strategy object the Trainer would run, set up through its public planning
entry (`Strategy.setup_fake_environment`: rank 0 of the planned world, and
fake tensors of the same shapes and shards where training would allocate and
initialise) -- `FSDPStrategy.setup_module` then applies activation
checkpointing, `select_units` and `fully_shard` exactly as in training --
followed by one optimizer step through the Trainer's own step functions
(shardwise/step.py: `forward_backward` per micro-batch, `optimizer_update`).
Memory is counted by shardwise.memory's tracker (the one the accuracy test
measures real runs with), in count-fake mode, through its public hooks. DDP
is traced unwrapped; see `_traced` for why and how its buckets are
accounted.

Corrections that make fake-mode numbers mean what real ones do:
- DTensor derives each new op's output metadata by running it on global-shape
  tensors under whatever fake mode is active -- ours -- so the tracker would
  count full-size temporaries that never exist (this is the "optimizer state
  over-count in fake mode" seen with FSDPMemTracker and foreach optimizers).
  Allocations made while the sharding propagator runs are ignored (see
  fake_world: only the first trace in a process ran them, as the propagator
  caches each op schema).
- Gradients of fake parameters are labelled as they land (the tracker hooks
  fake parameters when it counts fake storages), and what survives a
  non-final micro-batch is labelled carried gradient state
  (`MemoryTracker.relabel`), so activations can be told apart.
- Only phases are recorded, not one global peak: for every phase (forward /
  backward of each micro-batch, optimizer step) we keep the upper envelope
  of a few "views" of the category totals, evaluated at several activation
  scales. Scale r = m/b predicts micro-batch m from a trace at b (activations
  are proportional to the batch, model states are not); views let one
  data-parallel trace also answer for ZeRO stages (strategies/accounting.py).
  Each phase's envelope is kept apart for three moments (before the first
  block, among the blocks, after the last): traces at two depths are
  extrapolated moment by moment, so each line joins the same moment.
- The second step is derived, not traced: it is the first plus what the
  first left behind (optimizer state; DDP's gradient buckets).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import nn

from shardwise import step
from shardwise.distributed.env import single_process_env
from shardwise.memory import MemoryTracker
from shardwise.module import drain_logs
from shardwise.plan.adapters import fake_4bit_weights, fill_quant_states, quant_state_bytes
from shardwise.plan.candidates import Candidate
from shardwise.plan.errors import PlanError
from shardwise.plan.kernels import target_attention
from shardwise.plan.moe_trace import balanced_dispatch
from shardwise.plan.optim import OptimizerChoice, resolve_optimizer
from shardwise.plan.presets import ModelSpec, meta_copy, spec_batch
from shardwise.strategies.accounting import View, accounting_for
from shardwise.strategies.fsdp import apply_activation_checkpointing

_PROPAGATING = threading.local()
IDENTITY = View()
DDP_VIEW = View(buckets=True)
# DDP with gradient_as_bucket_view=False (Lightning's and torch's default): the reducer's flat
# buckets are allocated at construction, beside the .grad tensors, as large as the parameters.
DDP_SEPARATE_BUCKETS_VIEW = View(cp=2.0)
_NO_GRAD = "~nograd"


class TraceFailed(RuntimeError):
    """The model cannot run under fake tensors (data-dependent control flow, unsupported op)."""


@dataclass
class Trace:
    """What one fake run recorded. envelope[(phase, view, r)] = (bytes, (P, G, O, B, A) at that moment)."""

    depth: Optional[int]
    micro_batch: int
    accumulation: int
    envelope: Dict[Tuple[str, str, float], Tuple[float, Tuple[float, ...]]] = field(default_factory=dict)
    params: int = 0  # persistent (sharded) parameter bytes after set-up
    grads: int = 0  # gradient bytes alive right before the optimizer step
    optimizer: int = 0  # optimizer state bytes after the step
    buffers: int = 0
    units: List[str] = field(default_factory=list)
    largest_transient: int = 0  # the largest single block allocated and released within the step
    # The same envelope kept apart by where in the phase its moment lies (MOMENTS): what `extrapolate`
    # draws lines through, so that each line joins the same moment at two depths.
    moments: Dict[Tuple[str, str, float, str], Tuple[float, Tuple[float, ...]]] = field(default_factory=dict)

    def peak(self, view: str, r: float) -> Tuple[float, str, Tuple[float, ...]]:
        """(bytes, phase, parts) at the highest moment of `view` at activation scale `r`."""
        best = (0.0, "", (0.0,) * 5)
        for (phase, name, scale), (value, parts) in self.envelope.items():
            if name == view and scale == r and value > best[0]:
                best = (value, phase, parts)
        return best


# Where in a phase a moment lies, told apart by the blocks' forward calls (a checkpointed block's
# recomputation included): before the first block starts, among the blocks, after the last one ends.
# A phase's highest moment can lie in a different part at 3 blocks than at 4 -- the forward's
# all-gathers at the start and the loss at the end are near ties at Llama 3.1 70B's shapes -- and
# a line through two different moments predicts neither (its category parts even go negative).
MOMENTS = ("first", "blocks", "last")


def _collapse(moments: Mapping[Tuple[str, str, float, str], Tuple[float, Tuple[float, ...]]]) -> Dict:
    """The envelope per (phase, view, scale): the highest of its moments."""
    env: Dict[Tuple[str, str, float], Tuple[float, Tuple[float, ...]]] = {}
    for (phase, name, r, _), (value, parts) in moments.items():
        best = env.get((phase, name, r))
        if best is None or value > best[0]:
            env[(phase, name, r)] = (value, parts)
    return env


class _PhaseRecorder:
    """Per-phase envelopes of the tracker's category totals; `sample` is the tracker's on_change hook.

    Each phase's envelope is kept per stretch between two block boundaries (a block's forward
    starting or ending) and folded into MOMENTS when the step ends.
    """

    def __init__(self, views: Dict[str, View], scales: Sequence[float], optimizer_scale: float = 1.0) -> None:
        # Resident fraction of the optimizer state on the device: 1 for torch's optimizers, 0.25 for
        # 8-bit state (traced as fp32), the configured fraction for paged state.
        self.optimizer_scale = optimizer_scale
        self.views = dict(views)
        for name, view in views.items():
            if view.buckets:
                self.views[name + _NO_GRAD] = view.without_grads()
        self.scales = tuple(scales)
        self._phase: Optional[str] = None
        self.stretch = 0  # block boundaries crossed in this phase
        self.stretches: Dict[str, int] = {}  # phase -> the stretch it ended in
        self.raw: Dict[Tuple[str, str, float, int], Tuple[float, Tuple[float, ...]]] = {}
        self.moments: Dict[Tuple[str, str, float, str], Tuple[float, Tuple[float, ...]]] = {}

    @property
    def phase(self) -> Optional[str]:
        return self._phase

    @phase.setter
    def phase(self, phase: Optional[str]) -> None:
        if self._phase is not None:
            self.stretches[self._phase] = self.stretch
        self._phase, self.stretch = phase, 0

    def boundary(self, *_: Any) -> None:
        """A block's forward starts or ends (a module hook)."""
        self.stretch += 1

    def hook_blocks(self, model: nn.Module, block_classes: Sequence[type]) -> List[Any]:
        """Mark block boundaries of `model`'s blocks; the hook handles, to remove after the step."""
        types = tuple(c for c in block_classes if isinstance(c, type))
        names = {c for c in block_classes if isinstance(c, str)}  # a Hugging Face model's, by class name
        handles = []
        for m in model.modules():
            if isinstance(m, types) or type(m).__name__ in names:
                handles.append(m.register_forward_pre_hook(self.boundary))
                handles.append(m.register_forward_hook(self.boundary))
        return handles

    def fold(self) -> None:
        """The step is over: each phase's stretches become its first / blocks / last moments."""
        self.phase = None
        for (phase, name, r, stretch), (value, parts) in self.raw.items():
            last = self.stretches.get(phase, 0)
            where = MOMENTS[0] if stretch == 0 else MOMENTS[2] if stretch == last else MOMENTS[1]
            best = self.moments.get((phase, name, r, where))
            if best is None or value > best[0]:
                self.moments[(phase, name, r, where)] = (value, parts)
        self.raw = {}

    @property
    def envelope(self) -> Dict[Tuple[str, str, float], Tuple[float, Tuple[float, ...]]]:
        return _collapse(self.moments)

    def tracker(self) -> MemoryTracker:
        """A fake-counting tracker that reports to this recorder and skips DTensor's metadata runs."""
        return MemoryTracker(count_fake=True, on_change=self.sample, ignore_op=_propagating)

    def label(self, phase: str) -> Callable[..., None]:
        """A step hook (step.py's before_backward) that starts `phase`."""

        def start(*_: Any) -> None:
            self.phase = phase

        return start

    def sample(self, cur: Mapping[str, int]) -> None:
        phase = self.phase
        if phase is None:
            return
        p, g, o, b = cur["parameters"], cur["gradients"], cur["optimizer"] * self.optimizer_scale, cur["buffers"]
        a = cur["activations"] + cur["other"]
        env, stretch = self.raw, self.stretch
        for name, view in self.views.items():
            for r in self.scales:
                value = view(p, g, o, b, a, r)
                key = (phase, name, r, stretch)
                best = env.get(key)
                if best is None or value > best[0]:
                    env[key] = (value, (p, g, o, b, a))

    def synthesize_second_step(self, grads: int, optimizer: int) -> None:
        """Step 2's forward/backward = step 1's plus what step 1 left behind.

        Tracing a second step costs as much as the first; its only difference is
        the optimizer state (and, with DDP buckets, the full gradients) being
        alive throughout, which adds a constant to every moment of the phase.
        """
        moments = self.moments
        for (phase, name, r, where), (value, (p, g, o, b, a)) in list(moments.items()):
            if not phase.startswith(("fwd1.", "bwd1.")) or name.endswith(_NO_GRAD):
                continue
            view = self.views[name]
            if view.buckets:  # the envelope without gradients, plus the full buckets
                value, (p, g, o, b, a) = moments[(phase, name + _NO_GRAD, r, where)]
                value, g = value + view.cg * grads, grads
            second = phase[:3] + "2" + phase[4:]  # "bwd1.0" -> "bwd2.0"
            moments[(second, name, r, where)] = (value + view.co * optimizer, (p, g, o + optimizer, b, a))
        for key in [k for k in moments if k[1].endswith(_NO_GRAD)]:
            del moments[key]


def _propagating() -> bool:
    """Whether DTensor's sharding propagation is running on this thread (see fake_world)."""
    return bool(getattr(_PROPAGATING, "depth", 0))


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A fake default process group of `world_size` ranks (this process is rank 0) for the duration."""
    if dist.is_initialized():
        raise PlanError(
            "The memory planner needs its own (fake) process group, but one is already initialised in "
            "this process. Plan before the strategy sets up (e.g. in the launching process)."
        )
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    # The propagator runs each new op schema once on global-shape fake tensors, under the active
    # fake mode (ours), inside `with ShardingPropagator._fake_mode_lock:` -- a slot torch leaves
    # for tests to replace (with a threading.Lock). Ours marks those ops so the tracker skips
    # them; without it the first trace in a process counts two extra parameter-sized lists in a
    # foreach optimizer step (cached schemas are not re-run, so later traces were right).
    # torch before 2.12 has no such slot: there the method that runs those ops is wrapped instead.
    slot = "_fake_mode_lock" if hasattr(ShardingPropagator, "_fake_mode_lock") else None
    previous = getattr(ShardingPropagator, slot or "_propagate_tensor_meta_non_cached")
    if slot:
        ShardingPropagator._fake_mode_lock = _PropagationMarker(previous)
    else:

        def marked(self: Any, op_schema: Any) -> Any:
            with _PropagationMarker(contextlib.nullcontext()):
                return previous(self, op_schema)

        ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        setattr(ShardingPropagator, slot or "_propagate_tensor_meta_non_cached", previous)
        dist.destroy_process_group()


class _PropagationMarker:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        self.inner.__enter__()
        _PROPAGATING.depth = getattr(_PROPAGATING, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _PROPAGATING.depth -= 1
        self.inner.__exit__(*exc)


def _trace_precision(name: str) -> str:
    # fp16 is refused on CPU; its tensors have bf16's sizes, so trace that.
    return {"16-mixed": "bf16-mixed", "16-true": "bf16-true"}.get(name, name)


def _rank0_env(world_size: int, num_nodes: int):
    return dataclasses.replace(
        single_process_env(),
        world_size=world_size,
        global_rank=0,
        local_rank=0,
        node_rank=0,
        num_nodes=num_nodes,
        local_world_size=max(1, world_size // num_nodes),
    )


def _fresh_module(spec: ModelSpec, depth: Optional[int], optimizer: Any) -> Any:
    if spec.kind != "module":
        return spec.training_module(
            depth=depth, foreach=optimizer.foreach, optimizer=optimizer.base, fused=optimizer.fused
        )
    # Never touch the user's object: trace a copy whose tensors are meta ones.

    return meta_copy(spec.module)


def _traced(cand: Candidate) -> Tuple[Candidate, Any]:
    """The configuration actually traced, and its accounting (strategies/accounting.py).

    ZeRO stages are traced as DDP, CPU offload as its on-device part. DDP
    itself is traced unwrapped (as on one device): DistributedDataParallel's
    C++ reducer reads parameter data at construction, which fake tensors do not
    have. Its memory is the module's plus one effect, modelled by DDP_VIEW: with
    gradient_as_bucket_view (our default) the gradients live in buckets that
    stay allocated after zero_grad, so from the second step on they are always there.
    """
    plan = accounting_for(cand.plan).traced_plan(cand.plan)
    # The user's own object is traced when it is the engine that runs (not for ZeRO's DDP stand-in).
    traced = dataclasses.replace(cand, plan=plan) if plan.engine == cand.plan.engine else Candidate(plan)
    return traced, accounting_for(plan)


def _build_traced_strategy(traced: Candidate, by_hand: bool, spec: ModelSpec) -> Any:
    """The strategy object to run: the user's own (a fresh copy, offload off), or the candidate's."""
    if traced.strategy is not None:
        strategy = copy.deepcopy(traced.strategy)
        if getattr(strategy, "cpu_offload", False):
            strategy.cpu_offload = False  # offload is CUDA-only: its on-device part is traced
        return strategy
    if by_hand:  # the engine has no checkpointing option: trace() checkpoints the blocks itself
        if not spec.block_classes:
            raise PlanError("activation checkpointing needs the model's block class; none was found")
        traced = dataclasses.replace(traced, plan=dataclasses.replace(traced.plan, ac="none"))
    return traced.build_strategy(spec.block_classes, None)


def trace(
    spec: ModelSpec,
    cand: Candidate,
    *,
    world_size: int,
    num_nodes: int,
    precision: str,
    seq_len: int,
    micro_batch: int,
    accumulation: int,
    depth: Optional[int],
    scales: Sequence[float] = (1.0,),
    views: Optional[Dict[str, View]] = None,
    foreach: Optional[bool] = None,
    optimizer: Any = "adamw",
    target: str = "cpu",
) -> Trace:
    """Trace the first optimizer step of `cand` on rank 0 (the second is derived); call inside `fake_world`.

    optimizer: a name or an OptimizerChoice (plan/optim.py); target: "cuda" traces attention with
    CUDA's kernels and the optimizer with CUDA's defaults (plan/kernels.py, plan/optim.py).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    if not isinstance(optimizer, OptimizerChoice):
        optimizer = resolve_optimizer(optimizer, foreach=foreach, target=target)
    traced, acct = _traced(cand)
    by_hand = traced.plan.uses_ac and not acct.has_ac_option
    strategy = _build_traced_strategy(traced, by_hand, spec)
    strategy.connect("cpu", _trace_precision(precision), num_nodes=num_nodes, devices=world_size // num_nodes)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # The one step of set-up that would allocate -- materialisation -- gives fake tensors instead.
    env = _rank0_env(*acct.trace_world(world_size, num_nodes))
    strategy.setup_fake_environment(env, fake)
    module = _fresh_module(spec, depth, optimizer)
    with strategy.module_init_context():
        module.configure_model()
    if by_hand:
        # DeepSpeed checkpoints the same blocks with its own wrapper (same saved tensors).
        apply_activation_checkpointing(module, set(spec.block_classes))
    result = Trace(depth=depth, micro_batch=micro_batch, accumulation=accumulation)
    buckets = acct.grad_buckets(world_size)
    recorder = _PhaseRecorder(
        views or {"identity": DDP_VIEW if buckets else IDENTITY}, scales, optimizer_scale=optimizer.state_scale
    )
    tracker = recorder.tracker()
    try:
        # FSDP shards on meta outside the fake mode (faster); DDP's set-up runs inside it.
        with contextlib.nullcontext() if acct.shards_on_meta else fake:
            try:
                model = strategy.setup_module(module)
            except ValueError as exc:
                if traced.plan.tp * traced.plan.sp == 1:
                    raise
                # tensor / sequence parallel refuse a model they cannot split, naming the fix: the
                # configuration cannot run, which no estimate hides.
                raise PlanError(f"{traced.config_label}: {exc}") from exc
        if hasattr(module, "sp_mesh"):  # the planner's LMModule: a Hugging Face model splits its batch itself
            module.sp_mesh = getattr(strategy, "sp_mesh", None)
        quant_state = _fill_quant_states(spec, model, fake)
        with fake, target_attention(target):
            opt_config = module.configure_optimizers()
            optimizers = (
                opt_config
                if isinstance(opt_config, (list, tuple))
                else [opt_config["optimizer"] if isinstance(opt_config, dict) else opt_config]
            )
            optimizers = [strategy.setup_optimizer(optimizer.apply(o)) for o in optimizers]
            batches = [spec_batch(spec, micro_batch, seq_len) for _ in range(accumulation)]
            tracker.register(strategy.unwrap(model), optimizers)
            hooks = recorder.hook_blocks(strategy.unwrap(model), spec.block_classes)
            undo_dispatch = balanced_dispatch(strategy.unwrap(model))  # fake tensors hold no routing
            try:
                with tracker, _fake_4bit(quant_state):
                    result.params = tracker.current_breakdown["parameters"]
                    result.buffers = tracker.current_breakdown["buffers"]
                    tracker.begin_transient_window()
                    _train_step(strategy, model, module, batches, tracker, recorder, optimizers, result)
            finally:
                for handle in hooks:
                    handle.remove()
                undo_dispatch()
            recorder.fold()
            recorder.synthesize_second_step(result.grads, result.optimizer)
    except (PlanError, TraceFailed):
        raise
    except Exception as exc:  # data-dependent shapes, ops without fake kernels, ...
        raise TraceFailed(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    # QLoRA's quantisation states sit beside the sharded codes, whole on every rank, outside any
    # module's parameters or buffers: the tracker never sees them, so they are added as buffers.
    result.moments = {
        key: (value + quant_state, (*parts[:3], parts[3] + quant_state, parts[4]))
        for key, (value, parts) in recorder.moments.items()
    }
    result.envelope = _collapse(result.moments)
    result.buffers += quant_state
    result.units = list(getattr(strategy, "units", []))
    result.largest_transient = tracker.largest_transient_bytes
    return result


def _fill_quant_states(spec: ModelSpec, model: nn.Module, fake: Any) -> int:
    """QLoRA: fake quantisation states for the 4-bit layers (a loader's job in training); their bytes."""
    if spec.adapters is None or not spec.adapters.load_in_4bit:
        return 0
    with fake:
        fill_quant_states(model)
    return quant_state_bytes(model)


def _fake_4bit(quant_state: int) -> Any:
    if not quant_state:
        return contextlib.nullcontext()
    return fake_4bit_weights()


def _train_step(
    strategy: Any,
    model: nn.Module,
    module: Any,
    batches: List[Any],
    tracker: MemoryTracker,
    recorder: _PhaseRecorder,
    optimizers: List[Any],
    result: Trace,
) -> None:
    """The first optimizer step, through the Trainer's own step functions (shardwise/step.py).

    Only what the Trainer does around them differs: phase labels instead of
    callbacks and progress marks, no health check or clipping, logs dropped
    after each micro-batch's backward.
    """
    window = len(batches)
    for i, batch in enumerate(batches):
        last = i == window - 1
        recorder.phase = f"fwd1.{i}"
        step.forward_backward(
            strategy, model, (batch,), window=window, last=last, before_backward=recorder.label(f"bwd1.{i}")
        )
        drain_logs(module)
        if not last:
            # FSDP2 keeps a no-sync micro-batch's unsharded gradients on its own unsharded
            # parameters, which no hook labels; born in the backward they would count as
            # activations and be scaled with the micro-batch.
            tracker.relabel("gradients", ("activations", "other"))
    result.grads = tracker.current_breakdown["gradients"]
    recorder.phase = "opt"
    step.optimizer_update(strategy, model, optimizers)
    result.optimizer = int(tracker.current_breakdown["optimizer"] * recorder.optimizer_scale)
    recorder.phase = None


def extrapolate(a: Trace, b: Trace, depth: int) -> Trace:
    """Linear in depth: each phase's envelope (and its breakdown) at `depth` from traces at two depths."""
    if a.depth == b.depth:
        raise ValueError("need two different depths")
    t = (depth - a.depth) / (b.depth - a.depth)

    def lin(x: float, y: float) -> float:
        return x + (y - x) * t

    def line(at_a: Mapping, at_b: Mapping) -> Dict:
        out = {}
        for key, (va, parts_a) in at_a.items():
            vb, parts_b = at_b.get(key, (va, parts_a))
            out[key] = (lin(va, vb), tuple(lin(x, y) for x, y in zip(parts_a, parts_b)))
        return out

    # Each moment of a phase on its own line, then the highest at `depth` (see MOMENTS).
    moments = line(a.moments, b.moments)
    return Trace(
        depth=depth,
        micro_batch=a.micro_batch,
        accumulation=a.accumulation,
        envelope=_collapse(moments) if moments else line(a.envelope, b.envelope),
        moments=moments,
        params=int(lin(a.params, b.params)),
        grads=int(lin(a.grads, b.grads)),
        optimizer=int(lin(a.optimizer, b.optimizer)),
        buffers=int(lin(a.buffers, b.buffers)),
        units=b.units,
        largest_transient=max(a.largest_transient, b.largest_transient),
    )
