"""Throughput: tokens/s, TFLOP/s and MFU of the bundled GPT, eager vs compiled, under single / DDP / FSDP.

Each configuration trains the same GPT on random tokens for `--steps` optimizer steps and reports what the
Trainer's ThroughputMonitor measured over the second half of the run (the first half holds the FLOP
count, compilation and warm-up): tokens/s over all ranks and per device, achieved TFLOP/s per device
(FLOPs counted by torch's FlopCounterMode on the first micro-batch) and MFU against `--peak_tflops`
(default: the monitor's table for the GPU; none on the CPU). "compiled" compiles each transformer block's
forward with torch.compile before the strategy shards it (torchtitan's order: activation checkpointing,
compile, sharding); when the Trainer has a `compile` option, it is used instead, so the same command
measures the Trainer's own compile once it exists. The compiled/eager ratio of tokens/s is taken within
one invocation, configurations alternating per repeat. One-device runs use the CPU threads a rank of the
distributed runs gets (cores / --devices), so per-device figures compare. The same command runs on GPUs (`--accelerator
cuda`; `--precision bf16-mixed` for tensor-core peaks). Prints a markdown table.

    nice -n 10 python benchmarks/throughput.py [--size tiny|small|gpt2] [--steps 20] [--repeats 1]
        [--strategies single ddp fsdp] [--modes eager compiled] [--devices 2] [--peak_tflops P]
        [--compile_with auto|trainer|script]
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import tempfile
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.callbacks import ThroughputMonitor
from shardwise.models.gpt import GPT, Block, GPTConfig

SIZES = {
    "tiny": dict(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128),
    "small": dict(vocab_size=8192, block_size=256, n_layer=4, n_head=8, n_embd=512),
    "gpt2": dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
}


class GPTModule(TrainModule):
    def __init__(self, size: str, compile_blocks: bool) -> None:
        super().__init__()
        self.config = GPTConfig(**SIZES[size])
        self.compile_blocks = compile_blocks
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        self.model = GPT(self.config)
        if self.compile_blocks:  # before the strategy shards: the forward compiled, FSDP's hooks left outside
            for block in self.model.blocks:
                block.forward = torch.compile(block.forward)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self.model(ids)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def trainer_compiles(choice: str = "auto") -> bool:
    """Whether the Trainer compiles (its own compile option, when it has one and --compile_with allows)."""
    has = "compile" in inspect.signature(Trainer.__init__).parameters
    if choice == "trainer" and not has:
        raise SystemExit("--compile_with trainer: this Trainer has no compile option; use auto or script")
    return has and choice != "script"


def run_one(args: argparse.Namespace, strategy: str, mode: str, world: int) -> Dict[str, float]:
    """One training run in this process (a rank); the ThroughputMonitor's last interval."""
    cfg = GPTConfig(**SIZES[args.size])
    g = torch.Generator().manual_seed(0)
    n = args.batch_size * world * args.steps
    tokens = torch.randint(0, cfg.vocab_size, (n, cfg.block_size + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    compiled = mode == "compiled"
    own_compile = compiled and trainer_compiles(args.compile_with)
    monitor = ThroughputMonitor(peak_tflops=args.peak_tflops)
    extra: Dict[str, Any] = {"compile": True} if own_compile else {}
    if strategy == "fsdp":
        extra["strategy"] = shardwise.FSDPStrategy(auto_wrap_policy={Block})
    else:
        extra["strategy"] = strategy if world > 1 else "auto"
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            accelerator=args.accelerator,
            devices=world,
            precision=args.precision,
            max_steps=args.steps,
            log_every_n_steps=max(1, args.steps // 2),
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=root,
            callbacks=[monitor],
            **extra,
        )
        trainer.fit(GPTModule(args.size, compiled and not own_compile), DataLoader(data, batch_size=args.batch_size))
    p = monitor.prefix
    last = monitor.last
    return {
        "tokens_per_sec": last.get(f"{p}/tokens_per_sec", float("nan")),
        "tokens_per_sec_per_device": last.get(f"{p}/tokens_per_sec_per_device", float("nan")),
        "tflops_per_device": last.get(f"{p}/tflops_per_device", float("nan")),
        "mfu": last.get(f"{p}/mfu", float("nan")),
    }


def run_all(args: argparse.Namespace, world: int, strategies: List[str]) -> List[Dict[str, Any]]:
    """Every (strategy, mode) of this world size, alternating per repeat; rank 0's rows."""
    if world == 1 and "OMP_NUM_THREADS" not in os.environ:
        # The threads a rank of the distributed runs gets (distributed/env.set_cpu_threads), so per-device
        # figures compare; a whole process's threads against busy cores mostly wait at barriers.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, args.devices)))
    results: Dict[tuple, List[Dict[str, float]]] = {}
    for _ in range(args.repeats):
        for strategy in strategies:
            for mode in args.modes:
                torch.manual_seed(0)
                results.setdefault((strategy, mode), []).append(run_one(args, strategy, mode, world))
    rows = []
    for (strategy, mode), runs in results.items():
        row = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        rows.append({"strategy": strategy, "mode": mode, "world": world, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per device per step")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=["single", "ddp", "fsdp"], choices=["single", "ddp", "fsdp"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--devices", type=int, default=2, help="processes for ddp / fsdp")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--peak_tflops", type=float, default=None, help="per device, for MFU")
    parser.add_argument(
        "--compile_with",
        choices=["auto", "trainer", "script"],
        default="auto",
        help="auto: Trainer(compile=True) when the Trainer has it, else torch.compile per block in this script",
    )
    args = parser.parse_args()

    rows: List[Dict[str, Any]] = []
    if "single" in args.strategies:
        rows += run_all(args, 1, ["single"])
    distributed = [s for s in args.strategies if s != "single"]
    if distributed:
        rows += shardwise.launch(run_all, args, args.devices, distributed, devices=args.devices)[0]

    eager = {r["strategy"]: r["tokens_per_sec"] for r in rows if r["mode"] == "eager"}
    compile_by = "Trainer(compile=True)" if trainer_compiles(args.compile_with) else "torch.compile per block"
    shape = ", ".join(f"{k}={v}" for k, v in SIZES[args.size].items())
    print(f"\nGPT {args.size} ({shape}), {args.batch_size} x {SIZES[args.size]['block_size']} tokens per device "
          f"per step, {args.steps} steps (second half measured), {args.precision} on {args.accelerator}; "
          f"compiled = {compile_by}\n")  # fmt: skip
    print("| strategy | devices | mode | tokens/s | tokens/s/device | TFLOP/s/device | MFU | vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_sec"] / eager[r["strategy"]] if r["strategy"] in eager else float("nan")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] == r["mfu"] else "-"
        print(
            f"| {r['strategy']} | {r['world']} | {r['mode']} | {r['tokens_per_sec']:.0f} | "
            f"{r['tokens_per_sec_per_device']:.0f} | {r['tflops_per_device']:.4f} | {mfu} | {ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
