# Adapter checkpoints, resume and export (issue 21 item 4), through the fine-tuning recipe.
#
# One launch of 2 processes (shared with other recipe files: tests/recipes/conftest.py; CPU, gloo,
# FSDP FULL_SHARD, LoRA in fp32, activation checkpointing on) runs two
# fits: 4 steps saving a sharded checkpoint every 2 steps and exporting the PEFT adapter folder and the
# merged Hugging Face folder; then a run resumed from its step-2 checkpoint (what a run killed after step 2
# resumes from; the base weights are loaded from the model folder again; a fit of its own, with a process
# group of its own, as in new processes). The checks: the adapter checkpoint is under 5% of the model's
# weights; the resumed run computes steps 3 and 4 (the restored optimizer state and schedule at work) and
# the trained logits bitwise as the uninterrupted run did (the FLOP count of each fit's first step leaves
# its kernels alone, or the resumed run's counted step 3 would round differently); both exports give the trained
# model's logits through PEFT's and transformers' own loaders (the adapter export under activation
# checkpointing once wrote no tensor at all); the checkpoint resumes on 1 process (another world size, the
# same global batch) within 1e-5; a resume onto another base model is refused; `shardwise convert` turns
# the checkpoint into the same adapter folder, and with --base_model into a merged folder; `shardwise
# inspect` names it an adapter.
from __future__ import annotations

import dataclasses
import glob
import json
import os

import pytest
import torch

from shardwise.checkpoint import CheckpointMismatchError
from shardwise.recipes.finetune import coerce_config, finetune

from helpers.hf import build_model_folder, chat_records, write_jsonl

STEPS, SAVE_EVERY = 4, 2
PROBE = torch.tensor([[2, 7, 11, 5, 9, 14, 3, 8]])


def trained_logits(module):
    """after_fit hook (every rank): the trained model's logits on PROBE (rank 0's)."""
    import torch.distributed as dist

    with torch.no_grad(), module.gathered():
        logits = module.model(input_ids=PROBE).logits.detach().clone()
    return logits if dist.get_rank() == 0 else None


def _config(model_dir, data, root, **overrides):
    return coerce_config(
        dict(
            **{
                **dict(
                    model_path=model_dir,
                    dataset=data,
                    max_seq_len=32,
                    max_steps=STEPS,
                    learning_rate=1e-2,
                    lr_scheduler_type="cosine",  # a schedule that moves each step: its state must resume too
                    precision="32-true",
                    per_device_train_batch_size=2,
                    devices=2,
                    strategy="fsdp",
                    eval_split_ratio=0.0,
                    save_steps=SAVE_EVERY,
                    save_total_limit=3,
                    logging_steps=100,
                    seed=3,
                    lora_r=2,
                    lora_alpha=4,
                    lora_dropout=0.0,  # so that 1 process computes what 2 did (dropout would draw per rank)
                    lora_target_modules=["q_proj", "v_proj"],
                    gradient_checkpointing=True,  # the export must see through the checkpoint wrappers
                    merge=True,
                    cache_dir=os.path.join(root, "cache"),
                ),
                **overrides,
            }
        )
    )


def step_checkpoint(output_dir, step):
    found = glob.glob(os.path.join(output_dir, "checkpoints", f"*step={step}*"))
    assert len(found) == 1, os.listdir(os.path.join(output_dir, "checkpoints"))
    return found[0]


def _both(model_dir, data, root):
    """In the launched workers: the uninterrupted run, then a run resumed from its step-2 checkpoint."""
    first = finetune(_config(model_dir, data, root, output_dir=os.path.join(root, "a")), after_fit=trained_logits)
    ckpt = step_checkpoint(os.path.join(root, "a"), SAVE_EVERY)
    cfg = _config(model_dir, data, root, output_dir=os.path.join(root, "b"), resume_from_checkpoint=ckpt, merge=False)
    return first, finetune(cfg, after_fit=trained_logits)


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    records = chat_records(80)
    # Wide enough that a full checkpoint is large beside the adapter's fixed overhead (RNG states, manifest).
    model_dir = build_model_folder(str(root / "base"), records, hidden=256, intermediate=512, layers=3)
    data = write_jsonl(str(root / "chat.jsonl"), records)
    assets = (model_dir, data, str(root))
    return assets, _both, assets


@pytest.fixture(scope="module")
def assets(recipe_runs):
    """This file's runs are in the recipe files' shared 2-process launch: its assets."""
    return recipe_runs[__name__][0]


@pytest.fixture(scope="module")
def runs(recipe_runs):
    return recipe_runs[__name__][1][0]


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _peft_logits(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return PeftModel.from_pretrained(base, adapter_dir).eval()(input_ids=PROBE).logits


def _hf_logits(folder):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=PROBE).logits


@pytest.mark.slow
def test_adapter_checkpoint_is_small_and_resumes(runs, assets):
    from safetensors.torch import load_file

    from shardwise.checkpoint import layout

    model_dir, _, root = assets
    first, resumed = runs
    ckpt = step_checkpoint(os.path.join(root, "a"), SAVE_EVERY)
    manifest = layout.read_manifest(ckpt)
    assert manifest["checkpoint_format"] == "sharded" and manifest["adapter"]["base"]["weight_files"]
    # A full checkpoint holds at least every weight of the model (here in fp32), besides optimizer state.
    full_at_least = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    assert _dir_bytes(ckpt) < 0.05 * full_at_least, (_dir_bytes(ckpt), full_at_least)

    assert [s["step"] for s in first.losses] == list(range(1, STEPS + 1))
    assert [s["step"] for s in resumed.losses] == list(range(1, STEPS + 1))
    assert resumed.losses[:SAVE_EVERY] == first.losses[:SAVE_EVERY]  # from the checkpoint
    # The first step after the resume is bitwise the uninterrupted run's (the restored weights, schedule and
    # data position); the next within float rounding (the restored optimizer state at work; see below).
    assert resumed.losses[SAVE_EVERY] == first.losses[SAVE_EVERY]
    assert [s["loss"] for s in resumed.losses] == pytest.approx([s["loss"] for s in first.losses], rel=1e-6)
    torch.testing.assert_close(resumed.extra, first.extra, atol=1e-5, rtol=0)
    exported = [load_file(os.path.join(root, run, "adapter_model.safetensors")) for run in ("a", "b")]
    assert exported[0].keys() == exported[1].keys() and len(exported[0]) == 3 * 2 * 2  # 3 layers, q and v, A and B
    for key in exported[0]:
        torch.testing.assert_close(exported[0][key], exported[1][key], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_adapter_resume_is_bitwise_at_every_step(runs):
    first, resumed = runs
    assert [s["loss"] for s in resumed.losses] == [s["loss"] for s in first.losses]
    assert torch.equal(resumed.extra, first.extra)


@pytest.mark.slow
def test_adapter_and_merged_exports_reproduce_the_trained_logits(runs, assets):
    model_dir, _, root = assets
    trained = runs[0].extra
    out = os.path.join(root, "a")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    assert not os.path.exists(os.path.join(out, "model.safetensors"))  # LoRA: the adapter, not the base again
    with open(os.path.join(out, "adapter_config.json")) as fh:
        assert json.load(fh)["r"] == 2
    torch.testing.assert_close(_peft_logits(model_dir, out), trained, atol=1e-4, rtol=0)
    torch.testing.assert_close(_hf_logits(os.path.join(out, "merged")), trained, atol=1e-4, rtol=0)
    assert not (_peft_logits(model_dir, out) - _hf_logits(model_dir)).abs().max() < 1e-3  # it did train


@pytest.mark.slow
def test_resume_on_one_process_and_onto_another_base(runs, assets, tmp_path):
    model_dir, data, root = assets
    ckpt = step_checkpoint(os.path.join(root, "a"), SAVE_EVERY)
    one = _config(
        model_dir,
        data,
        root,
        devices=1,
        per_device_train_batch_size=4,  # the same global batch on one process
        save_steps=None,
        merge=False,
        output_dir=str(tmp_path / "one"),
        resume_from_checkpoint=ckpt,
    )
    resumed = finetune(one)
    assert [s["step"] for s in resumed.losses] == list(range(1, STEPS + 1))
    assert resumed.losses[:SAVE_EVERY] == runs[0].losses[:SAVE_EVERY]  # from the checkpoint
    # Another world size: the same samples in each step, summed in another order: close, not bitwise.
    later = [s["loss"] for s in resumed.losses[SAVE_EVERY:]]
    assert later == pytest.approx([s["loss"] for s in runs[0].losses[SAVE_EVERY:]], abs=1e-5)
    other_base = build_model_folder(str(tmp_path / "other"), chat_records(80), hidden=256, intermediate=512, seed=1)
    with pytest.raises(CheckpointMismatchError, match="another base model"):
        finetune(dataclasses.replace(one, model_path=other_base, output_dir=str(tmp_path / "other-out")))


@pytest.mark.slow
def test_convert_and_inspect_an_adapter_checkpoint(runs, assets, tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint.inspect import describe, render
    from shardwise.recipes.convert import convert

    model_dir, _, root = assets
    ckpt = step_checkpoint(os.path.join(root, "a"), STEPS)
    summary = describe(ckpt)
    text = render(summary)
    assert summary["ok"] and "adapter" in text and "LoRA" in text, text
    adapter_dir = str(tmp_path / "adapter")
    convert(ckpt, adapter_dir, quiet=True)
    exported = load_file(os.path.join(root, "a", "adapter_model.safetensors"))
    converted = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    assert converted.keys() == exported.keys()
    assert all(torch.equal(converted[k], exported[k]) for k in exported)
    torch.testing.assert_close(_peft_logits(model_dir, adapter_dir), runs[0].extra, atol=1e-4, rtol=0)
    merged_dir = str(tmp_path / "merged")
    convert(ckpt, merged_dir, base_model=model_dir, quiet=True)
    torch.testing.assert_close(_hf_logits(merged_dir), runs[0].extra, atol=1e-4, rtol=0)
