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
        return name or repr(strategy)
    return f"{type(strategy).__name__} ({name})" if name else type(strategy).__name__


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
        strategy: a name from the strategy table, a ParallelPlan or a Strategy object.
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
    data_source = DataSource(data, batch_size, shuffle)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardwise-check-") as root:
        scale = accumulate_grad_batches * devices

        def job(data: DataSource, strategy: Any, devices: int, accumulate: int, scale: int, sub: str) -> Job:
            return Job(source, data, strategy, devices, accumulate, scale, steps, seed, os.path.join(root, sub))

        reference = run_here(job(data_source, "single", 1, 1, scale, "reference"))
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
        seconds={
            "1 process": reference_s,
            f"{devices} processes": time.perf_counter() - started - reference_s,
        },
    )
    return compare(reference, ranks, report)
