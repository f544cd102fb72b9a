"""Long runs stay flat: RSS, open file descriptors and threads per rank over 10,000+ steps with checkpoints.

Trains a tiny classifier on 2 processes (CPU, gloo) under DDP and FSDP for --steps optimizer steps, with a
checkpoint every --every steps and save_top_k=2 (so every save also prunes one), and samples on every rank,
every 100 steps: the resident set size (VmRSS), the open file descriptors (/proc/self/fd), the threads
(/proc/self/status) and, on rank 0, the bytes in the checkpoint directory. After --warmup steps it fits a
least-squares line to each series and prints the slope per 1,000 steps: a leak of one file descriptor or
thread per save, or of a checkpoint's worth of memory, shows as a slope well above zero; flat is ~0.

    python benchmarks/leaks.py                      # 10,000 steps, DDP and FSDP, a checkpoint every 500
    python benchmarks/leaks.py --steps 2000 --strategies ddp
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
SAMPLE_EVERY = 100


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def _bytes_in(directory: str) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # pruned while walking
                pass
    return total


class Sampler:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.rows: List[Dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step % SAMPLE_EVERY:
            return
        self.rows.append(
            {
                "step": trainer.global_step,
                "rss_mib": _status("VmRSS") / 1024,
                "fds": len(os.listdir("/proc/self/fd")),
                "threads": _status("Threads"),
                "disk_mib": _bytes_in(self.directory) / 2**20 if trainer.is_global_zero else 0.0,
            }
        )


def _run(strategy_name: str, steps: int, every: int, root: str):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import shardwise
    from shardwise import Trainer, TrainModule
    from shardwise.callbacks import ModelCheckpoint

    class Tiny(TrainModule):
        def configure_model(self) -> None:
            self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.set_num_threads(1)
    shardwise.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8000, 16, generator=g), torch.randint(0, 4, (8000,), generator=g))
    directory = os.path.join(root, strategy_name, "checkpoints")
    sampler = Sampler(directory)
    strategy = shardwise.FSDPStrategy() if strategy_name == "fsdp" else strategy_name
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=os.path.join(root, strategy_name),
        callbacks=[sampler, ModelCheckpoint(dirpath=directory, every_n_train_steps=every, save_top_k=2)],
    )
    start = time.perf_counter()
    trainer.fit(Tiny(), DataLoader(data, batch_size=4, shuffle=True))
    trainer.strategy.teardown()
    return {"rows": sampler.rows, "seconds": time.perf_counter() - start}


def _runs(strategies: List[str], steps: int, every: int, root: str):
    return {name: _run(name, steps, every, root) for name in strategies}


def slope_per_1000(xs: List[float], ys: List[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=500, help="checkpoint interval (steps)")
    parser.add_argument("--warmup", type=int, default=2_000, help="steps left out of the slopes")
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args()
    import shardwise

    with tempfile.TemporaryDirectory(prefix="shardwise-leaks-") as root:
        results = shardwise.launch(_runs, args.strategies, args.steps, args.every, root, devices=2)
    print(
        f"{args.steps} steps, a checkpoint every {args.every} (save_top_k=2), 2 processes; slopes per 1,000 steps "
        f"after step {args.warmup}, from samples every {SAMPLE_EVERY} steps"
    )
    print(
        "| strategy | rank | s/1k steps | RSS MiB (first -> last) | RSS slope MiB | fds | fd slope | threads | "
        "thread slope | checkpoint dir MiB (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.strategies:
        for rank, per_rank in enumerate(results):
            rows = per_rank[name]["rows"]
            late = [r for r in rows if r["step"] >= args.warmup]
            xs = [r["step"] for r in late]
            slope = {k: slope_per_1000(xs, [r[k] for r in late]) for k in ("rss_mib", "fds", "threads")}
            disk = f"{max(r['disk_mib'] for r in rows):.2f}" if rank == 0 else "-"
            print(
                f"| {name} | {rank} | {1000 * per_rank[name]['seconds'] / args.steps:.1f} | "
                f"{late[0]['rss_mib']:.1f} -> {late[-1]['rss_mib']:.1f} | {slope['rss_mib']:+.3f} | "
                f"{late[0]['fds']} -> {late[-1]['fds']} | {slope['fds']:+.3f} | "
                f"{late[0]['threads']} -> {late[-1]['threads']} | {slope['threads']:+.3f} | {disk} |"
            )


if __name__ == "__main__":
    main()
