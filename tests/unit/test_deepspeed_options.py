"""Lightning's DeepSpeedStrategy keyword arguments: set in the DeepSpeed config, or refused by name
(issue 24, item 7). Building the config is pure: no engine, no process group."""

import datetime

import pytest

from shardwise import DeepSpeedStrategy
from shardwise.strategies.deepspeed_config import DeepSpeedConfigError


def test_lightning_arguments_land_in_the_config():
    strategy = DeepSpeedStrategy(
        allgather_bucket_size=50_000_000,
        reduce_bucket_size=60_000_000,
        overlap_comm=False,
        contiguous_gradients=False,
        allgather_partitions=True,
        reduce_scatter=True,
        sub_group_size=1_000_000,
        zero_allow_untested_optimizer=True,
        logging_batch_size_per_gpu=4,
        synchronize_checkpoint_boundary=True,
        partition_activations=True,
        timeout=datetime.timedelta(minutes=2),
    )
    zero = strategy.config["zero_optimization"]
    assert zero["allgather_bucket_size"] == 50_000_000 and zero["reduce_bucket_size"] == 60_000_000
    assert zero["overlap_comm"] is False and zero["contiguous_gradients"] is False
    assert zero["sub_group_size"] == 1_000_000
    assert strategy.config["train_micro_batch_size_per_gpu"] == 4
    assert strategy.config["activation_checkpointing"]["synchronize_checkpoint_boundary"] is True
    assert strategy.timeout_s == 120.0
    # The explicit bucket sizes are the user's: shardwise's size limits fill only what is left open.
    from shardwise.strategies.deepspeed_config import size_limits

    filled = size_limits([1000], strategy.user_config.get("zero_optimization"))
    assert "allgather_bucket_size" not in filled and "reduce_bucket_size" not in filled


def test_zero_optimization_false_is_stage_0_and_offload_targets():
    assert DeepSpeedStrategy(zero_optimization=False).stage == 0
    strategy = DeepSpeedStrategy(
        stage=3,
        offload_parameters=True,
        params_buffer_count=7,
        max_in_cpu=10,
        pin_memory=True,
        optimizer_buffer_count=4,
    )
    offload = strategy.config["zero_optimization"]["offload_param"]
    assert offload == {"device": "cpu", "buffer_count": 7, "max_in_cpu": 10, "pin_memory": True}
    assert "offload_optimizer" not in strategy.config["zero_optimization"]  # Lightning's default, ignored as there
    nvme = DeepSpeedStrategy(stage=3, offload_parameters=True, params_buffer_count=2, offload_params_device="nvme")
    assert nvme.config["zero_optimization"]["offload_param"]["device"] == "nvme"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(offload_params_device="nvme"), DeepSpeedConfigError, "nothing is offloaded: pass offload_parameters"),
        (dict(remote_device="cpu"), DeepSpeedConfigError, r"remote_device='cpu'\) is not supported"),
        (dict(load_full_weights=True), DeepSpeedConfigError, "load_full_weights=True.*shardwise convert"),
        (dict(process_group_backend="nccl"), DeepSpeedConfigError, "process_group_backend"),
        (dict(bucket_size=1), TypeError, r"unknown argument\(s\) \['bucket_size'\].*allgather_bucket_size"),
        (
            dict(config={"zero_optimization": {"reduce_bucket_size": 1}}, reduce_bucket_size=2),
            DeepSpeedConfigError,
            "config sets zero_optimization.reduce_bucket_size=1 but reduce_bucket_size=2",
        ),
    ],
)
def test_refused_or_contradicting_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        DeepSpeedStrategy(**kwargs)


def test_lightning_defaults_are_accepted_where_lightning_ignores_them():
    strategy = DeepSpeedStrategy(remote_device=None, load_full_weights=False, offload_optimizer_device="cpu")
    assert "offload_optimizer" not in strategy.config["zero_optimization"]


def test_logging_batch_size_must_agree_with_the_loader():
    strategy = DeepSpeedStrategy(logging_batch_size_per_gpu=4)
    strategy.configure_training(micro_batch_size=4)
    with pytest.raises(
        DeepSpeedConfigError, match="train_micro_batch_size_per_gpu=4 but the DataLoader's batch_size=8"
    ):
        strategy.configure_training(micro_batch_size=8)


def test_fp16_overflow_is_deepspeeds_to_skip_not_the_health_checks():
    """Under DeepSpeed's fp16 loss scaler an inf gradient is its overflow signal: it skips the step and lowers
    the scale. The health check read it as a failure and stopped the run (found on an H200); it checks the
    loss only there, as it does under torch's GradScaler."""
    from shardwise.trainer.nonfinite import _checks_grads

    assert not _checks_grads(DeepSpeedStrategy(stage=2, config={"fp16": {"enabled": True}}))
    assert _checks_grads(DeepSpeedStrategy(stage=2, config={"bf16": {"enabled": True}}))
    assert _checks_grads(DeepSpeedStrategy(stage=2))
