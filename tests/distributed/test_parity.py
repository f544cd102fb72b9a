"""Loss parity: one TrainModule, the strategy changed by one argument, the same loss curve.

8 optimizer steps of a small Transformer language model, accumulation 2, clipping 0.5, in
fp32 on CPU. Every strategy starts from the same weights (sharding-invariant
init) and sees the same global batch, so per-step losses must agree with the
single-device run to within 1e-4 relative.
"""

import pytest

import shardwise

from helpers.lm import train_losses, train_many

STEPS = 8  # every step accumulates 2 micro-batches and clips: 8 of them show the curve (was 20)


@pytest.fixture(scope="module")
def reference():
    # The global batch is 8 sequences per micro-batch: 8 on one device, 4 on each of 2 ranks.
    return shardwise.launch(train_losses, "single", 1, 8, STEPS, devices=1)[0]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# Strategy-table names, FSDP wrapping the Transformer's layers; and "fsdp" as one unit, as a bare
# Trainer(strategy="fsdp") shards a model without a wrap policy.
PARITY = [
    dict(name=n, devices=2, batch_size=4, steps=STEPS)
    for n in ("ddp", "fsdp", "fsdp_shard_grad_op", "fsdp_no_shard", "fsdp_ac")
] + [dict(key="fsdp, one unit", name="fsdp", wrap=False, devices=2, batch_size=4, steps=STEPS)]
BF16 = [
    dict(key=p, name="fsdp", devices=2, batch_size=4, steps=12, precision=p, lr=3e-3)
    for p in ("bf16-mixed", "bf16-true")
]


@pytest.fixture(scope="module")
def two_ranks(request):
    """The 2-rank runs of the selected tests below, one after another in one launch (start-up costs more than
    these runs): run key -> each rank's losses."""
    wanted = {item.originalname for item in request.session.items if item.module is request.module}
    configs = []
    if "test_two_process_strategies_match_single_device" in wanted:
        configs += PARITY
    if "test_bf16_mixed_and_true_train" in wanted:
        configs += BF16
    ranks = shardwise.launch(train_many, [dict(c) for c in configs], devices=2)
    return {key: [rank[key] for rank in ranks] for key in ranks[0]}


def test_two_process_strategies_match_single_device(reference, two_ranks):
    names = [c.get("key", c["name"]) for c in PARITY]
    results = [{name: two_ranks[name][rank] for name in names} for rank in range(2)]
    for rank_result in results:  # every rank saw the same reduced curve
        assert rank_result == results[0]
    assert len(reference) == STEPS
    for name in names:
        losses = results[0][name]
        assert len(losses) == STEPS, name
        assert _rel(losses, reference) < 1e-4, (name, losses, reference)
    assert reference[-1] < reference[0]


@pytest.mark.slow
def test_hybrid_shard_2x2_matches_single_device(reference):
    config = dict(name="fsdp_hybrid_shard", devices=4, batch_size=2, steps=STEPS, device_mesh=(2, 2))
    losses = shardwise.launch(train_many, [config], devices=4)[0]["fsdp_hybrid_shard"]
    assert _rel(losses, reference) < 1e-4, (losses, reference)


def test_bf16_mixed_and_true_train(two_ranks):
    results = {c["key"]: two_ranks[c["key"]][0] for c in BF16}
    for precision, losses in results.items():
        head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert tail < head * 0.95, (precision, losses)
