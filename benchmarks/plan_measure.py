"""Measure what the planner predicts: peak tracked tensor memory per rank during real training steps.

Benchmark support, not part of the package (it drives the Trainer, which the
planner sits below): benchmarks/plan_accuracy.py imports it as a sibling, the
tests through pyproject's pytest `pythonpath` ("benchmarks"), and the worker
processes inherit that sys.path. Both call `compare()`, whose `measure()`
starts `devices` CPU processes with shardwise.launch, trains the planner's own
`LMModule` (the TrainModule a user would write) with the Trainer under the
candidate's strategy for a few optimizer steps, and reads shardwise.memory's
tracker, started once the model and optimizer exist (as the planner's trace
is). Several candidates share one set of worker processes because process and
DeepSpeed start-up dominate at these sizes; `compare_many()` goes further and
trains several models' cases (one world size) in one launch. `planning_cost()` times the
`shardwise plan` command itself (wall, CPU, memory of all its processes).
Nothing here is used by `plan()` itself.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from shardwise.plan.candidates import Candidate
from shardwise.plan.presets import ModelSpec
from shardwise.strategies.parallel import ParallelPlan


class _Tokens(Dataset):
    """Random token batches shaped like ModelSpec.make_batch (seeded, so every strategy sees the same)."""

    def __init__(self, spec: ModelSpec, seq_len: int, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.transformer = spec.kind == "transformer"
        width = seq_len if self.transformer else seq_len + 1
        self.data = torch.randint(0, spec.vocab_size, (n, width), generator=g)
        self.target = torch.randint(0, spec.vocab_size, (n, width), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return (self.data[i], self.target[i]) if self.transformer else (self.data[i],)


class _Probe:
    """Callback: tracked memory from the first step (model + optimizer registered) to the end."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        from shardwise.memory import start_tracking

        self.quant_state = 0
        if getattr(module.spec, "adapters", None) is not None and module.spec.adapters.load_in_4bit:
            # QLoRA: the quantisation states a loader would have made (none is loaded here), made
            # before tracking as a loader's are; whole on every rank and outside every module's
            # parameters and buffers, so the tracker does not see them: measured from the layers.
            from shardwise.plan.adapters import fill_quant_states, quant_state_bytes

            fill_quant_states(trainer.strategy.module)
            self.quant_state = quant_state_bytes(trainer.strategy.module)
        start_tracking(trainer.strategy.module, trainer.strategy.optimizers)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        from shardwise.memory import stop_tracking

        tracker = stop_tracking()
        self.peak, self.breakdown = tracker.peak_bytes + self.quant_state, tracker.peak_breakdown
        self.breakdown["buffers"] += self.quant_state


def _run_one(
    spec: ModelSpec,
    cand: Candidate,
    devices: int,
    precision: str,
    seq_len: int,
    steps: int,
    optimizer: str,
    deepspeed_config: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    import shardwise
    from shardwise import Trainer

    start = time.perf_counter()
    shardwise.seed_everything(0)
    module = spec.training_module(optimizer=optimizer)
    if spec.kind == "hf":
        # Built on meta; Hugging Face's own per-module initialisation (weights, norms, rotary tables)
        # on the materialised, sharded model: the values do not matter, only that every tensor exists.
        module.init_weights = lambda: [module.model._init_weights(m) for m in module.model.modules()]
    probe = _Probe()
    strategy = cand.build_strategy(spec.block_classes, deepspeed_config=deepspeed_config)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        accumulate_grad_batches=cand.accumulation,
        callbacks=[probe],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    n = cand.micro_batch * cand.accumulation * steps * devices
    trainer.fit(module, DataLoader(_Tokens(spec, seq_len, n), batch_size=cand.micro_batch))
    # The process group stays up for the next candidate in this worker (as in train_many).
    return dict(peak=probe.peak, breakdown=probe.breakdown, seconds=time.perf_counter() - start)


def _worker(
    groups: Sequence[Tuple[ModelSpec, Sequence[Candidate], str, int, str, Optional[Dict[str, Any]]]],
    devices: int,
    steps: int,
) -> List[List[Dict[str, Any]]]:
    torch.set_num_threads(1)
    return [
        [_run_one(spec, c, devices, precision, seq_len, steps, optimizer, ds) for c in cands]
        for spec, cands, precision, seq_len, optimizer, ds in groups
    ]


def measure_groups(
    groups: Sequence[Tuple[ModelSpec, Sequence[Candidate], str, int, str, Optional[Dict[str, Any]]]],
    devices: int,
    steps: int = 2,
) -> List[List[Dict[str, Any]]]:
    """measure() for several (spec, candidates, precision, seq_len, optimizer, deepspeed_config) groups in ONE
    launch of `devices` processes: process, import and DeepSpeed start-up are paid once for all of them."""
    import shardwise

    groups = [(spec, list(cands), *rest) for spec, cands, *rest in groups]
    per_rank = shardwise.launch(_worker, groups, devices, steps, devices=devices)
    out = []
    for g, (_, cands, *_) in enumerate(groups):
        rows = []
        for i in range(len(cands)):
            runs = [rank[g][i] for rank in per_rank]
            worst = max(runs, key=lambda r: r["peak"])
            rows.append(dict(worst, ranks=[r["peak"] for r in runs]))
        out.append(rows)
    return out


def measure(
    spec: ModelSpec,
    candidates: Sequence[Candidate],
    devices: int,
    precision: str = "32-true",
    seq_len: int = 32,
    steps: int = 2,
    optimizer: str = "adamw",
    deepspeed_config: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Peak tracked bytes per candidate (the largest over ranks) from real CPU training steps."""
    group = (spec, list(candidates), precision, seq_len, optimizer, deepspeed_config)
    return measure_groups([group], devices, steps)[0]


# ------------------------------------------------------------------ predicted vs measured
# Small enough for CPU, deep enough (6 repeated units) that the planner extrapolates from
# its 3- and 4-block traces, with parameters on both sides of ZeRO-3's persistence threshold.
# Every configuration the accuracy check runs for real and plans (the test and the benchmark alike).
ACCURACY_CONFIGURATIONS = (
    "ddp",
    "fsdp_no_shard",
    "fsdp_shard_grad_op",
    "fsdp",
    "fsdp_no_shard_ac",
    "fsdp_shard_grad_op_ac",
    "fsdp_ac",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_3_ac",
)


# Sequence and tensor parallel (issue 22), each of degree 2 on 2 processes; FSDP shards over the rest.
PARALLEL_CONFIGURATIONS = (ParallelPlan("fsdp", sp=2), ParallelPlan("fsdp", tp=2))


def accuracy_models() -> Dict[str, Any]:
    from shardwise.models import GPTConfig
    from shardwise.plan.presets import gpt_spec, transformer_spec

    return {
        "gpt": (
            gpt_spec(
                "gpt-6x256",
                GPTConfig(vocab_size=2048, block_size=64, n_layer=6, n_head=4, n_embd=256, tie_embeddings=False),
            ),
            64,
        ),
        "transformer": (
            transformer_spec(
                "transformer-6x128", dict(nlayers=6, nhid=512, ninp=128, nhead=4), vocab_size=2000, seq_len=32
            ),
            32,
        ),
    }


# DeepSpeed's own size limits, which shardwise's DeepSpeedStrategy caps for small models
# (strategies/deepspeed_config.size_limits). Given explicitly, the engine uses them as they are:
# a 5e8-element reduce bucket allocated whole (2 GB in fp32), and up to 1e9 parameters kept
# gathered at stage 3. benchmarks/plan_accuracy.py shows the planner follows a user's config too.
DEEPSPEED_RAW_DEFAULTS = {
    "zero_optimization": {
        "reduce_bucket_size": int(5e8),
        "allgather_bucket_size": int(5e8),
        "stage3_prefetch_bucket_size": int(5e7),
        "stage3_max_live_parameters": int(1e9),
        "stage3_max_reuse_distance": int(1e9),
    }
}


def compare(
    spec: ModelSpec,
    seq_len: int,
    devices: int,
    candidates: Sequence[Any],
    batch_size: int = 4,
    precision: str = "32-true",
    deepspeed_config: Optional[Dict[str, Any]] = None,
    steps: int = 2,
    adapters: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Predicted (plan) and measured (real CPU runs) peak tracked bytes per rank for each candidate.

    candidates: strategy names or ParallelPlans (sp / tp degrees: PARALLEL_CONFIGURATIONS).

    adapters: the planner's LoRA / QLoRA keywords (lora_r=8, load_in_4bit=True, ...); the real
    runs train the same adapter model (the planned spec's LMModule).
    """
    case = dict(
        spec=spec,
        seq_len=seq_len,
        candidates=candidates,
        batch_size=batch_size,
        precision=precision,
        deepspeed_config=deepspeed_config,
        adapters=adapters,
    )
    return compare_many([case], devices, steps=steps)[0]


def compare_many(cases: Sequence[Dict[str, Any]], devices: int, steps: int = 2) -> List[List[Dict[str, Any]]]:
    """compare() for several cases (each a dict of compare()'s keywords: spec, seq_len, candidates, and
    optionally batch_size, precision, deepspeed_config, adapters) at one world size: each is planned here,
    then all of them train in ONE launch of `devices` processes. Returns compare()'s rows per case."""
    from dataclasses import replace

    from shardwise.plan.adapters import build_adapters, compute_dtype_name
    from shardwise.plan.core import plan

    planned, groups = [], []
    for case in cases:
        spec, seq_len, adapters = case["spec"], case["seq_len"], case.get("adapters")
        precision = case.get("precision", "32-true")
        deepspeed_config = case.get("deepspeed_config")
        p = plan(
            spec,
            **(adapters or {}),
            batch_size=case.get("batch_size", 4),
            seq_len=seq_len,
            devices=devices,
            precision=precision,
            accelerator="cpu",
            candidates=list(case["candidates"]),
            deepspeed_config=deepspeed_config,
        )
        if adapters:
            options = build_adapters(**adapters)
            spec = replace(spec, adapters=replace(options, compute_dtype=compute_dtype_name(precision)))
        cands = [e.candidate for e in p.estimates]
        planned.append((spec, {e.candidate.config_key: e for e in p.estimates}, cands))
        groups.append((spec, cands, precision, seq_len, "adamw", deepspeed_config))
    out = []
    for (spec, rows, cands), measured in zip(planned, measure_groups(groups, devices, steps)):
        out.append(
            [
                dict(
                    model=spec.name,
                    devices=devices,
                    config=cand.config_label,
                    predicted=rows[cand.config_key].allocated,
                    measured=m["peak"],
                    error=rows[cand.config_key].allocated / m["peak"] - 1,
                    method=rows[cand.config_key].method,
                    ranks=m["ranks"],
                    breakdown=m["breakdown"],
                    predicted_breakdown=rows[cand.config_key].breakdown,
                    seconds=m["seconds"],
                )
                for cand, m in zip(cands, measured)
            ]
        )
    return out


# ------------------------------------------------------------------ planning cost
def _tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                total += next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except (OSError, StopIteration, ValueError):
            continue
    return total


def planning_cost(args: Sequence[str]) -> Dict[str, Any]:
    """Run `shardwise plan <args> --json`: wall and CPU seconds, peak RSS of all planner processes together."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "plan", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    peak = 0
    chunks = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    while proc.poll() is None:
        peak = max(peak, _tree_rss(proc.pid))
        time.sleep(0.1)
    reader.join()
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(b"".join(chunks).decode()) if proc.returncode == 0 else {}
    with open("/proc/loadavg") as fh:
        load = float(fh.read().split()[0])
    recommended = (result.get("recommended") or {}).get("candidate", {}).get("label", "none")
    return dict(wall=wall, cpu=cpu, rss=peak, code=proc.returncode, load=load, recommended=recommended)
