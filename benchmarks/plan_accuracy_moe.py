"""The planner on a mixture-of-experts model, for BENCHMARKS.md: predicted vs tracked peak at ep 1, 2, 4.

    python benchmarks/plan_accuracy_moe.py

The bundled GPT-MoE (6 blocks of 8 experts, top-2, hidden 128, vocabulary 1024; 64 tokens, 4 sequences
per rank) on 4 CPU processes under FSDP FULL_SHARD at expert-parallel degree 1, 2 and 4: planned with
shardwise.plan (fake tensors, balanced routing) and trained for real with the Trainer for two optimizer
steps in one launch (plan_measure.compare: the worst rank's peak tracked tensor memory). The same case
is tests/distributed/test_plan_accuracy_moe.py (within 5%).
"""

from __future__ import annotations

import datetime
import time

from plan_measure import compare

from shardwise.models.gpt_moe import gpt_moe_config
from shardwise.plan.presets import gpt_spec
from shardwise.strategies.parallel import ParallelPlan


def main() -> None:
    config = gpt_moe_config("gpt-moe-tiny", n_layer=6, n_embd=128, vocab_size=1024, moe_intermediate_size=64)
    started = time.perf_counter()
    rows = compare(gpt_spec("gpt-moe-6x128", config), 64, 4, [ParallelPlan("fsdp", ep=ep) for ep in (1, 2, 4)])
    print(f"{datetime.date.today()}, {time.perf_counter() - started:.0f} s\n")
    print("| configuration | predicted MiB | measured MiB (worst rank) | ranks MiB | error |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        ranks = ", ".join(f"{m / 2**20:.2f}" for m in r["ranks"])
        print(
            f"| {r['config']} | {r['predicted'] / 2**20:.2f} | {r['measured'] / 2**20:.2f} | {ranks} | "
            f"{r['error']:+.1%} |"
        )


if __name__ == "__main__":
    main()
