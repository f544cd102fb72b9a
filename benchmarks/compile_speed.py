"""Eager vs per-block compiled steps/s of the demo Transformer (`shardwise demo`'s LanguageModel) under FSDP.

Two ranks (gloo on CPU; the same command runs NCCL with `--accelerator cuda`) train the demo model on the
bundled Python help text with FSDPStrategy wrapping each Transformer layer, once eager and once with
`Trainer(compile=True)` (each layer compiled after checkpointing and before sharding), alternating
eager / compiled for `--repeats` pairs inside one launch, so both see the same machine. Steps/s is timed
over the steps after `--warmup` (the first steps hold the FLOP count and the compilation). Prints each
pair's ratio and the median, as a markdown row for BENCHMARKS.md.

    nice -n 10 python benchmarks/compile_speed.py [--steps 40] [--warmup 10] [--repeats 3] [--devices 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Dict, List

import torch
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.demos import LanguageModel, PythonDocsText

LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


class StepClock:
    """Callback: wall time of the optimizer steps after the first `warmup` ones."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.steps = warmup, None, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not trainer.is_last_microbatch:
            return
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        elif trainer.global_step > self.warmup:
            self.steps += 1
            self.elapsed = time.perf_counter() - self.start


def run_one(args: argparse.Namespace, compiled: bool) -> float:
    """Steps/s of one run on this rank (rank 0's clock is what is reported)."""
    shardwise.seed_everything(0)
    data = PythonDocsText(block_size=args.seq)
    clock = StepClock(args.warmup)
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator=args.accelerator,
            devices=args.devices,
            strategy=FSDPStrategy(auto_wrap_policy=LAYERS),
            max_steps=args.warmup + args.steps,
            callbacks=[clock],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=root,
            compile=compiled,
        )
        module = LanguageModel(data.vocab_size, nlayers=args.layers, nhid=args.nhid, ninp=args.ninp, nhead=4)
        trainer.fit(module, DataLoader(data, batch_size=args.batch_size))
    return clock.steps / clock.elapsed


def run_pairs(args: argparse.Namespace) -> List[Dict[str, float]]:
    pairs = []
    for _ in range(args.repeats):
        eager = run_one(args, compiled=False)
        compiled = run_one(args, compiled=True)
        pairs.append({"eager": eager, "compiled": compiled, "ratio": compiled / eager})
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (FLOP count, compilation)")
    parser.add_argument("--repeats", type=int, default=3, help="eager / compiled pairs, alternating")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--nhid", type=int, default=256)
    parser.add_argument("--ninp", type=int, default=64)
    args = parser.parse_args()
    pairs = shardwise.launch(run_pairs, args, devices=args.devices)[0]
    print(f"\ndemo Transformer ({args.layers} + {args.layers} layers, ninp {args.ninp}, nhid {args.nhid}), FSDP "
          f"on {args.devices} x {args.accelerator}, {args.batch_size} x {args.seq} tokens per rank per step, "
          f"{args.steps} steps timed after {args.warmup}; torch {torch.__version__}\n")  # fmt: skip
    print("| pair | eager steps/s | compiled steps/s | compiled / eager |")
    print("|---|---:|---:|---:|")
    for i, p in enumerate(pairs, 1):
        print(f"| {i} | {p['eager']:.2f} | {p['compiled']:.2f} | {p['ratio']:.2f} |")
    print(f"| median | | | {statistics.median(p['ratio'] for p in pairs):.2f} |")


if __name__ == "__main__":
    main()
