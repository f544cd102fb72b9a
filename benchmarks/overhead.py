"""Trainer overhead: shardwise's Trainer vs a hand-written DDP (or FSDP2) loop, same model, same run.

Both train the seed Transformer with DDP (`--strategy ddp`, the default:
DistributedDataParallel around the model) or FSDP2 (`--strategy fsdp`:
fully_shard per encoder/decoder layer, then the root) on 2 local processes for
the same number of steps on the same data. The Trainer runs with its defaults (progress bar, CSV logger,
ThroughputMonitor, the per-step health check, logging every 50 steps; checkpointing off, since the hand
loop saves nothing). Runs alternate (hand, Trainer, hand, Trainer, ...) in the same processes so machine
noise hits both alike; the result is the median ratio of steps/second, on the wall clock and in CPU time
(the processes' own, robust to other programs sharing the cores), with the machine's load average.

Like with like: the hand-written loop is given what the Trainer does by default that a user's loop
also does, and nothing the user would not write. It gets the same process settings (glibc's allocator
tuning and one intra-op thread per process on 2 cores, distributed/env.py), DDP with the Trainer's
settings (gradient_as_bucket_view=True: DDPStrategy's default), a new shuffle each epoch
(DistributedSampler.set_epoch), and it reads its loss to the host where the Trainer's defaults do: a
printed line at the progress bar's cadence (about 20 lines a run) and a CSV row at step 1 and every 50
steps (the CSV logger's). It does not check for NaN/inf, count tokens or agree with the other rank on
anything: those are the Trainer's own cost, which is what this measures. Prints a markdown row.
`--health` instead compares the Trainer with its per-step health check
(non_finite="error", the default) against the same Trainer with it off.

    python benchmarks/overhead.py [--steps 40] [--repeats 3] [--tiny] [--health] [--strategy ddp|fsdp]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from typing import Any, Iterator, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.demos import LanguageModel, PythonDocsText
from shardwise.models import Transformer  # what LanguageModel trains (shardwise.demos.Transformer is Lightning's)

LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
SIZE = dict(nlayers=4, nhid=1024, ninp=256, nhead=4)
WARMUP = 3
LOG_EVERY = 50  # Trainer(log_every_n_steps=50), the default


def _data():
    return PythonDocsText(block_size=64)


def hand_loop(steps: int, size: dict, strategy: str = "fsdp") -> Tuple[float, float]:
    """What a user writes with FSDP2 directly (meta init, fully_shard, to_empty, init, loop), or with DDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = _data()
    if strategy == "ddp":
        # DDPStrategy's settings: gradients live in the communication buckets (no copy into them).
        model = DistributedDataParallel(Transformer(vocab_size=data.vocab_size, **size), gradient_as_bucket_view=True)
        return _timed(model, data, steps)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(vocab_size=data.vocab_size, **size)
    for module in model.modules():
        if isinstance(module, LAYERS):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif isinstance(module, nn.MultiheadAttention):
                module._reset_parameters()
    return _timed(model, data, steps)


def _batches(loader: DataLoader, sampler: DistributedSampler) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, reshuffled each epoch as a user's loop does."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def _timed(model: nn.Module, data, steps: int) -> Tuple[float, float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    batches = _batches(loader, sampler)
    print_every = max(1, steps // 20)  # the progress bar's cadence (callbacks/progress.py), a line per N steps
    rank = torch.distributed.get_rank()
    with tempfile.TemporaryDirectory() as root, open(os.path.join(root, "metrics.csv"), "w") as csv:
        csv.write("step,train_loss\n")
        for step in range(1, steps + 1):
            inp, target = next(batches)
            loss = F.nll_loss(model(inp, target), target.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % print_every == 0 and rank == 0:
                print(f"step {step}/{steps} | train_loss={loss.item():.4g}", flush=True)
            if (step == 1 or step % LOG_EVERY == 0) and rank == 0:
                csv.write(f"{step},{loss.item()}\n")
            if step == WARMUP:
                start, cpu_start = time.perf_counter(), time.process_time()
    return (steps - WARMUP) / (time.perf_counter() - start), (steps - WARMUP) / (time.process_time() - cpu_start)


class _Clock:
    """Wall-clock and CPU-time rates over the steps after warm-up (CPU time is what the
    Trainer's own work adds to; it is also robust to other programs sharing the cores).

    Like the hand-written loop's clock, it stops when the last step has ended: what a fit does once at
    its end is not a cost per step (measured: 1-3 ms wall, about 1 ms CPU, against ~3 s timed)."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not trainer.is_last_microbatch:
            return
        if trainer.global_step == WARMUP:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
        elif trainer.global_step == trainer.max_steps:
            steps = trainer.global_step - WARMUP
            self.rate = (steps / (time.perf_counter() - self.start), steps / (time.process_time() - self.cpu_start))


def trainer_loop(steps: int, size: dict, non_finite: str = "error", strategy: str = "fsdp") -> float:
    shardwise.seed_everything(0)
    data = _data()
    clock = _Clock()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp" if strategy == "ddp" else FSDPStrategy(auto_wrap_policy=set(LAYERS)),
            max_steps=steps,
            callbacks=[clock],
            enable_checkpointing=False,
            default_root_dir=root,
            non_finite=non_finite,
        )
        trainer.fit(LanguageModel(data.vocab_size, **size), DataLoader(data, batch_size=8, shuffle=True))
    return clock.rate


def alternate(steps: int, repeats: int, size: dict, health: bool = False, strategy: str = "ddp"):
    # The Trainer's strategy tunes glibc's allocator on CPU and gives each local process its share of
    # the cores (see distributed/env.py); give the hand-written loop the same process settings so only the
    # loops differ (else the first hand-written run has two threads per process on two cores).
    from shardwise.distributed.env import set_cpu_threads, tune_cpu_allocator

    tune_cpu_allocator()
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "2")))
    rows = []
    for _ in range(repeats):
        if health:
            hand = trainer_loop(steps, size, non_finite="off", strategy=strategy)
        else:
            hand = hand_loop(steps, size, strategy)
        ours = trainer_loop(steps, size, strategy=strategy)
        rows.append((hand, ours))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a model so small that the step is mostly framework overhead: measures the "
        "Trainer's own cost per step in milliseconds",
    )
    parser.add_argument(
        "--health",
        action="store_true",
        help="compare the Trainer with its per-step NaN/inf check against the Trainer without it",
    )
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    args = parser.parse_args()
    size = dict(nlayers=1, nhid=32, ninp=16, nhead=2) if args.tiny else SIZE
    load_before = os.getloadavg()
    rows = shardwise.launch(alternate, args.steps, args.repeats, size, args.health, args.strategy, devices=2)[0]
    load = ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in zip(load_before, os.getloadavg()))
    if args.health:
        print("(reference = the Trainer with non_finite='off'; compared = the default, non_finite='error')")
    ref, ours_name = (
        ("Trainer, health off", "Trainer, health on")
        if args.health
        else (f"hand-written {'DDP' if args.strategy == 'ddp' else 'FSDP2'}", "shardwise Trainer")
    )
    for i, ((hw, hc), (ow, oc)) in enumerate(rows):
        print(
            f"run {i}: wall: {ref} {hw:.3f}, {ours_name} {ow:.3f} steps/s (ratio {ow / hw:.3f}); "
            f"CPU time: {ref} {hc:.3f}, {ours_name} {oc:.3f} steps/CPU-s (ratio {oc / hc:.3f})"
        )
    print()
    print(
        f"| model | processes | steps timed x runs | clock | {ref} (median) | {ours_name} (median) | ratio of medians |"
    )
    print("|---|---|---|---|---|---|---|")
    for index, clock in ((0, "wall (steps/s)"), (1, "CPU time (steps/CPU-s)")):
        hand = statistics.median(r[0][index] for r in rows)
        ours = statistics.median(r[1][index] for r in rows)
        print(
            f"| seed Transformer {size} | 2 | {args.steps - WARMUP} x {args.repeats} | {clock} | "
            f"{hand:.3f} | {ours:.3f} | {ours / hand:.3f} |"
        )
    if args.tiny:
        extra = [1000 * (1 / r[1][0] - 1 / r[0][0]) for r in rows]
        what = "health check" if args.health else "Trainer"
        print(f"\n{what} cost per optimizer step (wall, median of {len(rows)}): {statistics.median(extra):.2f} ms")
    print(f"load average (1, 5, 15 min) before -> after: {load} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
