"""A Hugging Face collator's batch reaches the GPU; the planner's device_memory="auto" against CUDA's allocator.

- DataCollatorWithPadding yields a BatchEncoding (a UserDict): the Trainer
  and `shardwise.move_to_device` put every tensor in it on the GPU, keeping
  its type;
- `Trainer(device_memory="auto")` reads the GPU's memory; the planner's
  predicted reserved memory for a single-device run is compared with
  `torch.cuda.max_memory_reserved()` of that run (a smoke bound: within 2x
  either way; the printed figures are the real result).
"""

import pytest
import torch
import torch.nn.functional as F
from gpu_common import DEVICE_TYPE, TinyGPT, gpu_trainer, skip_without_gpu, token_data
from torch import nn
from torch.utils.data import DataLoader

import shardwise

from helpers.hf import build_tokenizer

skip_without_gpu()
pytestmark = pytest.mark.gpu


class TokenModel(shardwise.TrainModule):
    """Checks where the collated batch landed, then trains a bag-of-embeddings classifier on it."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.seen = []

    def configure_model(self):
        self.embed = nn.Embedding(self.vocab, 16)
        self.head = nn.Linear(16, 2)

    def training_step(self, batch):
        self.seen.append((type(batch).__name__, sorted({v.device.type for v in batch.values()})))
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1)
        return F.cross_entropy(self.head(pooled), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_collator_batch_is_moved_to_the_gpu_with_its_type():
    from transformers import DataCollatorWithPadding

    texts = ["what colour is the sky ?", "the sea is blue .", "are you sure ?", "yes , the sun is yellow ."]
    tokenizer = build_tokenizer(texts)
    rows = [{**tokenizer(t), "labels": i % 2} for i, t in enumerate(texts)]
    collate = DataCollatorWithPadding(tokenizer)
    batch = collate(rows[:2])
    moved = shardwise.move_to_device(batch, torch.device(DEVICE_TYPE, 0) if DEVICE_TYPE == "cuda" else "cpu")
    assert type(moved) is type(batch) and {v.device.type for v in moved.values()} == {DEVICE_TYPE}

    module = TokenModel(len(tokenizer))
    trainer = gpu_trainer(devices=1, strategy="single", max_steps=2)
    trainer.fit(module, DataLoader(rows, batch_size=2, collate_fn=collate))
    assert module.seen and all(seen == ("BatchEncoding", [DEVICE_TYPE]) for seen in module.seen), module.seen


def test_planner_device_memory_auto_against_max_memory_reserved():
    if DEVICE_TYPE != "cuda":
        pytest.skip("device_memory='auto' and max_memory_reserved are CUDA's")
    from shardwise.plan.advice import auto_device_budget, resolve_device_memory

    total = resolve_device_memory("auto", "cuda")
    device_total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    assert total == auto_device_budget(device_total, 1)[0] < device_total
    free, _ = torch.cuda.mem_get_info()  # after this process's context: the budget must fit in it
    assert total <= free + torch.cuda.memory_reserved(), (total, free)
    loader = DataLoader(token_data(), batch_size=8)
    batch = next(iter(loader))
    # The planner's GPU names size its cuBLAS workspaces (32 MiB each on Hopper, 8 MiB before).
    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in ("h200", "h100") if g in name), "a100")
    plan = shardwise.plan(
        TinyGPT(),
        example_batch=batch,
        batch_size=8,
        devices=1,
        gpu=gpu,
        device_memory=total,
        precision="bf16-mixed",
        candidates=["ddp"],
        workers=1,
    )
    predicted = plan.estimates[0]

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    shardwise.seed_everything(0)
    trainer = gpu_trainer(devices=1, strategy="auto", precision="bf16-mixed", max_steps=4, device_memory="auto")
    trainer.fit(TinyGPT(), loader)
    measured = torch.cuda.max_memory_reserved()
    print(
        f"planner: allocated {predicted.allocated / 2**20:.1f} MiB, reserved {predicted.reserved / 2**20:.1f} MiB; "
        f"measured max_memory_reserved {measured / 2**20:.1f} MiB, max_memory_allocated "
        f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB of {total / 2**30:.1f} GiB"
    )
    assert predicted.fits and measured <= total
    assert 0.5 <= predicted.reserved / measured <= 2.0, (predicted.reserved, measured)
