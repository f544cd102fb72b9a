"""The planner on a mixture-of-experts model: predicted peak tracked memory per rank within 5% of a real run.

The bundled GPT-MoE (6 blocks of 8 experts, top-2: every prediction is extrapolated from the planner's 3-
and 4-block traces) is planned with `shardwise.plan` at expert-parallel degrees 1, 2 and 4 on 4 ranks
(FSDP FULL_SHARD; ep carved out of the 4 shard ranks) and trained for real with the Trainer on 4 CPU
processes in one launch (benchmarks/plan_measure.compare), under FSDPStrategy(ep_size=...): the real
all-to-all dispatch on gloo with the routing the router makes. The planner traces the same set-up on the
fake process group with balanced routing; the real routing of a freshly initialised router is near
balanced, which is what the 5% holds for (the worst case of dropless routing is a note of the plan).
"""

from __future__ import annotations

from plan_measure import compare  # benchmarks/, on pytest's pythonpath

from shardwise.models.gpt_moe import gpt_moe_config
from shardwise.plan.presets import gpt_spec
from shardwise.strategies.parallel import ParallelPlan

TOLERANCE = 0.05


def test_expert_parallel_peak_within_5_percent_at_ep_1_2_4():
    config = gpt_moe_config("gpt-moe-tiny", n_layer=6, n_embd=128, vocab_size=1024, moe_intermediate_size=64)
    spec = gpt_spec("gpt-moe-6x128", config)
    rows = compare(spec, 64, 4, [ParallelPlan("fsdp", ep=ep) for ep in (1, 2, 4)])
    table = "\n".join(
        f"{r['config']}: predicted {r['predicted']:.0f} B, measured {r['measured']:.0f} B ({r['error']:+.1%}) "
        f"ranks {r['ranks']}"
        for r in rows
    )
    assert [r["config"] for r in rows] == ["FSDP FULL_SHARD", "FSDP FULL_SHARD x ep 2", "FSDP FULL_SHARD x ep 4"]
    assert all(r["method"].startswith("traced") for r in rows), table
    assert all(abs(r["error"]) <= TOLERANCE for r in rows), f"off by more than {TOLERANCE:.0%}:\n{table}"
