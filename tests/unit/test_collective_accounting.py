"""The planner's step time counts the collectives training runs (issue 20, item 5).

helpers/collective_counts.py is the table tests/distributed/test_collective_counts.py
asserts in real training on gloo: per FSDP unit (DDP bucket) and optimizer
step, FULL_SHARD's two all-gathers and one reduce-scatter per micro-batch,
SHARD_GRAD_OP's one all-gather, HYBRID_SHARD's single replica all-reduce,
DDP's and NO_SHARD's single all-reduce. Here the accounting's `collectives`
must give the same table, and the step-time model's bytes must be exactly
those collectives priced as ring collectives over their groups.
"""

import pytest

from shardwise.plan.candidates import Candidate
from shardwise.plan.cost import Hardware, step_cost
from shardwise.strategies.accounting import accounting_for
from shardwise.strategies.parallel import ParallelPlan

from helpers.collective_counts import CASES

PARAMS = 10**9
PRECISION = "bf16-mixed"  # parameters gathered in bf16, gradients reduced in fp32
ELEMENT_BYTES = {"all_gather": 2, "reduce_scatter": 4, "all_reduce": 4}


def _plan(case):
    return ParallelPlan(case.engine, sharding=case.sharding)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_accounting_counts_the_collectives_training_runs(case):
    plan = _plan(case)
    assert accounting_for(plan).collectives(plan, case.accumulation, case.sync) == case.expected


def _priced(case) -> float:
    """Bytes one rank sends per step for the table's counts: the units together hold every parameter;
    a ring all-gather / reduce-scatter over s ranks sends (s-1)/s of it, an all-reduce over r replicas
    2(r-1)/r of the shard it reduces."""
    world = case.devices
    if case.engine == "ddp" or case.sharding == "NO_SHARD":
        shard = 1
    elif case.sharding == "HYBRID_SHARD":
        shard = world // case.num_nodes
    else:
        shard = world
    replicas = world // shard
    total = 0.0
    for key, count in case.expected.items():
        kind, group = key.split("/")
        if group == "shard":
            total += count * (shard - 1) / shard * PARAMS * ELEMENT_BYTES[kind]
        else:
            total += count * 2 * (replicas - 1) / replicas * PARAMS / shard * ELEMENT_BYTES[kind]
    return total


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_step_time_prices_exactly_the_counted_collectives(case):
    candidate = Candidate(_plan(case), micro_batch=1, accumulation=case.accumulation)
    cost = step_cost(
        candidate,
        Hardware(),
        params=PARAMS,
        flops_per_token=6e9,
        batch_size=case.accumulation,
        seq_len=1024,
        world=case.devices,
        num_nodes=case.num_nodes,
        precision=PRECISION,
        accumulation_sync=case.sync,
    )
    assert cost.comm_bytes == pytest.approx(_priced(case), rel=1e-12)
    assert cost.comm > 0


def test_hybrid_shard_crosses_nodes_once_per_step_whatever_the_accumulation():
    plan = ParallelPlan("fsdp", sharding="HYBRID_SHARD")
    acct = accounting_for(plan)
    one, four = (acct.comm_bytes(plan, PARAMS, 16, 2, k, PRECISION) for k in (1, 4))
    assert four[2] == one[2] > 0  # the replica all-reduce across nodes: once per step
    assert four[1] == pytest.approx(4 * one[1])  # gathers and reduce-scatters inside a node: per micro-batch
