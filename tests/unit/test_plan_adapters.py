"""The planner with adapters (issue 21 item 6): LoRA / QLoRA arguments, trainable-only states, a 70B QLoRA verdict.

The prediction-vs-tracked-peak checks on real CPU runs are in
tests/distributed/test_plan_accuracy.py (they start processes); these run
the planner only, on fake tensors.
"""

from __future__ import annotations

import pytest

from shardwise.models import GPTConfig
from shardwise.plan import PlanError, plan
from shardwise.plan.adapters import build_adapters, nf4_bytes

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

GiB = 1024**3
TINY = GPTConfig(
    vocab_size=512, block_size=32, n_layer=2, n_head=4, n_embd=64, norm="rmsnorm", mlp="swiglu", rope=True, bias=False
)


def _plan(**kw):
    args = dict(batch_size=2, seq_len=32, devices=2, precision="32-true", accelerator="cpu", workers=1)
    return plan(TINY, **{**args, **kw})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(load_in_4bit=True), "needs LoRA"),
        (dict(lora_r=-1), "lora_r=-1"),
        (dict(lora_r=True), "lora_r=True"),
        (dict(lora_r=8, lora_alpha=0), "lora_alpha=0"),
        (dict(lora_r=8, lora_dropout=1.5), "lora_dropout=1.5"),
        (dict(lora_target_modules=["q_proj"]), "lora_r=0"),
    ],
)
def test_adapter_arguments_refused_before_tracing(kwargs, words):
    with pytest.raises(PlanError, match=words):
        _plan(**kwargs)


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_adapters_are_refused_under_deepspeed(load_in_4bit):
    # ZeRO's rows are accounted, not traced, and the accounting counts every parameter as trainable.
    with pytest.raises(PlanError, match="DDP and FSDP only"):
        _plan(lora_r=4, load_in_4bit=load_in_4bit, candidates=["deepspeed_stage_3"])


def test_lora_plan_holds_gradients_and_adam_state_for_adapters_only():
    full = _plan(candidates=["fsdp"])
    lora = _plan(candidates=["fsdp"], lora_r=4)
    # Two blocks, LoRA on q_proj and v_proj (64 x 64): A (4 x 64) + B (64 x 4) each, fp32 Adam's two
    # moments sharded over 2 ranks; the frozen base keeps its parameter bytes.
    trainable = 2 * 2 * (4 * 64 + 64 * 4)
    (f,), (a,) = full.estimates, lora.estimates
    assert a.breakdown["optimizer"] == pytest.approx(8 * trainable / 2, rel=0.05)
    assert a.breakdown["optimizer"] < f.breakdown["optimizer"] / 20
    assert a.breakdown["parameters"] >= f.breakdown["parameters"] * 0.9
    assert "LoRA r=4" in lora.model


def test_nf4_layout_bytes():
    # 4 bits per weight + one byte per 64 weights + 8 bytes per 256 blocks: about 0.516 bytes a weight.
    assert nf4_bytes(64 * 256) == 64 * 256 / 2 + 256 + 8
    assert build_adapters(16, load_in_4bit=True).load_in_4bit


def test_llama_70b_qlora_fits_on_two_48gb_devices():
    result = plan(
        "llama-2-70b",
        devices=2,
        device_memory="48GB",
        seq_len=2048,
        lora_r=16,
        load_in_4bit=True,
        candidates=["fsdp_ac"],
        workers=1,
    )
    (row,) = result.estimates
    assert row.fits and result.recommended is row
    # 69B parameters, nearly all in NF4 (~0.52 bytes each), embeddings and head in fp32: ~18 GiB a device.
    assert 16 * GiB < row.breakdown["parameters"] < 20 * GiB
    assert row.breakdown["gradients"] + row.breakdown["optimizer"] < 1 * GiB  # adapters only
    assert row.reserved < 44 * GiB
