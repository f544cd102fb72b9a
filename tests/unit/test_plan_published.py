"""Published GPU memory figures as acceptance tests for the planner (fake tensors only, no GPU).

Each test plans the exact published setup (model, devices, precision, batch,
sequence, checkpointing, optimizer, the strategy object the authors ran) and
asserts the prediction within 15% of the published per-GPU figure, or the
published verdict (fits / does not fit). Where each figure comes from, and
how it is read, is in BENCHMARKS.md ("Memory planner against published GPU figures").
"""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.plan import plan
from shardwise.strategies import DDPStrategy, FSDPStrategy

MIB = 2**20
LIGHTNING_POLICY = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}

# Seed 001 (Lightning's FSDP guide, "Optimize the sharding strategy"): the 1B demo Transformer
# (32+32 layers, ninp 1024, nhid 4096, nhead 64, WikiText-2 vocabulary 33,278, 35-token sequences),
# DataLoader(dataset) = batch 1, fp32, torch.optim.Adam, 2 x A100 40GB, Lightning 2.1 / PyTorch 2.1,
# wrap policy {TransformerEncoderLayer, TransformerDecoderLayer}. "Memory (MB)" read as the peak
# allocated in MiB (torch.cuda.memory_summary's unit).
SEED_001 = {
    "DDP": 23125,
    "NO_SHARD": 19296,
    "SHARD_GRAD_OP": 11772,
    "FULL_SHARD": 9627,
}


def _lightning_strategy(name: str):
    if name == "DDP":
        # Lightning's DDPStrategy leaves torch's gradient_as_bucket_view=False: buckets beside .grad.
        return DDPStrategy(gradient_as_bucket_view=False)
    return FSDPStrategy(auto_wrap_policy=LIGHTNING_POLICY, sharding_strategy=name)


@pytest.fixture(scope="module")
def seed_001_plan():
    return plan(
        "transformer-1b",
        devices=2,
        device_memory="40GB",
        precision="32-true",
        batch_size=1,
        seq_len=35,
        optimizer="adam",
        candidates=[_lightning_strategy(n) for n in SEED_001],
        workers=2,  # eight traces (four strategies at 3 and 4 layer pairs): both cores, as `shardwise plan` does
    )


# SHARD_GRAD_OP is predicted 15% low (10,007 vs 11,772 MiB, cuBLAS workspaces included). Measured cause (CPU/gloo,
# 2 ranks, the seed's layer types at 2 and 4 layer pairs, extrapolated to 32; benchmarks/loop_order_memory.py):
# Lightning's automatic optimization calls zero_grad after training_step's forward (its Closure runs step_fn,
# zero_grad_fn, backward_fn), so the previous step's sharded gradients (1,924 MiB here) are alive through the forward,
# and with SHARD_GRAD_OP the forward's end is the peak (every unit stays gathered). In that loop order FSDP1 (as
# Lightning 2.1 ran it: use_orig_params, fp32 MixedPrecision) extrapolates to 11,702 MiB and FSDP2 to 11,818; in
# shardwise's order (zero_grad right after the step, which the planner traces) to 9,778 and 9,895. FSDP1 vs FSDP2 is
# not the cause. The planner models shardwise's Trainer, so that row is checked against the published figure less
# exactly those gradients (test_seed_001_shard_grad_op_gap_is_one_sharded_gradient_copy), not by a loosened tolerance.
SEED_001_SAME_LOOP = [n for n in SEED_001 if n != "SHARD_GRAD_OP"]


@pytest.mark.parametrize("name", SEED_001_SAME_LOOP)
def test_seed_001_sharding_strategy_table(seed_001_plan, name):
    row = seed_001_plan.estimates[list(SEED_001).index(name)]
    published = SEED_001[name] * MIB
    assert row.allocated == pytest.approx(published, rel=0.15), (name, row.allocated / MIB, SEED_001[name])
    assert row.fits  # all four ran on 40 GB


def test_seed_001_shard_grad_op_gap_is_one_sharded_gradient_copy(seed_001_plan):
    """The published SHARD_GRAD_OP figure is the prediction plus the previous step's sharded fp32 gradients.

    That copy is what Lightning's loop order (zero_grad between forward and backward) keeps alive at the
    forward's end; with it the row is within 2% (measured on CPU: +242 MiB at 2 layer pairs, +354 at 4,
    exactly the sharded gradient bytes). If the SHARD_GRAD_OP prediction moves, this says so.
    """
    row = seed_001_plan.estimates[list(SEED_001).index("SHARD_GRAD_OP")]
    sharded_grads = seed_001_plan.params * 4 / seed_001_plan.world_size
    assert row.breakdown["gradients"] < 0.1 * sharded_grads  # the peak is where the new gradients have not built up
    assert row.allocated + sharded_grads == pytest.approx(SEED_001["SHARD_GRAD_OP"] * MIB, rel=0.02)


def test_seed_001_order_matches(seed_001_plan):
    """The published order DDP > NO_SHARD > SHARD_GRAD_OP > FULL_SHARD holds in the prediction too."""
    values = [e.allocated for e in seed_001_plan.estimates]
    assert values == sorted(values, reverse=True)


# Seed 003 (Hugging Face's "Fine-tuning Llama 2 70B using PyTorch FSDP"): Llama-2-70B full
# fine-tuning, FSDP FULL_SHARD + gradient checkpointing, bf16 mixed precision, flash attention,
# per-device batch 1, sequence 2048, bitsandbytes paged_adamw_32bit, A100 80GB. It ran on
# 2 nodes x 8; "if you are using only a single node with 8 A100 80GB GPUs, then paged_adamw_32bit
# optimizer from bitsandbytes is required".
def _llama70b(num_nodes: int, optimizer: str, **kwargs):
    p = plan(
        "llama-2-70b",
        devices=8,
        num_nodes=num_nodes,
        device_memory="80GiB",
        precision="bf16-mixed",
        batch_size=1,
        seq_len=2048,
        candidates=["fsdp_ac"],
        optimizer=optimizer,
        workers=1,
        headroom=0.0,  # the published verdict is whether it ran, not advice with a margin
        optimizer_variants=False,
        **kwargs,
    )
    return p.estimates[0]


def test_seed_003_two_nodes_fit_in_80_gib():
    assert _llama70b(2, "paged_adamw_32bit").fits


def test_seed_003_one_node_fits_only_with_a_paged_optimizer():
    assert _llama70b(1, "paged_adamw_32bit").fits
    for optimizer, kwargs in (("adamw", {}), ("adamw", {"fused": True})):  # foreach (CUDA's default), fused
        assert not _llama70b(1, optimizer, **kwargs).fits, (optimizer, kwargs)
