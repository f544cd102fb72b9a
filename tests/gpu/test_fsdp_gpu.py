"""FSDP on GPUs: bf16-mixed with clipping, accumulation and sync_dist validation; cpu_offload.

World size min(2, GPUs). The bf16 run checks what the first GPU run hits:
NCCL collectives on CUDA tensors (clip norms, logged metrics, the
validation mean), the loop's batches on the device, a falling loss that every
rank reports identically. The offload run starts from the same weights as
the run without offload (initialisation draws from the CPU generator
either way) and must follow its fp32 loss curve.
"""

import math

import pytest
from gpu_common import DEVICE_TYPE, finite, fit_gpt, rel, skip_without_gpu, world

import shardwise

skip_without_gpu()
pytestmark = pytest.mark.gpu


def bf16_fsdp(root):
    result = fit_gpt(
        "fsdp", devices=world(), precision="bf16-mixed", steps=8, accumulate=2, clip=0.5, root=root, val=True
    )
    params = list(result["trainer"].model.parameters())
    return result["losses"], result["val_loss"], str(params[0].to_local().device.type)


def test_fsdp_bf16_mixed_clipping_accumulation_and_sync_dist_validation(tmp_path):
    ranks = shardwise.launch(bf16_fsdp, str(tmp_path), devices=world())
    losses, val_loss, device = ranks[0]
    assert device == DEVICE_TYPE
    assert len(losses) == 8 and finite(losses), losses
    assert losses[-1] < losses[0], losses
    assert math.isfinite(val_loss)
    assert all(r[:2] == ranks[0][:2] for r in ranks), ranks  # reduced values agree on every rank


def offload_and_not(root):
    plain = fit_gpt("fsdp", devices=world(), steps=6, root=root)["losses"]
    result = fit_gpt("fsdp_cpu_offload", devices=world(), steps=6, root=root)
    model = result["trainer"].model
    where = {
        "params": sorted({p.to_local().device.type for p in model.parameters()}),
        "buffers": sorted({b.device.type for b in model.buffers()}),
    }
    return plain, result["losses"], where


def test_fsdp_cpu_offload_trains_like_fsdp_from_the_same_weights(tmp_path):
    plain, offload, where = shardwise.launch(offload_and_not, str(tmp_path), devices=world())[0]
    assert finite(offload) and len(offload) == 6
    assert rel(offload[:1], plain[:1]) < 1e-5, (offload, plain)  # same initial weights
    assert rel(offload, plain) < 2e-3, (offload, plain)  # CPU Adam vs GPU Adam, fp32
    if DEVICE_TYPE == "cuda":
        assert where["params"] == ["cpu"], where  # offloaded
        assert set(where["buffers"]) <= {"cuda"}, where  # forward runs on the GPU
