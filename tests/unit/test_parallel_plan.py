"""ParallelPlan: every strategy name is a plan, a plan builds its strategy, a strategy describes itself as one."""

import pytest
from torch import nn

from shardwise import DDPStrategy, FSDPStrategy, Trainer
from shardwise.strategies import build_strategy
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.strategies.parallel import PLANS, MeshDims, ParallelPlan
from shardwise.strategies.single import SingleDeviceStrategy


class Block(nn.Linear):
    pass


def _buildable(name: str) -> bool:
    # DeepSpeed's optimizer offload needs its CPU Adam op built; the constructor checks for it.
    return not PLANS[name].offload_optimizer or PLANS[name].engine != "deepspeed"


@pytest.mark.parametrize("name", [n for n in PLANS if _buildable(n)])
@pytest.mark.parametrize("ac", [False, True])
def test_a_named_strategy_describes_itself_as_the_plan_it_was_built_from(name, ac):
    if ac and PLANS[name].engine in ("single", "ddp"):
        pytest.skip("DDP has no checkpointing option")
    spelled = name + ("_ac" if ac else "")
    plan = ParallelPlan.from_name(spelled)
    strategy = build_strategy(spelled, blocks={Block})
    described = strategy.parallel_plan
    assert described.configuration() == plan.configuration()
    assert described.blocks == ((Block,) if plan.engine == "fsdp" or ac else None)
    assert described.name == (name if name != "deepspeed" else "deepspeed_stage_2") + ("_ac" if ac else "")
    # ... and building the description gives the same configuration again.
    again = build_strategy(described)
    assert type(again) is type(strategy)
    assert again.parallel_plan == described


def test_each_name_means_the_constructor_options_it_always_meant():
    options = lambda name: (PLANS[name].engine, PLANS[name].strategy_options())  # noqa: E731
    assert options("fsdp_cpu_offload") == ("fsdp", {"cpu_offload": True})
    assert options("deepspeed_stage_3_offload") == (
        "deepspeed",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
    )
    assert options("fsdp_no_shard") == ("fsdp", {"sharding_strategy": "NO_SHARD"})
    assert ParallelPlan.from_name("ZeRO3-offload") == PLANS["deepspeed_stage_3_offload"]  # aliases, case, dashes
    with pytest.raises(ValueError, match="Unknown strategy 'fsdp3'. Valid names: single, ddp"):
        ParallelPlan.from_name("fsdp3")


def test_labels_are_what_the_planner_prints():
    assert ParallelPlan.from_name("fsdp_ac").label == "FSDP FULL_SHARD + AC"
    assert ParallelPlan.from_name("zero3_offload_ac").label == "ZeRO-3 + offload + AC"
    assert ParallelPlan.from_name("dp").label == "DDP"
    assert ParallelPlan.from_name("zero3_offload").name == "deepspeed_stage_3_offload"
    assert ParallelPlan("fsdp", sharding="HYBRID_SHARD", offload_params=True, offload_optimizer=True).name is None


def test_mesh_degrees_resolve_for_a_world_and_follow_the_hybrid_rule():
    assert ParallelPlan("ddp").mesh(8) == MeshDims(8, 1)
    assert ParallelPlan("fsdp").mesh(8) == MeshDims(1, 8)
    assert ParallelPlan("fsdp", sharding="NO_SHARD").mesh(8) == MeshDims(8, 1)
    assert ParallelPlan("fsdp", sharding="HYBRID_SHARD").mesh(16, num_nodes=2) == MeshDims(2, 8)
    assert ParallelPlan("fsdp", dp_replicate=2).mesh(8) == MeshDims(2, 4)
    assert ParallelPlan("deepspeed", zero_stage=3).mesh(4).world_size == 4
    with pytest.raises(ValueError, match="not a multiple of num_nodes=3"):
        ParallelPlan("fsdp", sharding="HYBRID_SHARD").mesh(8, num_nodes=3)
    with pytest.raises(ValueError, match="does not divide"):
        ParallelPlan("fsdp", dp_replicate=3).mesh(8)
    # Explicit degrees are the FSDP device mesh; the implied layout stores as the default.
    assert ParallelPlan("fsdp", dp_replicate=2, dp_shard=2).build().device_mesh_arg == (2, 2)
    assert ParallelPlan("ddp", dp_replicate=-1, dp_shard=1) == ParallelPlan("ddp")


def test_tensor_and_sequence_degrees_run_with_fsdp_and_are_refused_elsewhere_by_name():
    plan = ParallelPlan("fsdp", tp=2, sp=2)
    assert plan.label == "FSDP FULL_SHARD x sp 2 x tp 2"
    assert plan.code() == "FSDPStrategy(auto_wrap_policy={Block}, sp_size=2, tp_size=2)"
    assert plan.mesh(8) == MeshDims(1, 2, tp=2, sp=2)
    assert build_strategy(plan).parallel_plan.configuration() == plan  # the strategy describes itself the same
    with pytest.raises(ValueError, match=r"tensor parallel runs with FSDP only \(ZeRO partitions"):
        ParallelPlan("deepspeed", tp=2)
    with pytest.raises(ValueError, match=r"sequence parallel runs with FSDP only.*FSDPStrategy\(\.\.\., sp_size=2\)"):
        ParallelPlan("ddp", sp=2)
    with pytest.raises(ValueError, match="FSDP2's offload does not support tensor-parallel"):
        ParallelPlan("fsdp", tp=2, offload_params=True, offload_optimizer=True)
    with pytest.raises(ValueError, match="torch.compile with sequence parallel"):
        ParallelPlan("fsdp", sp=2, compile=True)
    with pytest.raises(ValueError, match="tp x sp = 4 does not divide the 6 processes"):
        plan.mesh(6)
    with pytest.raises(ValueError, match="tp_size"):
        FSDPStrategy(tp_size=0)


def test_sp_and_tp_meshes_put_tp_neighbours_together_and_fsdp_over_data_parallel_and_sp():
    from shardwise.plan.trace import fake_world
    from shardwise.strategies.mesh import ParallelMesh

    with fake_world(8):
        meshes = ParallelMesh.from_plan(ParallelPlan("fsdp", sp=2, tp=2), 8, 1).build("cpu")
        assert meshes.world.mesh_dim_names == ("dp_replicate", "dp_shard", "sp", "tp")
        assert meshes.world.mesh.reshape(-1).tolist() == list(range(8))  # row-major: tp varies fastest
        assert tuple(meshes.fsdp.shape) == (4,) and tuple(meshes.sp.shape) == (2,) and tuple(meshes.tp.shape) == (2,)
        meshes = ParallelMesh.from_plan(ParallelPlan("fsdp", sharding="HYBRID_SHARD", sp=2), 8, 2).build("cpu")
        fsdp = meshes.fsdp
        assert tuple(fsdp.shape) == (2, 4) and fsdp.mesh_dim_names == ("dp_replicate", "dp_shard_sp")
        assert meshes.tp is None
    strategy = FSDPStrategy(sp_size=2, tp_size=2)
    strategy.env = type("Env", (), {"world_size": 8, "global_rank": 5})()
    assert (strategy.data_parallel_size, strategy.data_parallel_rank) == (2, 1)  # ranks 4-7 read share 1


def test_contradictions_are_refused_by_name():
    with pytest.raises(ValueError, match="offloads parameters, gradients and optimizer state together"):
        ParallelPlan("fsdp", offload_params=True)
    with pytest.raises(ValueError, match="is DeepSpeed's"):
        ParallelPlan("fsdp", zero_stage=3)
    with pytest.raises(ValueError, match="is FSDP's"):
        ParallelPlan("ddp", sharding="FULL_SHARD")
    with pytest.raises(ValueError, match="engine='ddp' has no offload"):
        ParallelPlan("ddp", offload_optimizer=True)
    with pytest.raises(ValueError, match="activation checkpointing needs your block class"):
        ParallelPlan("fsdp", ac="full").build()


def test_selective_checkpointing_and_precision_reach_the_strategy():
    plan = ParallelPlan("fsdp", ac="selective", selective_ac_option=2, blocks=[Block], precision="bf16-mixed")
    strategy = build_strategy(plan)
    assert isinstance(strategy, FSDPStrategy)
    assert (strategy.activation_checkpointing_mode, strategy.selective_ac_option) == ("selective", 2)
    assert strategy.auto_wrap_policy == {Block} and strategy.activation_checkpointing_policy == {Block}
    assert strategy.parallel_plan == plan


def test_the_trainer_takes_a_plan():
    trainer = Trainer(accelerator="cpu", devices=1, strategy=ParallelPlan("ddp"))
    assert isinstance(trainer.strategy, DDPStrategy)
    assert isinstance(build_strategy(ParallelPlan()), SingleDeviceStrategy)
    assert isinstance(build_strategy(ParallelPlan("deepspeed", zero_stage=1)), DeepSpeedStrategy)


def test_the_planner_takes_a_plan_as_a_candidate_and_reports_its_name():
    from shardwise.models import GPTConfig
    from shardwise.plan import plan
    from shardwise.plan.presets import gpt_spec

    spec = gpt_spec("tiny", GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32))
    p = plan(spec, candidates=[ParallelPlan("fsdp", ac="full"), "fsdp_ac"], devices=2, seq_len=16, workers=1)
    by_plan, by_name = p.estimates
    assert by_plan.candidate == by_name.candidate and by_plan.candidate.name == "fsdp_ac"
    assert by_plan.allocated == by_name.allocated and by_plan.candidate.config_label == "FSDP FULL_SHARD + AC"


def test_fsdp_builds_its_device_mesh_from_the_plan_degrees():
    from shardwise.plan.trace import fake_world
    from shardwise.strategies.mesh import ParallelMesh

    def shape(sharding, world, nodes, device_mesh=None):
        fsdp = FSDPStrategy(sharding_strategy=sharding, device_mesh=device_mesh)
        mesh = ParallelMesh.from_plan(fsdp.plan, world, nodes).build("cpu").fsdp
        return tuple(mesh.shape), mesh.mesh_dim_names

    with fake_world(8):
        assert shape("FULL_SHARD", 8, 1) == ((8,), ("dp_shard",))
        assert shape("SHARD_GRAD_OP", 8, 2) == ((8,), ("dp_shard",))
        assert shape("NO_SHARD", 8, 1) == ((8, 1), ("dp_replicate", "dp_shard"))
        assert shape("HYBRID_SHARD", 8, 2) == ((2, 4), ("dp_replicate", "dp_shard"))
        assert shape("HYBRID_SHARD", 8, 1) == ((1, 8), ("dp_replicate", "dp_shard"))
        assert shape("FULL_SHARD", 8, 1, (2, 4)) == ((2, 4), ("dp_replicate", "dp_shard"))
        with pytest.raises(ValueError, match=r"device_mesh=\(3, 2\) has 6 ranks but the world size is 8"):
            shape("FULL_SHARD", 8, 1, (3, 2))
        with pytest.raises(ValueError, match="world size 8 is not a multiple of num_nodes=3"):
            shape("HYBRID_SHARD", 8, 3)
