"""The DeepSpeed seed's minGPT benchmark: same flags, same two printed lines per rank, at CPU scale.

The seed trained minGPT on 8 A100s and reported, per rank, the average epoch
time and the average peak memory for DDP, ZeRO-3 and ZeRO-3 + CPU offload.
This script takes its flags (--n_layer --n_head --n_embd --devices (or --gpus) --precision
--limit_train_batches --batch_size --strategy --cpu_offload), trains
shardwise.models.GPT on random token sequences with the Trainer, and prints the
same two lines per rank. On CPU the peak is tracked tensor memory
(shardwise.memory), measured in the first epoch; the epoch time is averaged
over the later, untracked epochs, because tracking slows every op.
With --compare_deepspeed (DeepSpeed strategies), the same workers also train
the same model with DeepSpeed driven by hand (deepspeed.initialize,
engine.backward, engine.step, the config our strategy built), one epoch after
each of ours, and print the ratio of our median step time to it. --table runs DDP, ZeRO-2, ZeRO-3 and
ZeRO-3 + offload one after another and prints the markdown rows for
BENCHMARKS.md.

    python benchmarks/mingpt.py --devices 2 --strategy deepspeed_stage_3 --compare_deepspeed
    python benchmarks/mingpt.py --table
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.memory import MemoryTracker
from shardwise.models import GPT, GPTConfig

MIB = 2**20


class MinGPT(TrainModule):
    def __init__(self, config: GPTConfig, lr: float = 3e-4) -> None:
        super().__init__()
        self.config, self.lr = config, lr
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class EpochStats:
    """Epoch 0: tracked peak tensor memory. Later epochs: wall time. Every step: its duration."""

    def __init__(self) -> None:
        self.tracker: Optional[MemoryTracker] = None
        self.peaks: List[int] = []
        self.epoch_times: List[float] = []
        self.step_times: List[float] = []

    def on_train_epoch_start(self, trainer, module):
        if trainer.current_epoch == 0:
            self.tracker = MemoryTracker().start()
            self.tracker.register(trainer.model, trainer.strategy.optimizers)
            self.tracker.reset_peak()
        self._epoch_start = time.perf_counter()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch > 0:  # untracked epochs only: tracking slows every op
            self.step_times.append(time.perf_counter() - self._step_start)

    def on_train_epoch_end(self, trainer, module):
        elapsed = time.perf_counter() - self._epoch_start
        if self.tracker is not None and self.tracker.active:
            self.tracker.stop()
            self.peaks.append(self.tracker.peak_bytes)
            self.breakdown = self.tracker.peak_breakdown
        else:
            self.epoch_times.append(elapsed)


def build_strategy(name: str, cpu_offload: bool):
    """A strategy-table name; --cpu_offload puts DeepSpeed's optimizer state (stage 3: parameters too) on the host."""
    from shardwise.strategies import build_strategy as from_name
    from shardwise.strategies.parallel import ParallelPlan

    plan = ParallelPlan.from_name(name, allow_ac=False)
    if plan.engine != "deepspeed" or not cpu_offload:
        return from_name(name)
    return from_name(name, offload_optimizer=True, offload_parameters=plan.zero_stage == 3)


def token_data(n: int, block_size: int, vocab_size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, vocab_size, (n, block_size + 1), generator=g))


class HandDrivenDeepSpeed:
    """Callback: after each of our epochs, one epoch of DeepSpeed driven by hand on its own engine.

    What a user writes with DeepSpeed alone: zero.Init, initialize, forward /
    backward / step, with the config our strategy built. Alternating epoch by
    epoch (ours, by hand, ours, ...) exposes both to the same machine load,
    which on a shared machine moves more than either loop does.
    """

    def __init__(self, config: GPTConfig, lr: float = 3e-4) -> None:
        self.config, self.lr = config, lr
        self.engine = None
        self.step_times: List[float] = []

    def _build(self, strategy: Any) -> None:
        import copy

        import deepspeed

        ds_config = copy.deepcopy(strategy.config)
        with deepspeed.zero.Init(
            config_dict_or_path=ds_config,
            enabled=strategy.stage == 3,
            remote_device="cpu" if strategy.offload_parameters else None,
        ):
            model = GPT(self.config)
        if strategy.offload_optimizer:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(model.parameters(), lr=self.lr, adamw_mode=True)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)

    def on_train_epoch_end(self, trainer, module):
        if self.engine is None:  # built after epoch 0, once memory tracking has stopped
            self._build(trainer.strategy)
        for (tokens,) in trainer.train_dataloader:
            start = time.perf_counter()
            logits = self.engine(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            self.engine.backward(loss)
            self.engine.step()
            if trainer.current_epoch > 0:  # its first epoch warms up, as ours does
                self.step_times.append(time.perf_counter() - start)


def fit_once(args: argparse.Namespace, config: GPTConfig, extra: tuple = ()):
    shardwise.seed_everything(1234)
    stats = EpochStats()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=build_strategy(args.strategy, args.cpu_offload),
        precision=args.precision,
        max_epochs=args.max_epochs,
        limit_train_batches=args.limit_train_batches,
        callbacks=[stats, *extra],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(MinGPT(config), loader_for(args))
    return trainer, stats


def loader_for(args: argparse.Namespace) -> DataLoader:
    n = args.limit_train_batches * args.batch_size * args.devices
    return DataLoader(token_data(n, args.block_size, args.vocab_size), batch_size=args.batch_size)


def run(args: argparse.Namespace) -> None:
    config = GPTConfig(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_embeddings=False,
    )
    compare = args.compare_deepspeed and args.strategy.startswith("deepspeed")
    hand = HandDrivenDeepSpeed(config) if compare else None
    trainer, stats = fit_once(args, config, (hand,) if compare else ())
    # From here on only the workers run (the supervisor process exited inside fit).
    rank = trainer.global_rank
    epoch_time = statistics.mean(stats.epoch_times) if stats.epoch_times else float("nan")
    peak = max(stats.peaks) / MIB if stats.peaks else float("nan")
    print(
        f"[rank {rank}] model {config.num_params() / 1e6:.1f}M parameters, strategy {args.strategy}"
        f"{' + cpu_offload' if args.cpu_offload else ''}, {args.devices} process(es)",
        flush=True,
    )
    print(f"[rank {rank}] Average Epoch time: {epoch_time:.2f} seconds", flush=True)
    print(f"[rank {rank}] Average Peak memory {peak:.2f}MiB", flush=True)
    parts = ", ".join(f"{k} {v / MIB:.1f}" for k, v in getattr(stats, "breakdown", {}).items() if v)
    print(f"[rank {rank}] peak by role (MiB): {parts}", flush=True)
    if compare:
        ours, hand = stats.step_times, hand.step_times
        if os.environ.get("MINGPT_DEBUG"):
            print(rank, [round(t, 2) for t in ours], [round(t, 2) for t in hand], flush=True)
        # Medians: on a shared machine single steps swing by 30% either way.
        ratio = statistics.median(ours) / statistics.median(hand)
        print(
            f"[rank {rank}] Median step time over {len(ours)} steps: shardwise {statistics.median(ours) * 1e3:.0f} ms, "
            f"DeepSpeed by hand {statistics.median(hand) * 1e3:.0f} ms, ratio {ratio:.3f}",
            flush=True,
        )


# ----------------------------------------------------------------- the table
TABLE = [
    ("DDP", "ddp", False),
    ("ZeRO-2", "deepspeed_stage_2", False),
    ("ZeRO-3", "deepspeed_stage_3", False),
    ("ZeRO-3 + offload", "deepspeed_stage_3", True),
]
SEED = {"DDP": "1.7B, 36,149 MiB", "ZeRO-2": "-", "ZeRO-3": "12.8B, 7,797 MiB", "ZeRO-3 + offload": "45B, 4,977 MiB"}


def table(args: argparse.Namespace) -> None:
    rows = []
    base = [
        sys.executable,
        os.path.abspath(__file__),
        "--devices",
        str(args.devices),
        "--n_layer",
        str(args.n_layer),
        "--n_head",
        str(args.n_head),
        "--n_embd",
        str(args.n_embd),
        "--vocab_size",
        str(args.vocab_size),
        "--block_size",
        str(args.block_size),
        "--batch_size",
        str(args.batch_size),
        "--precision",
        args.precision,
        "--limit_train_batches",
        str(args.limit_train_batches),
        "--max_epochs",
        str(args.max_epochs),
    ]
    for label, strategy, offload in TABLE:
        cmd = (
            base
            + ["--strategy", strategy]
            + (["--cpu_offload"] if offload else [])
            + (["--compare_deepspeed"] if strategy == "deepspeed_stage_3" and not offload else [])
        )
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        sys.stdout.write(out)
        times = [float(x) for x in re.findall(r"Average Epoch time: ([\d.]+)", out)]
        peaks = [float(x) for x in re.findall(r"Average Peak memory ([\d.]+)MiB", out)]
        ratio = re.findall(r"ratio ([\d.]+)", out)
        rows.append((label, times, peaks, ratio))
    params = GPTConfig(
        vocab_size=args.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        tie_embeddings=False,
    ).num_params()
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{params / 1e6:.1f}M parameters, {args.devices} CPU processes, {os.cpu_count()} cores, "
        f"load average at the end (1/5/15 min): {load}\n"
    )
    print("| strategy | epoch time per rank (s) | tracked peak per rank (MiB) | seed, 8xA100 (largest model, peak) |")
    print("|---|---|---|---|")
    for label, times, peaks, _ in rows:
        print(
            f"| {label} | {' / '.join(f'{t:.2f}' for t in times)} | {' / '.join(f'{p:.1f}' for p in peaks)} "
            f"| {SEED[label]} |"
        )
    ratios = [r for row in rows for r in row[3]]
    if ratios:
        print(f"\nZeRO-3 step time, shardwise / DeepSpeed by hand (median step), per rank: {' / '.join(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=8)
    parser.add_argument("--n_embd", type=int, default=512)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--block_size", type=int, default=128)
    # --gpus: the seed's (Lightning 1.x) spelling of --devices, so its command lines run as printed.
    parser.add_argument("--devices", "--gpus", type=int, default=2, dest="devices")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--limit_train_batches", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--max_epochs", type=int, default=3, help="epoch 1 measures memory, the rest time")
    parser.add_argument("--strategy", default="deepspeed_stage_3")
    parser.add_argument("--cpu_offload", action="store_true")
    parser.add_argument("--compare_deepspeed", action="store_true")
    parser.add_argument("--table", action="store_true", help="run DDP, ZeRO-2, ZeRO-3, ZeRO-3 + offload")
    args = parser.parse_args()
    if args.max_epochs < 2:
        parser.error("--max_epochs must be at least 2 (the first epoch measures memory only)")
    table(args) if args.table else run(args)


if __name__ == "__main__":
    main()
