# The recipe's training loss is the chunked cross-entropy (losses.py), which keeps no float32 copy of the
# logits. It must train exactly as the plain float32 loss it replaced: the same losses, step by step,
# on packed blocks large enough to take several chunks.
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise.recipes.causal_lm import CausalLMModule
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, finetune

from helpers.hf import build_model_folder, chat_records, write_jsonl


def _float32_summed_loss(self, batch, router=False):
    """The recipe's loss before the chunked one: F.cross_entropy on a float32 copy of the whole logits
    (a dense model: no router losses to add)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    logits = self.model(**inputs, use_cache=False).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )


@pytest.mark.slow
def test_chunked_loss_trains_as_the_float32_loss(tmp_path, monkeypatch):
    records = chat_records(60)
    model_dir = build_model_folder(str(tmp_path / "m"), records, vocab_pad=500)
    data = DataOptions(
        dataset=write_jsonl(str(tmp_path / "chat.jsonl"), records),
        max_seq_len=64,
        per_device_train_batch_size=4,  # 4 x 64 rows of logits: two chunks of the loss's 128
        eval_split_ratio=0.0,
        cache_dir=str(tmp_path / "cache"),
    )

    def run(name):
        cfg = FinetuneConfig(
            model_path=model_dir,
            data=data,
            max_steps=3,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            precision="32-true",
            strategy="single",
            devices=1,
            logging_steps=1,
            output_dir=str(tmp_path / name),
        )
        return [s["loss"] for s in finetune(cfg).losses]

    chunked = run("chunked")
    monkeypatch.setattr(CausalLMModule, "_summed_loss", _float32_summed_loss)
    reference = run("float32")
    assert len(chunked) == 3 and chunked[-1] < chunked[0]
    assert chunked == pytest.approx(reference, rel=1e-6, abs=1e-6)


def test_summed_loss_matches_float32_loss_and_gradient_on_a_packed_batch(tmp_path):
    from transformers import AutoModelForCausalLM

    from shardwise.recipes import hf_model

    model_dir = build_model_folder(str(tmp_path / "m"), chat_records(20), vocab_pad=300)
    module = CausalLMModule(FinetuneConfig(model_path=model_dir), hf_model.inspect_model_folder(model_dir), 1)
    module.model = AutoModelForCausalLM.from_pretrained(model_dir)
    # Two documents per row (position ids restart), padding labels ignored, 3 x 50 rows: two chunks.
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (3, 50), generator=generator)
    positions = torch.cat([torch.arange(20), torch.arange(30)]).expand(3, 50)
    labels = ids.clone()
    labels[:, 20] = -100
    labels[2, -7:] = -100
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels}

    def loss_and_grads(fn):
        module.model.zero_grad()
        loss = fn(module, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in module.model.parameters()]

    loss, grads = loss_and_grads(CausalLMModule._summed_loss)
    expected, expected_grads = loss_and_grads(_float32_summed_loss)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for grad, want in zip(grads, expected_grads):  # float32 sums in another order: relative to the largest entry
        assert (grad - want).abs().max() <= 1e-5 * want.abs().max()
