"""Scaling you can prove: `shardwise.check` runs a TrainModule on N ranks and on one process and compares.

The promise of the Trainer is that the same global batch gives the same step
at any split: N ranks x micro-batch B x accumulation A train exactly as one
process with batch N*A*B. `check` tests that promise for a user's own module
before any GPU is rented: it trains a few optimizer steps on the CPU (gloo,
fp32) under the strategy named, on N local processes started by
`shardwise.launch`, and the same steps in this process with the global batch,
both from the same seed; then compares per-step losses, the parameters after
the last step, which samples each rank saw, and the buffers on every rank
(verdict.py names the first cause of a difference, with its fix). The runs
are the public Trainer with a callback (record.py); the module and data are
named so that each process builds them alike (target.py).

    report = shardwise.check(MyModule, dataset, strategy="fsdp", devices=2, accumulate_grad_batches=2)
    print(report.format()); assert report.ok

`shardwise check` (cli/check.py) is the same from the command line.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict, Optional

from shardwise.distributed import context
from shardwise.distributed.launch import launch
from shardwise.scaling.record import Job, run_here, run_job
from shardwise.scaling.target import CheckSetupError, DataSource, ModuleSource
from shardwise.scaling.verdict import Cause, ScalingReport, compare

__all__ = ["check", "ScalingReport", "Cause", "CheckSetupError"]


def _strategy_name(strategy: Any) -> str:
    """How the report names the strategy: the table's name for its configuration, else its class."""
    if isinstance(strategy, str):
        return strategy
    from shardwise.strategies.parallel import ParallelPlan, name_of

    plan = strategy if isinstance(strategy, ParallelPlan) else getattr(strategy, "parallel_plan", None)
    name = name_of(plan) if isinstance(plan, ParallelPlan) else None
    if isinstance(strategy, ParallelPlan):
        return name or strategy.label
    return f"{type(strategy).__name__} ({name})" if name else type(strategy).__name__


def _expert_degree(strategy: Any) -> int:
    from shardwise.strategies.parallel import ParallelPlan

    plan = strategy if isinstance(strategy, ParallelPlan) else getattr(strategy, "parallel_plan", None)
    return int(getattr(plan, "ep", 1) or 1)


def _check_experts(source: ModuleSource, strategy: Any, devices: int) -> int:
    """The module's experts per MoE layer (0: none, or it cannot be configured on the meta device), counted
    on a meta build; expert parallel that the experts or the processes cannot take is refused here, before
    any process starts."""
    import torch

    from shardwise.strategies import degrees
    from shardwise.strategies.experts import count_experts
    from shardwise.strategies.parallel import ParallelPlan

    ep = _expert_degree(strategy)
    if ep > 1:
        plan = strategy if isinstance(strategy, ParallelPlan) else strategy.parallel_plan
        try:
            plan.mesh(devices)
        except ValueError as exc:
            raise CheckSetupError(f"{exc} (shardwise check runs --devices {devices} processes)") from None
    try:
        module = source.build()
        with torch.device("meta"):
            module.configure_model()
        experts = count_experts(module)
    except Exception:  # a module that cannot be built on meta: its experts are not known here
        if ep == 1:
            return 0
        raise
    problem = degrees.experts_problem(ep, experts, source.describe())
    if problem:
        raise CheckSetupError(problem)
    return experts


def check(
    module: Any,
    data: Any = None,
    *,
    init_args: Optional[Dict[str, Any]] = None,
    strategy: Any = "ddp",
    devices: int = 2,
    accumulate_grad_batches: int = 1,
    batch_size: Optional[int] = None,
    shuffle: Optional[bool] = None,
    steps: int = 3,
    seed: int = 42,
    loss_rtol: float = 1e-5,
    param_rtol: float = 1e-5,
) -> ScalingReport:
    """Train `module` for `steps` optimizer steps on `devices` ranks and on one process; compare the runs.

    Args:
        module: the TrainModule: its class (or a factory, importable by worker processes), an instance (copied
            for each run), or a string: `pkg.mod.Class`, `python:pkg.mod.Class`, `train.py`, `train.py:Class`.
        data: a Dataset or DataLoader; None uses the module's train_dataloader().
        init_args: keyword arguments for the class (typed against its signature), e.g. a smaller config.
        strategy: a name from the strategy table, a ParallelPlan or a Strategy object. With expert parallel
            (ParallelPlan("fsdp", ep=2), FSDPStrategy(ep_size=2)) a mixture-of-experts module is checked on
            devices / ep data-parallel x ep expert-parallel ranks against one process with every expert.
        devices: data-parallel ranks (local CPU processes).
        accumulate_grad_batches: micro-batches per optimizer step on each rank.
        batch_size: the micro-batch per rank; None: the loader's (4 for a Dataset).
        shuffle: for a Dataset: shuffle it (default True); a loader keeps its own sampler.
        steps: optimizer steps in each run (the data must hold steps x the global batch).
        seed: seed_everything(seed) in every process before the module is built.
        loss_rtol: tolerance on each step's loss, relative to the one-process loss.
        param_rtol: tolerance on the parameters after the steps: ||P_N - P_1|| / ||P_1|| over all of them
            (and on each buffer, across ranks and against the one-process run).

    Returns a ScalingReport: `ok`, `cause` (the first found, with its fix), `format()`.
    The one-process run happens in this process; its random generators are restored afterwards.
    """
    for name, value in (("devices", devices), ("accumulate_grad_batches", accumulate_grad_batches), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckSetupError(f"{name} must be a positive integer, got {value!r}.")
    if batch_size is not None and batch_size < 1:
        raise CheckSetupError(f"batch_size must be a positive integer, got {batch_size!r}.")
    source = ModuleSource(module, dict(init_args or {}))
    source.validate()
    experts = _check_experts(source, strategy, devices)
    data_source = DataSource(data, batch_size, shuffle)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardwise-check-") as root:
        scale = accumulate_grad_batches * devices

        def job(data: DataSource, strategy: Any, devices: int, accumulate: int, scale: int, sub: str) -> Job:
            return Job(source, data, strategy, devices, accumulate, scale, steps, seed, os.path.join(root, sub))

        # Router losses are computed over each global micro-batch, so a module with experts is compared
        # with one process at the same accumulation (micro-batch devices x batch_size); others at 1.
        ref_accumulate = accumulate_grad_batches if experts else 1
        reference = run_here(job(data_source, "single", 1, ref_accumulate, scale // ref_accumulate, "reference"))
        reference_s = time.perf_counter() - started
        # The workers take the micro-batch the reference resolved (a loader's own batch size, or batch_size).
        micro = DataSource(data, reference.micro_batch_size, shuffle)
        ranks = launch(
            run_job,
            job(micro, strategy, devices, accumulate_grad_batches, 1, "ranks"),
            devices=devices,
            context=context.current().replace(seed=seed),
        )
    report = ScalingReport(
        module=source.describe(),
        strategy=_strategy_name(strategy),
        devices=devices,
        accumulate=accumulate_grad_batches,
        micro_batch_size=reference.micro_batch_size,
        steps=steps,
        loss_rtol=loss_rtol,
        param_rtol=param_rtol,
        reference_accumulate=ref_accumulate,
        seconds={
            "1 process": reference_s,
            f"{devices} processes": time.perf_counter() - started - reference_s,
        },
    )
    return compare(reference, ranks, report)
