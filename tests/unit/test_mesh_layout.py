"""ParallelMesh answers every rank question from the global rank and the degrees alone.

The tables below are written by hand from the row-major (dp_replicate, dp_shard, sp, tp) layout, tp
varying fastest, for five layouts of 8 ranks. Each row is one rank: its data-parallel rank, the ranks
that share its batch (sp x tp) and the ranks FSDP2 shards its parameters over (dp_shard x sp). A
DeviceMesh built on a fake world of 8 agrees with the answers for its rank; tests/distributed/
test_sequence_parallel.py checks the same against a real 4-process gloo DeviceMesh.
"""

import pytest

from shardwise import FSDPStrategy
from shardwise.strategies.mesh import ParallelMesh
from shardwise.strategies.parallel import ParallelPlan

A, B = [0, 1, 2, 3], [4, 5, 6, 7]

# name -> (plan, num_nodes, shape (dp_replicate, dp_shard, sp, tp), rows: rank -> (dp rank, batch group, FSDP group))
LAYOUTS = {
    "dp_shard 2 x sp 2 x tp 2": (
        ParallelPlan("fsdp", sp=2, tp=2),
        1,
        (1, 2, 2, 2),
        {
            0: (0, A, [0, 2, 4, 6]),
            1: (0, A, [1, 3, 5, 7]),
            2: (0, A, [0, 2, 4, 6]),
            3: (0, A, [1, 3, 5, 7]),
            4: (1, B, [0, 2, 4, 6]),
            5: (1, B, [1, 3, 5, 7]),
            6: (1, B, [0, 2, 4, 6]),
            7: (1, B, [1, 3, 5, 7]),
        },
    ),
    "dp_replicate 2 x dp_shard 2 x tp 2 (hybrid, 2 nodes)": (
        ParallelPlan("fsdp", sharding="HYBRID_SHARD", tp=2),
        2,
        (2, 2, 1, 2),
        {
            0: (0, [0, 1], [0, 2]),
            1: (0, [0, 1], [1, 3]),
            2: (1, [2, 3], [0, 2]),
            3: (1, [2, 3], [1, 3]),
            4: (2, [4, 5], [4, 6]),
            5: (2, [4, 5], [5, 7]),
            6: (3, [6, 7], [4, 6]),
            7: (3, [6, 7], [5, 7]),
        },
    ),
    "dp_shard 4 x sp 2": (
        ParallelPlan("fsdp", sp=2),
        1,
        (1, 4, 2, 1),
        {r: (r // 2, [r - r % 2, r - r % 2 + 1], list(range(8))) for r in range(8)},
    ),
    "dp_replicate 2 x tp 4 (NO_SHARD)": (
        ParallelPlan("fsdp", sharding="NO_SHARD", tp=4),
        1,
        (2, 1, 1, 4),
        {r: (r // 4, A if r < 4 else B, [r]) for r in range(8)},
    ),
    "dp_shard 8 (FULL_SHARD)": (
        ParallelPlan("fsdp"),
        1,
        (1, 8, 1, 1),
        {r: (r, [r], list(range(8))) for r in range(8)},
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_rank_answers_as_the_hand_table(name):
    plan, nodes, shape, rows = LAYOUTS[name]
    layout = ParallelMesh.from_plan(plan, 8, nodes)
    assert layout.shape == shape
    assert layout.data_parallel_size == shape[0] * shape[1]
    for rank, (dp_rank, batch, fsdp) in rows.items():
        assert layout.data_parallel_rank(rank) == dp_rank, (name, rank)
        assert layout.batch_group(rank) == batch, (name, rank)
        assert layout.fsdp_group(rank) == fsdp, (name, rank)
        assert layout.rank_at(*layout.coordinates(rank).values()) == rank
    # Each data-parallel rank reads one share: its batch groups are the table's, once each, in that order.
    expected = [rows[r][1] for r in range(8) if rows[r][1][0] == r]
    assert layout.batch_groups() == expected
    assert [layout.data_parallel_rank(g[0]) for g in expected] == list(range(layout.data_parallel_size))


def test_the_replicas_and_the_strategy_answers_come_from_the_same_layout():
    layout = ParallelMesh.from_plan(ParallelPlan("fsdp", sharding="HYBRID_SHARD", tp=2), 8, 2)
    assert [layout.replicate_group(r) for r in (0, 3, 6)] == [[0, 4], [3, 7], [2, 6]]
    strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", tp_size=2)
    strategy.num_nodes = 2  # what the Trainer(num_nodes=2) sets
    strategy.env = type("Env", (), {"world_size": 8, "global_rank": 6})()
    assert (strategy.data_parallel_size, strategy.data_parallel_rank) == (4, 3)
    assert strategy.layout == layout


def test_which_fsdp_meshes_keep_a_replicate_dimension():
    two_d = lambda plan, nodes=1: ParallelMesh.from_plan(plan, 8, nodes).replicate_dim  # noqa: E731
    assert not two_d(ParallelPlan("fsdp")) and not two_d(ParallelPlan("fsdp", sharding="SHARD_GRAD_OP"))
    assert two_d(ParallelPlan("fsdp", sharding="NO_SHARD")) and two_d(ParallelPlan("fsdp", sharding="HYBRID_SHARD"))
    assert two_d(ParallelPlan("fsdp", dp_replicate=2, dp_shard=4))
    assert not two_d(ParallelPlan("fsdp", sharding="HYBRID_SHARD", sp=2))  # one node: no replicas beside sp
    assert two_d(ParallelPlan("fsdp", sharding="HYBRID_SHARD", sp=2), nodes=2)


def test_a_layout_the_world_cannot_hold_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="tp x sp = 4 does not divide the 6 processes"):
        ParallelMesh.from_plan(ParallelPlan("fsdp", sp=2, tp=2), 6)
    layout = ParallelMesh.from_plan(ParallelPlan("fsdp", sp=2), 8)
    with pytest.raises(ValueError, match="rank 8 is outside a world of 8 ranks"):
        layout.coordinates(8)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        layout.group(0, ("pp",))


@pytest.mark.parametrize("name", ["dp_shard 2 x sp 2 x tp 2", "dp_replicate 2 x dp_shard 2 x tp 2 (hybrid, 2 nodes)"])
def test_a_device_mesh_on_a_fake_world_of_8_agrees_for_its_rank(name):
    import torch.distributed as dist

    from shardwise.plan.trace import fake_world

    plan, nodes, _, rows = LAYOUTS[name]
    with fake_world(8):
        rank = dist.get_rank()
        meshes = ParallelMesh.from_plan(plan, 8, nodes).build("cpu")
        assert meshes.world.mesh.flatten().tolist() == list(range(8))
        assert meshes.world["sp", "tp"].mesh.flatten().tolist() == rows[rank][1]
        fsdp = meshes.fsdp.mesh.reshape(-1, meshes.fsdp.mesh.shape[-1]).tolist()  # (replicate,) shard x sp
        assert next(row for row in fsdp if rank in row) == rows[rank][2]


# ------------------------------------------------------------------ expert parallel (ep carved out of dp_shard)
# name -> (plan, num_nodes, rows: rank -> (dp rank, ep group, the experts' FSDP group))
EXPERT_LAYOUTS = {
    "dp_shard 8 x ep 2": (
        ParallelPlan("fsdp", ep=2),
        1,
        {r: (r, [r - r % 2, r - r % 2 + 1], [r % 2 + 2 * i for i in range(4)]) for r in range(8)},
    ),
    "dp_shard 8 x ep 4": (
        ParallelPlan("fsdp", ep=4),
        1,
        {r: (r, A if r < 4 else B, [r % 4, r % 4 + 4]) for r in range(8)},
    ),
    "dp_replicate 2 x dp_shard 4 x ep 2 (hybrid, 2 nodes)": (
        ParallelPlan("fsdp", sharding="HYBRID_SHARD", ep=2),
        2,
        {r: (r, [r - r % 2, r - r % 2 + 1], [r - r % 4 + r % 2, r - r % 4 + r % 2 + 2]) for r in range(8)},
    ),
}


@pytest.mark.parametrize("name", EXPERT_LAYOUTS)
def test_expert_parallel_ranks_read_different_samples_and_split_the_experts(name):
    plan, nodes, rows = EXPERT_LAYOUTS[name]
    layout = ParallelMesh.from_plan(plan, 8, nodes)
    assert layout.data_parallel_size == 8 and layout.expert_parallel_size == plan.ep
    for rank, (dp_rank, ep_group, expert_fsdp) in rows.items():
        assert layout.data_parallel_rank(rank) == dp_rank, (name, rank)  # ep ranks are data-parallel ranks
        assert layout.batch_group(rank) == [rank]
        assert layout.expert_group(rank) == ep_group, (name, rank)
        assert layout.expert_rank(rank) == ep_group.index(rank)
        assert layout.expert_shard_group(rank) == expert_fsdp, (name, rank)
        assert layout.fsdp_group(rank) == layout.group(rank, ("dp_shard",))  # the rest: over all dp_shard ranks


@pytest.mark.parametrize("name", EXPERT_LAYOUTS)
def test_an_expert_device_mesh_on_a_fake_world_of_8_agrees_for_its_rank(name):
    import torch.distributed as dist

    from shardwise.plan.trace import fake_world

    plan, nodes, rows = EXPERT_LAYOUTS[name]
    with fake_world(8):
        rank = dist.get_rank()
        meshes = ParallelMesh.from_plan(plan, 8, nodes).build("cpu")
        assert meshes.ep.mesh.tolist() == rows[rank][1]
        experts = meshes.expert_fsdp.mesh.reshape(-1, meshes.expert_fsdp.mesh.shape[-1]).tolist()  # (replicate,) shard
        assert next(row for row in experts if rank in row) == rows[rank][2]
        fsdp = meshes.fsdp.mesh.reshape(-1, meshes.fsdp.mesh.shape[-1]).tolist()
        assert next(row for row in fsdp if rank in row) == ParallelMesh.from_plan(plan, 8, nodes).fsdp_group(rank)


def test_expert_parallel_refusals_name_the_fix():
    from shardwise.strategies import degrees

    with pytest.raises(ValueError, match="ep=4 does not divide the 6 data-parallel shard ranks"):
        ParallelPlan("fsdp", ep=4).mesh(6)
    with pytest.raises(ValueError, match=r"expert parallel runs with FSDP only.*--ep_size 2"):
        ParallelPlan("deepspeed", ep=2)
    with pytest.raises(ValueError, match="expert parallel with tensor parallel is not supported"):
        FSDPStrategy(ep_size=2, tp_size=2)
    with pytest.raises(ValueError, match="ep_size=0: use a positive integer"):
        FSDPStrategy(ep_size=0)
    assert "Use ep_size in [1, 2, 3, 6]" in degrees.experts_problem(4, 6, "Qwen3MoeForCausalLM")
    assert "not a mixture-of-experts model" in degrees.experts_problem(2, 0, "LlamaForCausalLM")
    assert degrees.experts_problem(2, 8) is None and degrees.experts_problem(1, 6) is None
    assert "bitsandbytes" in degrees.quantized_experts_problem(2)
    plan = ParallelPlan("fsdp", ep=2)
    assert (plan.label, plan.strategy_options()) == ("FSDP FULL_SHARD x ep 2", {"ep_size": 2})
    assert FSDPStrategy(ep_size=2).parallel_plan.ep == 2
