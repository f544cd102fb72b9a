"""What the default logger costs per step: TensorBoardLogger (the default when tensorboard is installed, as in
Lightning) against CSVLogger (the default without it) and no logger, same tiny model, same process.

A Linear(16, 1) trained for `--steps` steps on one process, logging one value per step, with the logger
written every step (`log_every_n_steps=1`) and at the Trainer's default cadence (every 50 steps). Runs
alternate (none, CSV, TensorBoard, ...) so machine noise hits all alike; after a warm-up run of each
(imports), the median of `--repeats` runs is printed in milliseconds per step, with the machine's load
average. The logger's own import is measured apart: it is paid once per process that logs.

    python benchmarks/default_logger.py [--steps 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise.loggers import CSVLogger, TensorBoardLogger


class Tiny(shardwise.TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def one_run(kind: str, every: int, steps: int, data: torch.Tensor) -> float:
    root = tempfile.mkdtemp()
    logger = {"none": False, "csv": CSVLogger(root), "tensorboard": TensorBoardLogger(root)}[kind]
    trainer = shardwise.Trainer(
        max_steps=steps,
        log_every_n_steps=every,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        throughput=False,
    )
    start = time.perf_counter()
    trainer.fit(Tiny(), DataLoader(TensorDataset(data), batch_size=2))
    return (time.perf_counter() - start) / steps


def import_seconds() -> float:
    code = "import time, torch; t = time.perf_counter(); import torch.utils.tensorboard; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = torch.randn(2 * args.steps, 16)
    kinds, cadences = ("none", "csv", "tensorboard"), (1, 50)
    for kind in kinds:
        one_run(kind, 1, 20, data)  # imports and first-call costs out of the way
    times: dict = {}
    for _ in range(args.repeats):
        for kind in kinds:
            for every in cadences:
                times.setdefault((kind, every), []).append(one_run(kind, every, args.steps, data))
    print(f"load average {os.getloadavg()[0]:.1f}; {args.steps} steps, median of {args.repeats}")
    print("| logger | logged every step | every 50 steps (the default) |")
    print("|---|---|---|")
    for kind in kinds:
        row = [f"{statistics.median(times[(kind, every)]) * 1e3:.3f} ms" for every in cadences]
        print(f"| {kind} | " + " | ".join(row) + " |")
    print(f"import torch.utils.tensorboard: {import_seconds():.2f} s (once per process that logs to TensorBoard)")


if __name__ == "__main__":
    main()
