"""Activation checkpointing modes under FSDP on CPU: peak tracked memory and step time.

none / full (each block recomputed) / selective "op" (matmul and attention outputs saved,
the rest recomputed) / selective every 2nd block. One process, FSDP2 over a world of one,
a Llama-shaped shardwise GPT, fp32 AdamW. Memory is tracked tensor memory of the
measured step (parameters, gradients, optimizer state, activations); time is the median
of the untracked steps that follow.

    python benchmarks/activation_checkpointing.py [--n_layer 4 --n_embd 256 --seq 256 --batch 4 --steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def measure(mode: str, option, args) -> dict:
    import torch.distributed as dist

    import shardwise
    from shardwise.memory import MemoryTracker
    from shardwise.models import GPT, GPTConfig
    from shardwise.models.gpt import Block
    from shardwise.strategies import FSDPStrategy

    shardwise.seed_everything(0)
    kwargs = (
        {}
        if mode == "none"
        else dict(
            activation_checkpointing_policy={Block}, activation_checkpointing_mode=mode, selective_ac_option=option
        )
    )
    strategy = FSDPStrategy(auto_wrap_policy={Block}, **kwargs)
    strategy.connect(accelerator="cpu")
    strategy.setup_environment()
    config = GPTConfig(
        vocab_size=4096,
        block_size=args.seq,
        n_layer=args.n_layer,
        n_head=args.n_embd // 64,
        n_embd=args.n_embd,
        norm="rmsnorm",
        mlp="swiglu",
        rope=True,
        bias=False,
        tie_embeddings=False,
    )
    with strategy.module_init_context():
        model = GPT(config)
    model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)

    def step():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    step()  # optimizer state exists from here on
    tracker = MemoryTracker().start()
    tracker.register(model, [optimizer])
    tracker.reset_peak()
    loss = step()
    tracker.stop()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    strategy.teardown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "peak": tracker.peak_bytes,
        "breakdown": tracker.peak_breakdown,
        "time": statistics.median(times),
        "loss": loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rows = [
        ("none", "none", None),
        ("full", "full", None),
        ("selective op", "selective", "op"),
        ("selective every 2nd block", "selective", 2),
    ]
    results = [(label, measure(mode, option, args)) for label, mode, option in rows]
    base = results[0][1]
    print(
        f"GPT (Llama shape) n_layer={args.n_layer} n_embd={args.n_embd}, batch {args.batch} x {args.seq} tokens, "
        f"FSDP2 world of 1, fp32 AdamW, torch {torch.__version__}\n"
    )
    print(
        "| activation checkpointing | peak tracked | activations at peak | vs none | step time (median) | vs none "
        "| loss (same) |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, r in results:
        act = r["breakdown"].get("activations", 0)
        print(
            f"| {label} | {r['peak'] / 2**20:.1f} MiB | {act / 2**20:.1f} MiB | {r['peak'] / base['peak']:.2f}x "
            f"| {r['time'] * 1e3:.0f} ms | {r['time'] / base['time']:.2f}x | {r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
