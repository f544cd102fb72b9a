"""What sequence parallel and tensor parallel buy on long sequences: measured memory per rank, speed, losses.

A Llama-shaped bundled GPT (rotary, 8 query / 4 key-value heads, SwiGLU, untied head) on sequences long
enough that activations dominate, trained through the Trainer on 2 processes under (a) FSDP FULL_SHARD,
each rank its own whole sequence (2 per step in all), (b) FSDP x sp 2 and (c) FSDP x tp 2, both ranks on
one sequence per step (what a sequence too long for one rank needs); each with and without activation
checkpointing of Block. Per configuration: the peak tracked tensor memory per rank (shardwise.memory's
tracker over the first `--tracked_steps` steps, the largest over the ranks, split by category), tokens/s
per rank on the untracked steps that follow (global tokens per step / the fastest step's time /
processes) and its ratio to (a) without AC, and the per-step losses' largest relative difference from
one process training the same global batch (the one-process runs are rows of the table too). All
2-process configurations share one launch: process start-up would otherwise dominate.

    python benchmarks/long_context.py [--seq_len 2048 --n_layer 4 --n_embd 128 --steps 8]
        [--memory_cap 96MiB]   # mark which configurations fit under a per-rank cap
        [--accelerator cuda --precision bf16-mixed]   # the same on 2 GPUs (nccl)
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.memory import format_bytes, start_tracking, stop_tracking
from shardwise.models import GPT, Block, gpt_config
from shardwise.strategies import FSDPStrategy
from shardwise.sysmem import parse_bytes

WORLD = 2
# (label, sp, tp): sequences per step = WORLD / (sp * tp), one per data-parallel group.
LAYOUTS = (("FSDP FULL_SHARD", 1, 1), ("FSDP x sp 2", 2, 1), ("FSDP x tp 2", 1, 2))


def _config(args: argparse.Namespace):
    return gpt_config(
        "llama-tiny",
        vocab_size=args.vocab_size,
        block_size=args.seq_len,
        n_layer=args.n_layer,
        n_head=8,
        n_kv_head=4,
        n_embd=args.n_embd,
    )


def _data(args: argparse.Namespace, sequences_per_step: int) -> TensorDataset:
    # Seeded: every layout reads the same rows in the same order (shuffle off; rank r of the data-parallel
    # group reads rows r, r + dp, ... so step k's global batch is the next `sequences_per_step` rows).
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randint(0, args.vocab_size, (args.steps * sequences_per_step, args.seq_len + 1), generator=g)
    )


class LongLlama(TrainModule):
    """Next-token mean cross-entropy over the whole sequence; the model is built in configure_model."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args, self.model = args, None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(_config(self.args))

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.0)


class _Probe:
    """Tracked memory over the first `tracked` steps, then the wall time of each later step; every step's loss."""

    def __init__(self, tracked: int, cuda: bool) -> None:
        self.tracked, self.cuda = tracked, cuda
        self.losses: List[float] = []
        self.step_times: List[float] = []
        self.peak, self.breakdown = 0, {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def on_train_start(self, trainer: Any, module: Any) -> None:
        start_tracking(trainer.strategy.module, trainer.strategy.optimizers)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._sync()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._sync()
        elapsed = time.perf_counter() - self.started
        if batch_idx + 1 == self.tracked:
            tracker = stop_tracking()
            self.peak, self.breakdown = tracker.peak_bytes, tracker.peak_breakdown
        elif batch_idx + 1 > self.tracked:
            self.step_times.append(elapsed)
        # sp / tp ranks hold the same sample's loss; data-parallel ranks' means average to the global mean.
        self.losses.append(float(trainer.strategy.reduce(outputs.detach(), "mean")))


def run_config(args: argparse.Namespace, world: int, sp: int, tp: int, ac: bool, sequences: int) -> Dict[str, Any]:
    """Train `args.steps` steps of `sequences` sequences per step on `world` processes (this one among them)."""
    shardwise.seed_everything(1234)
    if world == 1:
        strategy: Any = "single"
    else:
        strategy = FSDPStrategy(
            auto_wrap_policy={Block}, activation_checkpointing_policy={Block} if ac else None, sp_size=sp, tp_size=tp
        )
    probe = _Probe(args.tracked_steps, args.accelerator == "cuda")
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=world,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.steps,
        callbacks=[probe],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    data_parallel = world // (sp * tp)
    trainer.fit(LongLlama(args), DataLoader(_data(args, sequences), batch_size=sequences // data_parallel))
    # The fastest timed step: on a shared CPU the others measure the neighbours as much as the layout.
    step = min(probe.step_times)
    return dict(
        losses=probe.losses,
        peak=probe.peak,
        breakdown=probe.breakdown,
        tokens_per_s_per_rank=sequences * args.seq_len / step / world,
    )


def run_all(args: argparse.Namespace, configs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    if args.accelerator == "cpu":
        torch.set_num_threads(args.threads)
    return [run_config(args, **c) for c in configs]


def _max_rel(got: List[float], ref: List[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--vocab_size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--tracked_steps", type=int, default=2, help="steps under the memory tracker; the rest are timed")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="32-true")
    p.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    p.add_argument("--memory_cap", default=None, help="per-rank cap (e.g. 96MiB): a column says which fit")
    p.add_argument("--no_ac", action="store_true", help="skip the activation-checkpointed runs")
    p.add_argument(
        "--loss_tolerance",
        type=float,
        default=1e-4,
        help="exit 1 when a 2-process run's per-step loss differs from one process's by more (relative)",
    )
    args = p.parse_args(argv)
    if args.steps <= args.tracked_steps:
        raise SystemExit(
            f"--steps {args.steps} must exceed --tracked_steps {args.tracked_steps}: later steps are timed"
        )
    cap = parse_bytes(args.memory_cap) if args.memory_cap else None

    acs = (False,) if args.no_ac else (False, True)
    configs = [
        dict(world=WORLD, sp=sp, tp=tp, ac=ac, sequences=WORLD // (sp * tp)) for ac in acs for _, sp, tp in LAYOUTS
    ]
    wall, load = time.perf_counter(), os.getloadavg()[0]
    per_rank = shardwise.launch(run_all, args, configs, devices=WORLD)
    # One process, the same global batches: 2 sequences per step (reference of (a)), 1 (of (b) and (c)).
    refs = {n: run_all(args, [dict(world=1, sp=1, tp=1, ac=False, sequences=n)])[0] for n in (2, 1)}
    wall, load = time.perf_counter() - wall, (load, os.getloadavg()[0])

    cfg = _config(args)
    print(
        f"\nLlama-shaped GPT: {cfg.n_layer} layers, hidden {cfg.n_embd}, {cfg.n_head} query / {cfg.kv_heads} "
        f"key-value heads, SwiGLU {cfg.ffn_size}, vocabulary {cfg.vocab_size} (untied), {cfg.num_params() / 1e6:.2f}M "
        f"parameters; {args.seq_len} tokens per sequence, {args.precision} on {args.accelerator}, AdamW, "
        f"{args.steps} steps (memory tracked over {args.tracked_steps}, the fastest of the rest timed); "
        f"{wall:.0f} s wall in all, load average {load[0]:.1f} before and {load[1]:.1f} after on "
        f"{os.cpu_count()} CPUs.\n"
    )
    head = "| configuration | processes | sequences / step | peak / rank | activations | params + grads + optim |"
    head += " vs FSDP | tokens/s/rank | vs FSDP | max loss diff vs 1 process |"
    if cap:
        head += f" fits {format_bytes(cap)} |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    rows = []
    for i, c in enumerate(configs):
        runs = [rank[i] for rank in per_rank]
        worst = max(runs, key=lambda r: r["peak"])
        label = dict(((sp, tp), name) for name, sp, tp in LAYOUTS)[(c["sp"], c["tp"])] + (" + AC" if c["ac"] else "")
        ref = refs[c["sequences"]]
        rows.append((label, WORLD, c["sequences"], worst, runs[0], _max_rel(runs[0]["losses"], ref["losses"])))
    for n in (2, 1):
        rows.append(("one process (reference)", 1, n, refs[n], refs[n], 0.0))
    base = rows[0]
    for label, world, sequences, worst, r0, rel in rows:
        b = worst["breakdown"]
        state = sum(b.get(k, 0) for k in ("parameters", "gradients", "optimizer", "buffers"))
        act = worst["peak"] - state
        line = (
            f"| {label} | {world} | {sequences} | {format_bytes(worst['peak'])} | {format_bytes(act)} | "
            f"{format_bytes(state)} | {worst['peak'] / base[3]['peak']:.2f}x | {r0['tokens_per_s_per_rank']:.0f} | "
            f"{r0['tokens_per_s_per_rank'] / base[4]['tokens_per_s_per_rank']:.2f}x | "
            f"{'-' if world == 1 else f'{rel:.1e}'} |"
        )
        if cap:
            line += f" {'yes' if worst['peak'] <= cap else 'no'} |"
        print(line)
    worst_rel = max(r[5] for r in rows)
    if worst_rel > args.loss_tolerance:
        raise SystemExit(
            f"FAILED: a 2-process run's per-step losses differ from one process's by {worst_rel:.1e} relative "
            f"(> --loss_tolerance {args.loss_tolerance:g}): the layouts do not train the same model"
        )
    print(f"\nEvery per-step loss within {args.loss_tolerance:g} relative of one process's (largest {worst_rel:.1e}).")


if __name__ == "__main__":
    main()
