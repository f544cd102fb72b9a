"""Parity on GPUs: single device, DDP, FSDP variants and ZeRO-3 from identical weights, same losses.

fp32 without TF32, the same global batch (8 sequences per micro-batch,
accumulation 2, clipping 0.5) whatever the world size (min(2, GPUs)). The
first step's loss is computed from the initial weights only, so it must
agree to fp32 rounding; the curves to GPU reduction-order noise.
"""

import pytest
from gpu_common import finite, fit_gpt, rel, skip_without_gpu, world

import shardwise

skip_without_gpu()
pytestmark = pytest.mark.gpu

STEPS = 8
NAMES = ["ddp", "fsdp", "fsdp_ac", "fsdp_shard_grad_op", "fsdp_no_shard", "deepspeed_stage_3"]


def single():
    return fit_gpt("single", devices=1, steps=STEPS)["losses"]


def many(names):
    return {name: fit_gpt(name, devices=world(), steps=STEPS)["losses"] for name in names}


def test_strategies_match_single_device_from_identical_weights():
    pytest.importorskip("deepspeed")
    reference = shardwise.launch(single, devices=1)[0]
    results = shardwise.launch(many, NAMES, devices=world())
    assert finite(reference) and len(reference) == STEPS and reference[-1] < reference[0]
    for name in NAMES:
        losses = results[0][name]
        assert len(losses) == STEPS, name
        assert rel(losses[:1], reference[:1]) < 1e-5, (name, losses, reference)
        assert rel(losses, reference) < 2e-3, (name, losses, reference)
