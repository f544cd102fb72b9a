"""The fine-tuning recipe on a tiny Llama on GPUs: save, resume, export, from_pretrained; offload; ZeRO-3 offload.

World size min(2, GPUs). fp32 (no TF32) so the exported model's logits can
be compared with the trained, sharded model's: rank 0 loads, every rank
receives its shards over NCCL (CUDA tensors: the staging copies for
offloaded shards are exercised by the offload runs), export gathers one
tensor at a time.
"""

import os

import pytest
import torch
from gpu_common import DEVICE_TYPE, deterministic_math, finite, skip_without_gpu, world

from helpers.hf import build_model_folder, chat_records, write_jsonl

skip_without_gpu()
pytestmark = pytest.mark.gpu

PROBE = [[2, 5, 9, 12, 3, 7, 11, 4]]


def weights_and_logits(module):
    """after_fit (every rank): the trained model's full tensors and its logits on PROBE, on rank 0."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise.fqn import canonical_name

    weights = {}
    for name, p in module.model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        weights[canonical_name(name)] = full.detach().cpu().clone()
    from torch.distributed.fsdp import FSDPModule

    device = next((b.device for b in module.model.buffers()), torch.device(DEVICE_TYPE))
    # The root FSDP unit is the TrainModule (embeddings, head): gathered by hand, since only
    # module.model is called; the decoder layers' own units gather themselves.
    root = module if isinstance(module, FSDPModule) else None
    if root is not None:
        root.unshard()
    with torch.no_grad():
        logits = module.model(input_ids=torch.tensor(PROBE, device=device), use_cache=False).logits
    if root is not None:
        root.reshard()
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return (weights, logits.float().cpu()) if rank0 else None


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe-gpu")
    records = chat_records(96)
    return build_model_folder(str(root / "tiny-llama"), records), write_jsonl(str(root / "chat.jsonl"), records), root


def _config(assets, out, **changes):
    from shardwise.recipes.finetune import coerce_config

    model_dir, data, root = assets
    settings = dict(
        model_path=model_dir,
        dataset=data,
        max_seq_len=64,
        packing=True,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        precision="32-true",
        per_device_train_batch_size=2,
        eval_split_ratio=0.0,
        devices=world(),
        accelerator=DEVICE_TYPE,
        strategy="fsdp",
        logging_steps=100,
        output_dir=str(out),
        cache_dir=str(root / "cache"),
        seed=3,
    )
    return coerce_config({**settings, **changes})


def test_fsdp_save_resume_export_and_logits_after_from_pretrained(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.recipes.finetune import finetune

    deterministic_math()
    straight = finetune(_config(assets, tmp_path / "a", max_steps=4), after_fit=weights_and_logits)
    finetune(_config(assets, tmp_path / "b", max_steps=2, save_steps=2))
    assert os.path.exists(tmp_path / "b" / "checkpoints" / "last.ckpt")
    resumed = finetune(_config(assets, tmp_path / "b", max_steps=4, resume_from_checkpoint="last"))
    assert [s["step"] for s in resumed.losses] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint's history
    assert [s["loss"] for s in resumed.losses] == pytest.approx([s["loss"] for s in straight.losses], rel=1e-4)

    weights, logits = straight.extra
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "a")).to(DEVICE_TYPE)
    state = exported.state_dict()
    for name, value in weights.items():
        assert torch.equal(state[name].cpu(), value), name
    with torch.no_grad():
        again = exported(torch.tensor(PROBE, device=DEVICE_TYPE)).logits.float().cpu()
    torch.testing.assert_close(again, logits, rtol=1e-4, atol=1e-4)


def test_fsdp_cpu_offload_loads_trains_and_exports(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.recipes.finetune import finetune

    result = finetune(_config(assets, tmp_path / "off", max_steps=3, cpu_offload=True, max_grad_norm=1.0))
    assert finite([s["loss"] for s in result.losses]) and len(result.losses) == 3
    assert result.load["tensors"] > 0
    AutoModelForCausalLM.from_pretrained(str(tmp_path / "off"))  # a loadable folder


def test_zero3_offload_loads_trains_and_exports(assets, tmp_path):
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    from shardwise.recipes.finetune import finetune

    result = finetune(_config(assets, tmp_path / "z3", max_steps=3, strategy="deepspeed_stage_3_offload"))
    assert finite([s["loss"] for s in result.losses]) and len(result.losses) == 3
    model_dir = assets[0]
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "z3")).state_dict()
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert exported.keys() == original.keys()
    assert not torch.equal(exported["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])
