"""The planner inside `Trainer.fit`: choose for strategy="auto", warn when a configuration will not fit.

Both need the device memory, which the Trainer only knows when told
(`Trainer(device_memory="80GiB")`, or "auto" for the current CUDA device's
total), so nothing here runs -- and fit() is not slowed down -- unless the
user asked for it. It runs in the process that called fit(), before any
worker starts (the planner needs its own fake process group); workers the
launcher starts read the choice from their launch context
(LaunchContext.plan_choice) instead of planning again. The does-it-fit
warning for a strategy the user chose is planned and said once, by global
rank 0 of the workers. The model is planned from the user's TrainModule
(copied onto the meta device) and the first batch of the training
DataLoader; the Trainer's strategy is mapped back to the planner's candidate
for it. For strategy="auto" the chosen micro-batch split is part of the
choice: the training DataLoader rebuilt at the chosen batch size and the
accumulation (or the run is refused with the exact DataLoader(batch_size=...)
to use), in the launching process and in every worker.

Nothing here changes the Trainer: `check_before_fit` returns a FitDecision
(the strategy, loader and accumulation to use, what to say, what to pass to
the workers) and Trainer.fit applies it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from shardwise.data import rebuild
from shardwise.distributed import context
from shardwise.distributed.env import detect_env, device_for
from shardwise.memory import format_bytes, parse_bytes
from shardwise.plan.candidates import Candidate, from_strategy, parse_candidate
from shardwise.plan.core import plan
from shardwise.plan.errors import PlanError
from shardwise.plan.runcheck import PlanCheck, Prediction


@dataclass
class FitDecision:
    """What the planner decided before a fit, for Trainer.fit to apply; the planner itself changes nothing."""

    strategy: Any = None  # the strategy to train with instead of the automatic one (None: keep the Trainer's)
    train_dataloader: Any = None  # the training DataLoader re-batched to the chosen micro-batch (None: keep it)
    accumulate_grad_batches: Optional[int] = None  # the chosen accumulation (None: keep the Trainer's)
    message: str = ""  # what to tell the user, once, on global rank 0 ("" for nothing)
    plan_choice: Optional[Dict[str, Any]] = None  # the choice the workers apply (LaunchContext.plan_choice)
    check: Any = None  # a runcheck.PlanCheck for the configuration that runs (None: nothing predicted here)


# Device memory the caching allocator never sees, which "auto" leaves free: the CUDA context
# with its loaded kernels and cuBLAS/cuDNN handles (0.3-0.8 GiB with CUDA 12's lazy module
# loading), and NCCL's per-communicator buffers (channels x peers x NCCL_BUFFSIZE, a few hundred
# MiB each; a run has the world's communicator plus subgroups for hybrid meshes and
# point-to-point pairs). What the allocator itself holds beyond the trace (fragmentation, the
# largest transient block) is the planner's allocator model, not this.
CUDA_CONTEXT_BYTES = 768 * 2**20
NCCL_BYTES = 1024 * 2**20


def auto_device_budget(total: int, world_size: int) -> Tuple[int, str]:
    """The bytes the caching allocator can use on a device of `total` bytes, and how they were found."""
    nccl = NCCL_BYTES if world_size > 1 else 0
    budget = total - CUDA_CONTEXT_BYTES - nccl
    parts = f"{format_bytes(CUDA_CONTEXT_BYTES)} CUDA context and libraries"
    if nccl:
        parts += f", {format_bytes(nccl)} NCCL buffers"
    return budget, f"device_memory='auto': {format_bytes(total)} on the device - {parts} = {format_bytes(budget)}"


def _auto_note(world_size: int) -> str:
    return auto_device_budget(
        int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory), world_size
    )[1]


def resolve_device_memory(value: Any, accelerator: str, world_size: int = 1) -> Optional[int]:
    """None | "auto" | "80GiB" | bytes -> the bytes the planner may fill.

    "auto" is the current CUDA device's total memory less what lives outside the caching
    allocator (auto_device_budget); unknown (None) on the CPU. A size given by the user is
    taken as the allocator's budget as it is.
    """
    if value is None:
        return None
    if value == "auto":
        if accelerator != "cuda":
            return None
        import torch

        total = int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        return auto_device_budget(total, world_size)[0]
    try:
        return parse_bytes(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"Trainer(device_memory={value!r}) is not a memory size: {exc}") from exc


def candidate_for(strategy: Any) -> Optional[Candidate]:
    """The planner's candidate for a strategy object: its ParallelPlan (None for strategies it does not model)."""
    try:
        return Candidate(from_strategy(strategy).plan)
    except (PlanError, ValueError):
        return None


def check_before_fit(trainer: Any, module: Any, train_dataloaders: Any) -> Optional[FitDecision]:
    """Called by Trainer.fit before anything starts: choose (strategy="auto"), warn, or do nothing.

    Reads the Trainer's settings; returns the decision for fit() to apply (None: nothing to change).
    """
    world = trainer.devices * trainer.num_nodes
    if getattr(trainer, "device_memory", None) is None:
        return None
    env = detect_env()
    if env is not None and trainer.accelerator == "cuda":
        # A worker takes its own GPU before anything here touches CUDA: "auto" reads the current device's
        # memory, and a pin_memory loader's first batch makes a context on the current device (GPU 0 on
        # every rank, before the strategy would set it).
        torch.cuda.set_device(device_for("cuda", env.local_rank))
    device_memory = resolve_device_memory(trainer.device_memory, trainer.accelerator, world)
    if device_memory is None:
        return None
    auto = bool(getattr(trainer.strategy, "is_auto", False))
    choice = context.current().plan_choice
    if auto and choice and env is not None:
        # A worker the launcher started: the launching process has planned (same model, same answer).
        cand = parse_candidate(choice["candidate"])
        decision = FitDecision()
        if choice.get("micro_batch"):
            cand = cand.with_batch(int(choice["micro_batch"]), int(choice["accumulation"]))
            _batch_split(decision, trainer, train_dataloaders, cand)
        decision.strategy = _strategy_for(trainer, cand, blocks=tuple(choice.get("blocks") or ()))
        if choice.get("prediction"):
            decision.check = PlanCheck(Prediction.from_dict(choice["prediction"]))
        return decision
    launching = env is None and trainer.devices * trainer.num_nodes > 1
    if not auto and (launching or (env is not None and not env.is_global_zero)):
        return None  # the fit warning is planned and said once, by global rank 0 of the workers
    if not (hasattr(train_dataloaders, "dataset") and hasattr(train_dataloaders, "batch_size")):
        return None  # only a DataLoader can give a first batch without consuming the user's data
    batch = next(iter(train_dataloaders), None)
    if batch is None:
        return None
    micro = train_dataloaders.batch_size or 1
    window = trainer.accumulate_grad_batches
    current = candidate_for(trainer.strategy)
    try:
        if auto:
            result = _plan(trainer, module, batch, micro * window, device_memory, candidates=None)
            best = result.recommended
            if best is None:
                warnings.warn(f"strategy='auto' kept {type(trainer.strategy).__name__}: {result.reason}", stacklevel=3)
                return None
            c = best.candidate
            decision = FitDecision()
            split = _batch_split(decision, trainer, train_dataloaders, c)
            # FSDP policies accept class names; the workers re-batch the same way.
            names = [getattr(b, "__name__", str(b)) for b in result.block_classes]
            prediction = Prediction.from_estimate(best, trainer.accelerator)
            decision.check = PlanCheck(prediction)
            decision.plan_choice = {
                "candidate": c.name,
                "blocks": names,
                "micro_batch": c.micro_batch,
                "accumulation": c.accumulation,
                "prediction": prediction.to_dict(),
            }
            reason = result.reason.rstrip(".") + split + "." if split else result.reason
            if trainer.device_memory == "auto":
                reason += f" ({_auto_note(world)})"
            decision.strategy = _strategy_for(trainer, c, blocks=result.block_classes)
            decision.message = f"shardwise: strategy='auto' chose {c.config_label}: {reason}"
            return decision
        if current is None:
            return None
        # Exactly the user's strategy object (its wrap policy, AC policy, buckets), not its nearest preset; at
        # every micro-batch split, which one trace gives: the nearest change, when one of them fits.
        result = _plan(
            trainer, module, batch, micro * window, device_memory, candidates=[trainer.strategy], all_micro_batches=True
        )
    except PlanError as exc:
        warnings.warn(f"The memory planner could not plan this run: {exc}", stacklevel=3)
        return None
    mine = next((e for e in result.estimates if e.candidate.micro_batch == micro), None)
    if mine is None:
        return None
    check = FitDecision(check=PlanCheck(Prediction.from_estimate(mine, trainer.accelerator)))
    if mine.fits:
        return check  # (a run whose whole batch fits in one micro-batch fits with smaller ones too)
    rebatched = min((e for e in result.estimates if e.fits), key=lambda e: e.step_seconds, default=None)
    if rebatched is not None:  # the nearest change of all (_smallest_change's order): no other strategy is planned
        change = (
            "Smallest change that fits: the same strategy with "
            f"DataLoader(batch_size={rebatched.candidate.micro_batch}) "
            f"and accumulate_grad_batches={rebatched.candidate.accumulation}."
        )
    else:
        change = _smallest_change(trainer, module, batch, micro, window, device_memory, current)
    warnings.warn(
        f"The memory planner predicts this run will not fit: {current.config_label} with micro-batch {micro} "
        f"needs {format_bytes(mine.reserved)} per device (allocated {format_bytes(mine.allocated)}; "
        f"{result.fits_uses}), the device has {format_bytes(device_memory)}"
        f"{' (' + _auto_note(world) + ')' if trainer.device_memory == 'auto' else ''}. {change}",
        stacklevel=3,
    )
    return check


def _plan(trainer: Any, module: Any, batch: Any, batch_size: int, device_memory: int, **kwargs: Any) -> Any:
    # The whole process plans in-line (no worker processes): this is the user's training process.
    return plan(
        module,
        example_batch=batch,
        batch_size=batch_size,
        devices=trainer.devices,
        num_nodes=trainer.num_nodes,
        device_memory=device_memory,
        precision=trainer.strategy.precision.name,
        accelerator=trainer.accelerator,
        workers=1,
        **kwargs,
    )


def _smallest_change(
    trainer: Any, module: Any, batch: Any, micro: int, window: int, device_memory: int, current: Candidate
) -> str:
    """Plan every candidate and micro-batch split; name the fitting one closest to the current run."""
    result = _plan(trainer, module, batch, micro * window, device_memory, candidates=None, all_micro_batches=True)
    fitting = [e for e in result.estimates if e.fits]
    if not fitting:
        return result.reason

    def distance(e: Any) -> Tuple[int, int, int, float]:
        c, now = e.candidate.plan, current.plan
        same = (c.engine, c.sharding, c.zero_stage or 0) == (now.engine, now.sharding, now.zero_stage or 0)
        knobs = int(c.uses_ac != now.uses_ac) + int(c.offload_optimizer != now.offload_optimizer)
        return (0 if same else 1, knobs, int(e.candidate.micro_batch != micro), e.step_seconds)

    best = min(fitting, key=distance).candidate
    blocks = ", ".join(sorted(getattr(b, "__name__", str(b)) for b in result.block_classes)) or "Block"
    split = (
        ""
        if best.micro_batch == micro
        else (f", DataLoader(batch_size={best.micro_batch}) and accumulate_grad_batches={best.accumulation}")
    )
    return f"Smallest change that fits: strategy={best.trainer_strategy_code(blocks)}{split}."


def _batch_split(decision: FitDecision, trainer: Any, loader: Any, cand: Candidate) -> str:
    """Decide the run's micro-batch split: the user's DataLoader re-batched, or a refusal.

    The planner answers for `micro_batch` sequences per forward with
    `accumulation` micro-batches per optimizer step; the user's loader gives
    `batch_size` per forward. A plain DataLoader is rebuilt with the same
    dataset, sampler, collate_fn and worker settings at the new batch size (the
    per-device batch per optimizer step stays the same) and the Trainer
    accumulates `accumulation` micro-batches. A loader that cannot be rebuilt
    (a custom batch_sampler, no batch_size) is refused with the exact
    DataLoader(batch_size=...) to use. The new loader and accumulation go into
    `decision`; returns the sentence that says so.
    """
    current = getattr(loader, "batch_size", None)
    window = trainer.accumulate_grad_batches
    if current == cand.micro_batch and window == cand.accumulation:
        return ""
    new = rebatch(loader, cand.micro_batch)
    if new is None:
        raise ValueError(
            f"strategy='auto' chose {cand.label}, which needs micro-batches of {cand.micro_batch}: the training "
            f"DataLoader (batch_size={current}) cannot be re-batched automatically. Pass "
            f"DataLoader(..., batch_size={cand.micro_batch}) and Trainer(accumulate_grad_batches={cand.accumulation})."
        )
    decision.train_dataloader = new
    decision.accumulate_grad_batches = cand.accumulation
    return (
        f"; re-batched the training DataLoader from batch_size={current} x accumulate_grad_batches={window} "
        f"to batch_size={cand.micro_batch} x {cand.accumulation}"
    )


def rebatch(loader: Any, batch_size: int) -> Any:
    """The same DataLoader at another batch_size, or None if it cannot be rebuilt faithfully."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        return None
    if type(loader.batch_sampler) is not BatchSampler:
        return None  # a custom batch sampler decides the batch itself
    changes = {"batch_size": batch_size}
    if not isinstance(loader.dataset, IterableDataset):
        changes["sampler"] = loader.sampler  # the same order (shuffled or not); the Trainer distributes it
    try:
        return rebuild(loader, **changes)
    except (TypeError, ValueError):
        return None


def _strategy_for(trainer: Any, cand: Candidate, blocks: Any) -> Any:
    """The strategy for the planner's choice, connected as the Trainer's was; None where the automatic one is it."""
    if cand.plan.engine == "ddp":
        return None
    old = trainer.strategy
    strategy = cand.build_strategy(blocks or (), precision=None)
    strategy.connect(trainer.accelerator, old.precision.name, num_nodes=trainer.num_nodes, devices=trainer.devices)
    strategy.is_auto = True
    return strategy
