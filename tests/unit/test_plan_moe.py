"""The planner's mixture-of-experts accounting: presets, expert parallel's degrees, costs and one traced row.

Fast: the presets are built on the meta device (one and two layers), the degree search, refusals and
cost arithmetic run no trace; one tiny two-layer Qwen3-MoE is traced at ep 1 and ep 2 on the fake
process group through the real FSDPStrategy(ep_size=) set-up. The prediction against real CPU runs of
the bundled GPT-MoE is in tests/distributed/test_plan_accuracy_moe.py.
"""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from shardwise.plan import Candidate, PlanError, plan  # noqa: E402
from shardwise.plan.cost import Hardware, step_cost  # noqa: E402
from shardwise.plan.moe import dispatch_bytes, expert_comm_bytes, expert_rows_per_rank, moe_facts  # noqa: E402
from shardwise.plan.moe_trace import even  # noqa: E402
from shardwise.plan.parallel import with_expert_degrees  # noqa: E402
from shardwise.plan.presets import hf_config_spec, preset_spec  # noqa: E402
from shardwise.strategies.parallel import ParallelPlan  # noqa: E402


def _tiny(tmp_path, layers=2, experts=8):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


@pytest.mark.parametrize(
    "name, total, active, experts, top_k",
    [("qwen3-30b-a3b", 30.5e9, 3.3e9, 128, 8), ("mixtral-8x7b", 46.7e9, 12.9e9, 8, 2)],
)
def test_moe_presets_have_the_published_sizes_and_count_flops_of_active_experts_only(
    name, total, active, experts, top_k
):
    spec = preset_spec(name)
    facts = moe_facts(spec)
    assert (facts.experts, facts.top_k, facts.moe_layers) == (experts, top_k, spec.depth)
    n = spec.param_counts()["total"]
    assert abs(n - total) / total < 0.01  # the model cards' figures
    # 6 x active parameters per token (plus attention): the idle experts cost memory, not FLOPs.
    dense_part = spec.flops_per_token(1) / 6.0
    assert abs(dense_part - active) / active < 0.02
    assert preset_spec(name.upper()).name == name


def test_the_expert_degree_search_and_its_refusals(tmp_path):
    spec = hf_config_spec("tiny", transformers.AutoConfig.from_pretrained(_tiny(tmp_path)))
    base = [Candidate("ddp"), Candidate("fsdp", sharding="FULL_SHARD")]
    cands, notes = with_expert_degrees(base, spec, 8, 1, None, requested=False)
    labels = [c.config_label for c in cands]
    # ep divides the 8 experts and the 8 shard ranks: 2, 4 and 8, each with and without AC.
    assert labels[2:] == [f"FSDP FULL_SHARD x ep {e}{ac}" for e in (2, 4, 8) for ac in ("", " + AC")]
    assert "8 experts (top-2" in notes[0] and "ep 2, 4, 8" in notes[1]
    # Six ranks: only ep 2 divides both.
    assert [c.plan.ep for c in with_expert_degrees(base, spec, 6, 1, None, requested=False)[0]] == [1, 1, 2, 2]
    # --ep_size: the FSDP rows at that degree, DDP dropped; named configurations that cannot take it refused.
    fixed, _ = with_expert_degrees(base, spec, 8, 1, 4, requested=False)
    assert [c.config_label for c in fixed] == ["FSDP FULL_SHARD x ep 4"]
    with pytest.raises(PlanError, match="does not divide tiny's 8 experts"):
        with_expert_degrees(base, spec, 6, 1, 3, requested=False)
    with pytest.raises(PlanError, match="expert parallel runs with FSDP only"):
        with_expert_degrees([Candidate("deepspeed", stage=3)], spec, 8, 1, 2, requested=True)
    with pytest.raises(PlanError, match="does not divide the 6 data-parallel shard ranks"):
        with_expert_degrees(base, spec, 6, 1, 4, requested=False)
    with pytest.raises(PlanError, match="has no experts"):
        with_expert_degrees(base, preset_spec("gpt-tiny"), 8, 1, 2, requested=False)
    with pytest.raises(PlanError, match="ep_size=0"):
        with_expert_degrees(base, spec, 8, 1, 0, requested=False)
    # A dense model is never searched.
    assert with_expert_degrees(base, preset_spec("gpt-tiny"), 8, 1, None, requested=False) == (base, [])


def test_expert_memory_and_communication_arithmetic():
    facts = moe_facts(preset_spec("qwen3-30b-a3b"))
    # FULL_SHARD on 8 ranks: a rank holds 16 experts' slices at ep 1 (128 / 8) and at ep 8 (16 / 1) alike.
    assert expert_rows_per_rank(facts, 1, 8) == expert_rows_per_rank(facts, 8, 8) == 16
    assert expert_rows_per_rank(facts, 4, 3 * 4) == 11  # 32 experts over 3 FSDP ranks: padded to 11
    # Routed rows kept for the backward: tokens x top_k x (hidden + 3 x width), per MoE layer.
    expected, worst = dispatch_bytes(facts, 4096, 8, 2, checkpointed=False)
    assert expected == 48 * 4096 * 8 * (2048 + 3 * 768) * 2 and worst == 8 * expected
    assert dispatch_bytes(facts, 4096, 8, 2, checkpointed=True)[0] == expected / 48
    # ep = shard ranks: the experts are never gathered (FSDP's price for them comes off in full);
    # the all-to-all sends 7/8 of the routed rows 4 times per layer (6 with AC).
    plan8 = ParallelPlan("fsdp", ep=8)
    saved, a2a = expert_comm_bytes(facts, plan8, 8, 1, 4096, 2.0, 4.0, 2.0)
    assert saved == pytest.approx(7 / 8 * facts.expert_params * (2 * 2.0 + 4.0))
    assert a2a == pytest.approx(48 * 4 * 4096 * 8 * 2048 * 2.0 * 7 / 8)
    saved2, _ = expert_comm_bytes(facts, ParallelPlan("fsdp", ep=2), 8, 1, 4096, 2.0, 4.0, 2.0)
    assert saved2 == pytest.approx(saved - 3 / 4 * facts.expert_params / 2 * 8.0)  # gathered over 4 ranks, E/2
    # In the step time: ep 8 on NVLink moves far fewer bytes than FSDP alone for this model.
    common = dict(params=30_500_000_000, flops_per_token=6 * 3.3e9, batch_size=1, seq_len=4096, world=8, num_nodes=1)
    hw = Hardware(gpu="h100", interconnect="nvlink4")
    fsdp = step_cost(Candidate(ParallelPlan("fsdp")), hw, precision="bf16-mixed", experts=facts, **common)
    ep8 = step_cost(Candidate(plan8), hw, precision="bf16-mixed", experts=facts, **common)
    assert ep8.comm_bytes < fsdp.comm_bytes / 3 and ep8.seconds < fsdp.seconds
    assert even(10, 4) == [3, 3, 2, 2]


def test_an_ep_row_is_traced_through_the_real_expert_parallel_setup(tmp_path):
    """Two layers (one trace per row): FULL_SHARD keeps each rank's expert state at 1/world at any ep; the
    ep row's dispatch is traced (balanced) and priced, and refusals name the fix before any trace."""
    config = _tiny(tmp_path)
    common = dict(devices=4, seq_len=32, device_memory="1GiB", candidates=["fsdp"], optimizer_variants=False)
    one = plan(config, **common, ep_size=1, workers=1)
    two = plan(config, **common, ep_size=2, workers=1)
    (e1,), (e2,) = one.estimates, two.estimates
    assert e2.label == "FSDP FULL_SHARD x ep 2, mb 1x1" and e2.method.startswith("traced")
    assert e1.breakdown["parameters"] == e2.breakdown["parameters"] > 0
    assert e2.comm_bytes != e1.comm_bytes
    assert any("balanced routing" in n for n in two.notes)
    assert "ep_size=2" in e2.candidate.trainer_strategy_code("Qwen3MoeDecoderLayer")
    with pytest.raises(PlanError, match="runs with FSDP only"):
        plan(config, **{**common, "candidates": ["deepspeed_stage_3"]}, ep_size=2)
