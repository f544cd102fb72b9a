"""DeepSpeed ZeRO 1-3 with bf16 on GPUs, and fp16 loss scaling that skips overflowing steps.

World size min(2, GPUs). fp16 starts at a loss scale of 2**32, so the first
steps overflow; DeepSpeed skips them and lowers the scale, and training goes
on with finite losses (the Trainer keeps counting optimizer steps).
"""

import pytest
from gpu_common import DEVICE_TYPE, finite, fit_gpt, skip_without_gpu, world

import shardwise

skip_without_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.deepspeed]
pytest.importorskip("deepspeed")


def zero_bf16(names):
    out = {}
    for name in names:
        result = fit_gpt(name, devices=world(), precision="bf16-mixed", steps=8, lr=3e-3)
        out[name] = (result["losses"], str(next(result["trainer"].model.parameters()).dtype))
    return out


def test_zero_stages_1_to_3_train_in_bf16():
    results = shardwise.launch(
        zero_bf16, ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"], devices=world()
    )[0]
    for name, (losses, dtype) in results.items():
        assert len(losses) == 8 and finite(losses), (name, losses)
        assert losses[-1] < losses[0], (name, losses)
        assert dtype == "torch.bfloat16", (name, dtype)  # the engine's module holds bf16 weights


def fp16_overflow():
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        stage=2, config={"fp16": {"enabled": True, "initial_scale_power": 32, "loss_scale_window": 1000}}
    )
    result = fit_gpt(strategy, devices=world(), precision="16-mixed", steps=8, lr=3e-3)
    engine = result["trainer"].strategy.engine
    scale = float(engine.optimizer.loss_scaler.cur_scale)  # ZeRO 1/2's DeepSpeedZeroOptimizer (0.19.x)
    return result["losses"], int(engine.skipped_steps), scale, result["trainer"].global_step


def test_fp16_overflow_steps_are_skipped_and_training_goes_on():
    if DEVICE_TYPE != "cuda":
        pytest.skip("fp16 loss scaling is DeepSpeed's CUDA path")
    losses, skipped, scale, steps = shardwise.launch(fp16_overflow, devices=world())[0]
    assert steps == 8 and finite(losses), losses
    assert skipped >= 1, skipped  # 2**32 overflows fp16 gradients
    assert scale < 2.0**32, scale
