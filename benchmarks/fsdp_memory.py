"""Per-rank memory and speed of each strategy, beside the seed's A100 table.

Runs `shardwise demo`'s comparison (the seed Transformer, 2 local processes,
fp32 Adam, tracked tensor memory per rank on the first two steps, speed on
the following untracked steps) and prints it as the markdown table recorded
in BENCHMARKS.md.

    python benchmarks/fsdp_memory.py [--compare_steps 10] [--batch_size 4]
"""

import datetime
import sys

from shardwise.cli.demo import GUIDE_TABLE, LABELS, demo
from shardwise.memory import format_bytes


def seed_ratio(seed):
    return f"{seed[0] / GUIDE_TABLE['ddp'][0]:.2f}x" if seed else "-"


def main(argv=None):
    args = dict(steps=6, compare_steps=10)
    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, value in zip(argv[::2], argv[1::2]):
        args[flag.lstrip("-")] = int(value)
    rows = demo(**args)
    ddp = next(r for r in rows if r["name"] == "ddp")
    print(
        f"\nCommand: `python benchmarks/fsdp_memory.py {' '.join(argv)}`, {datetime.date.today()}, "
        f"{rows[0]['params'] / 1e6:.1f}M-parameter seed Transformer, 2 CPU processes (gloo), fp32 Adam.\n"
    )
    print(
        "| strategy | peak / rank | vs DDP | parameters | gradients | optimizer | activations | it/s | "
        "seed A100 MB | seed vs DDP | seed it/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, seed = r["breakdown"], GUIDE_TABLE.get(r["name"])
        print(
            f"| {LABELS[r['name']]} | {format_bytes(r['peak'])} | {r['peak'] / ddp['peak']:.2f}x | "
            f"{format_bytes(b.get('parameters', 0))} | {format_bytes(b.get('gradients', 0))} | "
            f"{format_bytes(b.get('optimizer', 0))} | {format_bytes(b.get('activations', 0) + b.get('other', 0))} | "
            f"{r['its']:.2f} | {f'{seed[0]:,}' if seed else '-'} | "
            f"{seed_ratio(seed)} | "
            f"{seed[1] if seed else '-'} |"
        )


if __name__ == "__main__":
    main()
