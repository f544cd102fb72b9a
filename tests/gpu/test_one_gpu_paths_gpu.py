"""On one GPU: the multi-process paths it can run, and the GPU-only features, through the smoke test's checks.

Two ranks on one GPU: NCCL refuses two ranks of a communicator on one device (since 2.5, "Duplicate GPU
detected"), so `Trainer(devices=2)` with one visible GPU is refused before any worker starts, and the
Trainer's multi-rank CUDA paths need two GPUs (the other files here use min(2, GPUs) ranks). What one GPU
runs is the rest: two workers forked from the fork server, both on cuda:0, a gloo group carrying CUDA
tensors between them; NCCL's refusal itself; FSDP bf16 with a planted NaN in a forked worker. Then QLoRA
(the NF4 codes bit for bit after training), ZeRO-2 offload (finite host gradients, GPU memory saved),
torch.compile with the throughput monitor's MFU and the TF32 reading, the SDPA kernel the bundled GPT
gets, 16-mixed loss scaling, the profiler's trace and memory snapshot, and deterministic=True. Each test
is one check of shardwise/smoke (one definition for both; `python -m shardwise.smoke` runs this suite
without this file, having run the checks already).
"""

import pytest
import torch
from gpu_common import DEVICE_TYPE, skip_without_gpu

from shardwise.smoke import gpu, ranks

skip_without_gpu()
pytestmark = pytest.mark.gpu

if DEVICE_TYPE != "cuda":
    pytest.skip(
        "these checks are CUDA's (the CPU dry run is tests/distributed/test_smoke_dry.py)", allow_module_level=True
    )


def run(check):
    """A check raises on a broken promise and returns what it measured; printed for the log."""
    data = check(dry=False, limit_s=600)
    print(data.get("detail", ""))
    return data


def test_trainer_refuses_two_ranks_on_one_gpu():
    if torch.cuda.device_count() != 1:
        pytest.skip("one visible GPU only")
    from shardwise import Trainer

    with pytest.raises(ValueError, match=r"devices=2 but this machine has 1 CUDA device"):
        Trainer(accelerator="cuda", devices=2, strategy="fsdp")


def test_two_forked_ranks_share_one_gpu_over_gloo():
    data = run(ranks.check_launch_two_ranks)
    assert len(data["ranks"]) == 2


def test_nccl_refuses_two_ranks_on_one_gpu():
    run(ranks.check_nccl_same_gpu)


def test_fsdp_bf16_health_check_stops_at_the_planted_nan():
    run(ranks.check_fsdp_bf16_nan)


def test_qlora_codes_stay_bit_identical_on_cuda():
    pytest.importorskip("bitsandbytes")
    run(gpu.check_qlora)


def test_deepspeed_zero2_offload_gradients_and_memory():
    pytest.importorskip("deepspeed")
    run(gpu.check_deepspeed_offload)


def test_compile_throughput_mfu_and_tf32():
    run(gpu.check_compile_mfu_tf32)


def test_sdpa_kernel_of_the_bundled_gpt():
    run(gpu.check_sdpa_kernels)


def test_fp16_mixed_loss_scaling():
    run(gpu.check_fp16_mixed)


def test_profile_trace_and_memory_snapshot():
    run(gpu.check_profile_dump)


def test_deterministic_runs_are_bit_identical():
    run(gpu.check_deterministic)
