# LoRA through the fine-tuning recipe, on 2 processes (CPU, gloo), in one launch (shared with other
# recipe files: tests/recipes/conftest.py):
# FSDP FULL_SHARD trains 20 steps (the loss falls; the trainable / total
# parameter counts are reported; the frozen base weights stay exactly the
# checkpoint's, get no gradient and no optimizer state, while every decoder
# layer -- one FSDP unit -- mixes frozen and trainable parameters), then the
# same run under DDP and DeepSpeed ZeRO-3 for 10 steps gives the same losses
# within 1e-4 (fp32, constant learning rate: the first 10 steps of the FSDP run
# are the same steps). Plus the up-front refusals of bad LoRA options.
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, coerce_config, finetune, validate_config

from helpers.hf import build_model_folder, chat_records, write_jsonl
from helpers.shared_launch import init_process_group

STEPS, PARITY_STEPS = 20, 10


def lora_facts(module):
    """after_fit hook (every rank): what the trained model holds, gathered where it is sharded."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise.adapters.lora import base_weight_name

    strategy = module.trainer.strategy
    optimizer = module.trainer.optimizers[0]
    # DeepSpeed's ZeRO optimizer steps flat fp32 copies; fp16_groups lists the model parameters they stand for.
    groups = getattr(optimizer, "fp16_groups", None) or [g["params"] for g in optimizer.param_groups]
    held = {id(p) for group in groups for p in group}
    params = dict(module.model.named_parameters())
    facts = {
        "frozen_with_grad": [n for n, p in params.items() if not p.requires_grad and p.grad is not None],
        "frozen_in_optimizer": [n for n, p in params.items() if not p.requires_grad and id(p) in held],
        "trainable_not_in_optimizer": [n for n, p in params.items() if p.requires_grad and id(p) not in held],
        "optimizer_state": len(optimizer.state) if groups is not getattr(optimizer, "fp16_groups", None) else None,
        "dtensors": sum(isinstance(p, DTensor) for p in params.values()),
        # One FSDP unit (a decoder layer) holding frozen and trainable parameters.
        "mixed_unit": {p.requires_grad for n, p in params.items() if ".layers.0." in n} == {True, False},
    }
    if type(strategy).__name__ == "FSDPStrategy":
        base = {}
        for name, p in params.items():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            key = base_weight_name(name.replace("_checkpoint_wrapped_module.", ""))
            if key is not None:
                base[key] = full.detach().clone()
        facts["base"] = base
    return facts if dist.get_rank() == 0 else None


def _runs(model_dir, data, root, steps=STEPS, parity_steps=PARITY_STEPS):

    # One process group for the three runs: a strategy that created it would leave it at its teardown.
    init_process_group()  # not dist.init_process_group: see its docstring
    base = FinetuneConfig(
        model_path=model_dir,
        max_steps=steps,
        learning_rate=2e-2,
        lr_scheduler_type="constant",
        precision="32-true",
        gradient_checkpointing=True,
        devices=2,
        strategy="fsdp",
        logging_steps=100,
        seed=5,
        lora_r=8,
        lora_alpha=16,
        lora_target_modules=["all-linear"],
        data=DataOptions(
            dataset=data,
            max_seq_len=64,
            packing=True,
            per_device_train_batch_size=2,
            eval_split_ratio=0.0,
            cache_dir=os.path.join(root, "cache"),
        ),
    )
    out = {"fsdp": finetune(dataclasses.replace(base, output_dir=os.path.join(root, "fsdp")), after_fit=lora_facts)}
    for strategy in ("ddp", "deepspeed_stage_3"):
        cfg = dataclasses.replace(
            base,
            strategy=strategy,
            max_steps=parity_steps,
            gradient_checkpointing=strategy != "ddp",
            output_dir=os.path.join(root, strategy),
        )
        out[strategy] = finetune(cfg, after_fit=lora_facts)
    return out


def _assets(root):
    records = chat_records(160)
    model_dir = build_model_folder(str(root / "tiny-llama"), records)
    data = write_jsonl(str(root / "chat.jsonl"), records)
    return model_dir, data, root


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    model_dir, data, root = assets = _assets(root)
    return assets, _runs, (model_dir, data, str(root))


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A model and data of their own, for the tests that train nothing."""
    return _assets(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def launched(recipe_runs):
    """(assets, rank 0's runs): this file's runs, in the recipe files' shared 2-process launch."""
    assets, ranks = recipe_runs[__name__]
    return assets, ranks[0]


@pytest.fixture(scope="module")
def runs(launched):
    return launched[1]


@pytest.mark.slow
def test_lora_under_fsdp_trains_only_the_adapters(launched):
    from safetensors.torch import load_file

    assets, runs = launched
    result = runs["fsdp"]
    losses = [s["loss"] for s in result.losses]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses  # random base weights: the adapters learn slowly
    counts = result.parameters
    assert 0 < counts["trainable"] < 0.2 * counts["total"], counts
    # r * (in + out) for every linear layer of the decoder (all-linear leaves lm_head out).
    hidden, inter, kv, layers, r = 64, 128, 32, 2, 8
    per_layer = r * ((64 + 64) * 2 + (64 + kv) * 2 + (hidden + inter) * 3)
    assert counts["trainable"] == layers * per_layer
    facts = result.extra
    assert facts["dtensors"] > 0 and facts["mixed_unit"]
    assert facts["frozen_with_grad"] == [] and facts["frozen_in_optimizer"] == []
    assert facts["trainable_not_in_optimizer"] == []
    assert facts["optimizer_state"] == 2 * layers * 7  # lora_A and lora_B of 7 linear layers per decoder layer
    # The frozen base weights are exactly the checkpoint's after 20 steps.
    reference = load_file(os.path.join(assets[0], "model.safetensors"))
    assert set(facts["base"]) == set(reference)
    for key, value in reference.items():
        assert torch.equal(facts["base"][key], value), key


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_3"])
def test_lora_ddp_and_zero3_agree_with_fsdp(runs, strategy):
    fsdp = [s["loss"] for s in runs["fsdp"].losses][:PARITY_STEPS]
    other = [s["loss"] for s in runs[strategy].losses]
    assert len(other) == PARITY_STEPS
    assert other == pytest.approx(fsdp, abs=1e-4), (strategy, fsdp, other)
    assert runs[strategy].parameters == runs["fsdp"].parameters
    facts = runs[strategy].extra
    assert facts["frozen_with_grad"] == [] and facts["frozen_in_optimizer"] == []
    assert facts["trainable_not_in_optimizer"] == []


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lora_r": -1}, "lora_r=-1"),
        ({"lora_r": 8, "lora_alpha": 0}, "lora_alpha=0"),
        ({"lora_r": 8, "lora_dropout": 1.0}, "lora_dropout=1.0"),
        ({"lora_r": 8, "lora_target_modules": ["q_proj", "qkv_proj"]}, r"\['qkv_proj'\] match no module"),
        ({"lora_r": 0, "lora_target_modules": ["q_proj"]}, "lora_target_modules set but lora_r=0"),
    ],
)
def test_bad_lora_options_are_refused_up_front(assets, options, message):
    model_dir, data, root = assets
    cfg = coerce_config(
        dict(model_path=model_dir, dataset=data, max_seq_len=64, output_dir=str(root / "never"), **options)
    )
    with pytest.raises(ValueError, match=message) as info:
        validate_config(cfg)
    if "match no module" in message:
        assert "q_proj, up_proj, v_proj" in str(info.value)  # the names that do exist
