"""The planner's sequence and tensor parallel: degree search, refusals, accounting, traced memory.

Fast: the search and the refusals run no trace; the memory checks trace tiny two-block GPTs on the
fake process group through the real apply_sequence_parallel / apply_tensor_parallel (one depth, so
one trace per configuration). The prediction against real CPU runs is in
tests/distributed/test_plan_accuracy.py.
"""

from __future__ import annotations

import pytest

from shardwise.models import GPTConfig
from shardwise.plan import Candidate, PlanError, plan
from shardwise.plan.cost import Hardware, step_cost
from shardwise.plan.parallel import (
    degree_problem,
    replicated_flops,
    search_parallel,
    searched_degrees,
    with_parallel_degrees,
)
from shardwise.plan.presets import gpt_spec, preset_spec
from shardwise.strategies.accounting import accounting_for
from shardwise.strategies.parallel import ParallelPlan

# 8 heads, 4 key/value heads: tp x sp may be 2 or 4, never 8.
GQA = gpt_spec(
    "gqa",
    GPTConfig(
        vocab_size=64, block_size=256, n_layer=2, n_head=8, n_kv_head=4, n_embd=128, rope=True, tie_embeddings=False
    ),
)


def test_the_search_keeps_degrees_that_divide_the_node_the_heads_and_the_sequence():
    pairs, skipped = searched_degrees(GQA, 256, per_node=8)
    assert sorted(pairs) == [(1, 2), (1, 4), (2, 1), (2, 2), (4, 1)]
    assert len(skipped) == 4 and all("4 key/value heads" in s for s in skipped)  # the four products of 8
    odd, _ = searched_degrees(GQA, 254, per_node=8)  # 254 = 2 x 127: only groups of two
    assert sorted(odd) == [(1, 2), (2, 1)]

    # Searched when nothing else fits: one dimension at a time, sp also with offload + AC.
    extra, notes = search_parallel(GQA, 256, 8, 1, offload=True)
    labels = [c.config_label for c in extra]
    sp2 = "FSDP FULL_SHARD x sp 2"
    assert labels[:3] == [sp2, sp2 + " + AC", sp2 + " + offload + AC"]
    assert len(labels) == 2 * 3 + 2 * 2 and "FSDP FULL_SHARD x tp 4 + AC" in labels and "x sp 2 x tp 2" not in notes[0]
    assert search_parallel(GQA, 256, 8, 8, offload=True) == ([], [])  # one device per node
    assert search_parallel(preset_spec("transformer-1b"), 35, 8, 1, offload=True) == ([], [])  # no hook
    # Named configurations without flags are planned as named.
    base = [Candidate("ddp"), Candidate("fsdp", sharding="FULL_SHARD")]
    assert with_parallel_degrees(base, GQA, 256, 8, 1, None, None, requested=True)[0] == base


def test_fixed_degrees_apply_to_the_fsdp_configurations_and_refuse_what_cannot_run():
    base = [Candidate("ddp"), Candidate("fsdp", sharding="FULL_SHARD", activation_checkpointing=True)]
    cands, _ = with_parallel_degrees(base, GQA, 256, 8, 1, None, 4, requested=False)
    assert [c.config_label for c in cands] == ["FSDP FULL_SHARD x sp 4 + AC"]  # DDP cannot take sp: dropped
    with pytest.raises(PlanError, match="sequence parallel runs with FSDP only"):
        with_parallel_degrees(base, GQA, 256, 8, 1, None, 4, requested=True)  # ... unless it was named
    assert with_parallel_degrees(base, GQA, 256, 8, 1, 1, 1, requested=False)[0] == base  # 1 x 1: no search
    offload = [Candidate("fsdp", sharding="FULL_SHARD", offload=True)]
    with pytest.raises(PlanError, match="CPU offload"):
        with_parallel_degrees(offload, GQA, 256, 8, 1, 2, None, requested=True)
    for tp, sp, seq, per_node, match in (
        (1, 8, 256, 8, "8 ranks must split gqa's 8 attention heads and 4 key/value heads"),
        (2, 1, 255, 8, "sequence length 255 must be a multiple of tp x sp = 2"),
        (1, 4, 256, 2, "must fit inside a node of 2"),
    ):
        assert match in degree_problem(GQA, seq, tp, sp, per_node)
        with pytest.raises(PlanError, match=match.split(" 8 ")[0]):
            plan(GQA, devices=per_node, seq_len=seq, candidates=["fsdp"], tp_size=tp, sp_size=sp, workers=1)
    tied = gpt_spec("tied", GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=64))
    assert "ties its output head" in degree_problem(tied, 64, 2, 1, 2) and degree_problem(tied, 64, 1, 2, 2) is None
    assert all(tp == 1 for tp, _ in searched_degrees(tied, 64, 4)[0])
    with pytest.raises(PlanError, match="need a model with their attention hook"):
        plan("transformer-1b", devices=2, candidates=["fsdp"], sp_size=2, workers=1)
    with pytest.raises(PlanError, match="sp_size=0"):
        plan(GQA, devices=2, candidates=["fsdp"], sp_size=0, workers=1)


def test_activation_collectives_count_and_price_the_layers():
    acct = accounting_for(ParallelPlan("fsdp"))
    sp, tp = ParallelPlan("fsdp", sp=4), ParallelPlan("fsdp", tp=2)
    assert acct.activation_collectives(ParallelPlan("fsdp"), 32, 1) == {}
    assert acct.activation_collectives(sp, 32, 2) == {"all_to_all/sp": 2 * 32 * 8}  # 4 + 4 per layer
    ac = ParallelPlan("fsdp", sp=4, ac="full")
    assert acct.activation_collectives(ac, 32, 1)["all_to_all/sp"] == 32 * 12  # the forward again
    assert acct.activation_collectives(tp, 32, 1) == {"all_gather/tp": 32 * 4, "reduce_scatter/tp": 32 * 4}
    tokens, h, kv = 8192, 4096, 1024
    a2a = acct.activation_comm_bytes(sp, tokens, h, kv, 32, 1, "bf16-mixed")
    assert a2a == pytest.approx(32 * 2 * (tokens / 4) * (2 * h + 2 * kv) * 2 * 3 / 4)  # 3/4 leaves each rank
    ring = acct.activation_comm_bytes(tp, tokens, h, kv, 32, 1, "bf16-mixed")
    assert ring == pytest.approx(32 * 8 * tokens * h * 2 / 2)
    # Step time: the activation collectives are added unhidden on the intra-node link; FSDP's own
    # gathers move each rank's 1/tp of the parameters over world / tp ranks.
    kw = dict(params=8e9, flops_per_token=5e10, batch_size=1, seq_len=tokens, world=8, num_nodes=1)
    plain = step_cost(Candidate(ParallelPlan("fsdp"), micro_batch=1), Hardware(), precision="bf16-mixed", **kw)
    with_sp = step_cost(Candidate(sp, micro_batch=4), Hardware(), precision="bf16-mixed", shape=(h, kv, 32), **kw)
    assert with_sp.compute == pytest.approx(plain.compute)  # the same work per device
    fsdp_bytes = acct.comm_bytes(ParallelPlan("fsdp"), 8e9, 8, 1, 1, "bf16-mixed")[0]
    a2a_step = acct.activation_comm_bytes(sp, 4 * tokens, h, kv, 32, 1, "bf16-mixed")
    assert with_sp.comm_bytes == pytest.approx(fsdp_bytes + a2a_step)
    assert with_sp.seconds == pytest.approx(plain.seconds + a2a_step / 200e9)
    # The bundled GPT gathers the sequence before its head: each sp rank repeats the head for its group.
    assert replicated_flops(GQA, ParallelPlan("fsdp", sp=4)) == 3 * 6 * 128 * 64
    assert replicated_flops(GQA, ParallelPlan("fsdp", tp=2)) == 0.0
    repeated = step_cost(
        Candidate(sp, micro_batch=4), Hardware(), precision="bf16-mixed", replicated_flops_per_token=5e9, **kw
    )
    assert repeated.compute == pytest.approx(plain.compute * 1.1)
    tp_bytes = acct.comm_bytes(tp, 8e9, 8, 1, 1, "bf16-mixed")[0]
    assert tp_bytes == pytest.approx(fsdp_bytes / 2 * (3 / 4) / (7 / 8))  # 4 FSDP ranks, half the elements


def _rows(spec, cands, **kw):
    p = plan(spec, devices=2, seq_len=256, precision="32-true", accelerator="cpu", workers=1, candidates=cands, **kw)
    return {(e.candidate.config_label, e.candidate.micro_batch): e for e in p.estimates}


def test_traced_sp_and_tp_halve_activations_per_sequence_and_tp_halves_replicated_weights():
    # One plan, one trace per configuration. A tp x sp group's row holds two sequences (the global batch
    # is kept), split over its two ranks: as much as one sequence on one rank, half per sequence. The
    # vocabulary is small, so the logits (whole on every sp rank: the GPT gathers before its head) are
    # a small part of the activations.
    cands = ["fsdp", ParallelPlan("fsdp", sp=2), "fsdp_no_shard", ParallelPlan("fsdp", sharding="NO_SHARD", tp=2)]
    rows = _rows(GQA, cands, batch_size=1)
    plain, sp = rows[("FSDP FULL_SHARD", 1)], rows[("FSDP FULL_SHARD x sp 2", 2)]
    one, tp = rows[("FSDP NO_SHARD", 1)], rows[("FSDP NO_SHARD x tp 2", 2)]
    assert all(e.method == "traced" for e in rows.values())
    assert (sp.candidate.to_dict()["sp"], tp.candidate.to_dict()["tp"]) == (2, 2)  # in --json too
    for split, whole in ((sp, plain), (tp, one)):
        ratio = split.breakdown["activations"] / whole.breakdown["activations"]
        assert 0.95 < ratio < 1.1, (split.label, ratio)  # 2.0 if the sequences were not split
    # Replicated (NO_SHARD): under tp 2 each rank holds half of every matrix.
    for part in ("parameters", "optimizer"):
        assert 0.5 <= tp.breakdown[part] / one.breakdown[part] < 0.52


def test_a_hugging_face_model_under_sp_is_traced_scoring_its_slice():
    # As `shardwise finetune` runs it (sequence_parallel_hf.split_batch): each sp rank runs its slice and
    # scores it, so the logits are split too; with a large vocabulary sp 2 holds about half per sequence.
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from shardwise.plan.presets import hf_config_spec

    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    rows = _rows(hf_config_spec("tiny-hf-llama", cfg), ["fsdp", ParallelPlan("fsdp", sp=2)], batch_size=1)
    plain, sp = rows[("FSDP FULL_SHARD", 1)], rows[("FSDP FULL_SHARD x sp 2", 2)]
    assert plain.method == sp.method == "traced"
    ratio = sp.breakdown["activations"] / plain.breakdown["activations"]
    assert 0.9 < ratio < 1.1, ratio  # two sequences over two ranks: one sequence's worth (2.0 unsplit)
