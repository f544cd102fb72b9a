# `shardwise finetune` trains as TRL's SFTTrainer does: the same tiny model, chat data and settings
# (unpacked, defaults for the data: no EOS after the chat template, nothing held out), full and LoRA with the
# same adapter init, give the same loss at every step, within 1e-6 relative. Each batch holds the whole data
# set, so the two data orders (each library shuffles its own way) give the same batches.
from __future__ import annotations

import pytest
import torch

from shardwise.recipes import data as D
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune

from helpers.hf import build_model_folder, chat_records, write_jsonl

trl = pytest.importorskip("trl")

STEPS, LR, RECORDS = 3, 1e-2, 8


def _setup(root):
    from transformers import AutoTokenizer

    records = chat_records(RECORDS, seed=11)
    model = build_model_folder(str(root / "m"), records, vocab_pad=2)
    tok = AutoTokenizer.from_pretrained(model)
    D.apply_chatml(tok)  # a chat template both sides apply; its markers take the two spare rows
    tok.save_pretrained(model)
    return root, model, write_jsonl(str(root / "chat.jsonl"), [{"messages": r["messages"]} for r in records])


@pytest.fixture(scope="module")
def setup(recipe_runs):
    """The model and data of the 2-process runs in the recipe files' shared launch (tests/recipes/conftest.py):
    TRL's losses, computed once, are compared with every run here."""
    return recipe_runs[__name__][0]


def our_config(setup, name, lora_r=0, devices=1):
    root, model, data = setup
    return FinetuneConfig(
        model_path=model,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        precision="32-true",
        strategy="single" if devices == 1 else "fsdp",
        devices=devices,
        logging_steps=1,
        seed=0,
        **({"lora_r": lora_r, "lora_alpha": 8} if lora_r else {}),
        output_dir=str(root / name),
        data=DataOptions(
            dataset=data,
            max_seq_len=128,
            packing=False,
            per_device_train_batch_size=RECORDS // devices,  # the whole data set per step either way
            cache_dir=str(root / "c"),
        ),
    )


def ours(setup, name, lora_r=0):
    return [s["loss"] for s in finetune(our_config(setup, name, lora_r)).losses]


def both_under_fsdp(configs):
    """One rank of one 2-process launch: the full and the LoRA run, one after the other."""
    return [[s["loss"] for s in finetune(cfg).losses] for cfg in configs]


def theirs(setup, name, lora_r=0):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir, data = setup
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora_r:
        from peft import LoraConfig, get_peft_model

        from shardwise.adapters.lora import init_lora_weights

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=lora_r, lora_alpha=8, lora_dropout=0.0))
        init_lora_weights(model, 0)  # the adapter init the recipe draws with seed 0
    losses = []

    class Recording(trl.SFTTrainer):
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    args = trl.SFTConfig(
        output_dir=str(root / name),
        max_steps=STEPS,
        per_device_train_batch_size=RECORDS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        packing=False,
        max_length=128,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        dataloader_num_workers=0,
    )
    dataset = datasets.load_dataset("json", data_files=data, split="train", cache_dir=str(root / "hf"))
    Recording(
        model=model, args=args, train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(model_dir)
    ).train()
    return losses


TRL_LOSSES = {}


def trl_losses(setup, lora_r):
    if lora_r not in TRL_LOSSES:
        TRL_LOSSES[lora_r] = theirs(setup, f"trl-{lora_r}", lora_r)
    return TRL_LOSSES[lora_r]


def assert_same(mine, reference):
    assert len(mine) == len(reference) == STEPS
    assert mine[-1] < mine[0]  # it trains
    for a, b in zip(mine, reference):
        assert abs(a - b) <= 1e-6 * abs(b), (mine, reference)


@pytest.mark.parametrize("lora_r", [0, 4], ids=["full", "lora"])
def test_losses_equal_trl_sft_trainer(setup, lora_r):
    assert_same(ours(setup, f"ours-{lora_r}", lora_r), trl_losses(setup, lora_r))


def shared_launch(root):
    """For tests/recipes/conftest.py: the assets, and the worker that trains on them with its arguments."""
    setup = _setup(root)
    return setup, both_under_fsdp, ([our_config(setup, f"fsdp-{r}", r, devices=2) for r in (0, 4)],)


@pytest.mark.slow
def test_two_fsdp_processes_take_trls_steps(setup, recipe_runs):
    full, lora = recipe_runs[__name__][1][0]
    assert_same(full, trl_losses(setup, 0))
    assert_same(lora, trl_losses(setup, 4))
