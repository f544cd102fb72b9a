"""The collectives one optimizer step runs, per FSDP unit (or DDP bucket): one table for two tests.

tests/distributed/test_collective_counts.py counts them in real training on
gloo; tests/unit/test_collective_accounting.py checks that the planner's
accounting (strategies/accounting.py, `collectives`) says the same, so the
step-time estimate is built on the collectives that actually run. A count is
per optimizer step of `accumulation` micro-batches, keyed "kind/group":
`shard` is the mesh dimension FSDP shards over, `replicate` the replicas
(DDP's whole world, NO_SHARD's and HYBRID_SHARD's replicate dimension). Each
collective moves one unit's (bucket's) parameters or gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


@dataclass(frozen=True)
class CountCase:
    """One strategy and accumulation setting, and what it must communicate per unit per optimizer step."""

    name: str
    engine: str  # "ddp" | "fsdp"
    expected: Dict[str, int] = field(hash=False)
    sharding: str = ""
    accumulation: int = 1
    sync: str = "reduce_scatter"  # FSDPStrategy(accumulation_sync=...)
    devices: int = 2
    mesh: Optional[Tuple[int, int]] = None  # (replicate, shard); the accounting reads replicate as nodes

    @property
    def num_nodes(self) -> int:
        return self.mesh[0] if self.mesh is not None else 1


CASES: Tuple[CountCase, ...] = (
    CountCase("ddp-acc1", "ddp", {"all_reduce/replicate": 1}),
    CountCase("ddp-acc4", "ddp", {"all_reduce/replicate": 1}, accumulation=4),
    CountCase("no_shard-acc4", "fsdp", {"all_reduce/replicate": 1}, sharding="NO_SHARD", accumulation=4),
    CountCase("full_shard-acc1", "fsdp", {"all_gather/shard": 2, "reduce_scatter/shard": 1}, sharding="FULL_SHARD"),
    CountCase(
        "full_shard-acc4",
        "fsdp",
        {"all_gather/shard": 8, "reduce_scatter/shard": 4},
        sharding="FULL_SHARD",
        accumulation=4,
    ),
    CountCase(
        "full_shard-acc4-sync_none",
        "fsdp",
        {"all_gather/shard": 8, "reduce_scatter/shard": 1},
        sharding="FULL_SHARD",
        accumulation=4,
        sync="none",
    ),
    CountCase(
        "shard_grad_op-acc4",
        "fsdp",
        {"all_gather/shard": 4, "reduce_scatter/shard": 4},
        sharding="SHARD_GRAD_OP",
        accumulation=4,
    ),
    CountCase(
        "hybrid_2x2-acc4",
        "fsdp",
        {"all_gather/shard": 8, "reduce_scatter/shard": 4, "all_reduce/replicate": 1},
        sharding="HYBRID_SHARD",
        accumulation=4,
        devices=4,
        mesh=(2, 2),
    ),
)


def per_micro_batch(expected: Dict[str, int], accumulation: int) -> List[Dict[str, int]]:
    """How a step's counts fall on its micro-batches: k per step means one share in every micro-batch;
    once per step means in the last one only (what can wait, waits)."""
    split: List[Dict[str, int]] = [{} for _ in range(accumulation)]
    for key, count in expected.items():
        if count % accumulation == 0:
            for micro in split:
                micro[key] = count // accumulation
        else:
            split[-1][key] = count
    return split
