"""Seed 001, the Lightning FSDP guide: its example and every knob it shows, in two CPU processes.

Changed: imports (lightning -> shardwise), the 1B Transformer -> tiny, accelerator="cuda" -> "cpu",
precision=16 -> "bf16-mixed" (fp16 is CUDA-only), devices=4 -> 2, one epoch instead of the
default 1000, torch.cuda.memory_summary() -> shardwise.max_memory_allocated() (CUDA's allocator
report raises on a CPU build), and the data folder. To keep the run short, knobs the guide shows
one per snippet are combined into fewer Trainers; every one of them still runs.
"""

from __future__ import annotations

import math
import os
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shardwise

from helpers.seeds import write_wikitext

TINY = dict(nlayers=2, nhid=64, ninp=32, nhead=4)  # the guide: nlayers=32, nhid=4096, ninp=1024, nhead=64
ONE_EPOCH = dict(max_epochs=1)


def _run(data_dir: str) -> dict:
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, wrap

    import shardwise as L
    from shardwise.demos import Transformer, WikiText2  # lightning.pytorch.demos
    from shardwise.strategies import FSDPStrategy  # lightning.pytorch.strategies.FSDPStrategy

    out: dict = {}

    class LanguageModel(L.TrainModule):
        def __init__(self, vocab_size, foreach=None):
            super().__init__()
            self.model = Transformer(  # 1B parameters
                vocab_size=vocab_size, **TINY
            )
            self.foreach = foreach

        def training_step(self, batch):
            input, target = batch
            output = self.model(input, target)
            loss = F.nll_loss(output, target.view(-1))
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            if self.foreach is False:  # "Disable foreach in the optimizer"
                return torch.optim.AdamW(self.model.parameters(), foreach=False)
            return torch.optim.Adam(self.parameters(), lr=0.1)

    class Record:
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(round(float(outputs.detach() if torch.is_tensor(outputs) else outputs["loss"]), 4))

    def fit(strategy, model_cls=LanguageModel, ckpt_path=None, save=None, **kw):
        L.seed_everything(42)
        dataset = WikiText2(data_dir)
        train_dataloader = DataLoader(dataset)
        model = model_cls(vocab_size=dataset.vocab_size, **kw)
        record = Record()
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=[record], **ONE_EPOCH)
        trainer.fit(model, train_dataloader, ckpt_path=ckpt_path)
        trainer.print(f"peak tracked memory: {shardwise.max_memory_allocated() / 2**20:.1f} MiB")
        if save:
            trainer.save_checkpoint(save)
        return record.losses

    # "Enable FSDP in Trainer" and the full example
    out["fsdp"] = fit("fsdp")
    out["FSDPStrategy()"] = fit(FSDPStrategy())
    # "Identify large layers": a set of classes, then an FSDP1-style function policy
    policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    # "Optimize the sharding strategy" (here torch's enum), "Limit all-gathers", foreach=False
    out["policy+SHARD_GRAD_OP+limit"] = fit(
        FSDPStrategy(auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, limit_all_gathers=True)
    )
    out["foreach=False"] = fit(FSDPStrategy(auto_wrap_policy=policy), foreach=False)
    size_policy = partial(size_based_auto_wrap_policy, min_num_params=1000)  # 10000: scaled with the model
    # "Activation checkpointing", HYBRID_SHARD (one node), a full checkpoint
    os.makedirs("path/to/checkpoint", exist_ok=True)
    out["size_policy+HYBRID+ac"] = fit(
        FSDPStrategy(
            auto_wrap_policy=size_policy,
            sharding_strategy="HYBRID_SHARD",
            activation_checkpointing_policy=policy,
            state_dict_type="full",
        ),
        save="path/to/checkpoint/file",
    )
    # "Offload parameters to CPU", NO_SHARD, a sharded checkpoint
    out["offload+NO_SHARD"] = fit(
        FSDPStrategy(cpu_offload=True, sharding_strategy="NO_SHARD", state_dict_type="sharded"),
        save="path/to/checkpoint/sharded",
    )
    # "Load a checkpoint": either format, recognised by the Trainer
    out["resume_full"] = fit(FSDPStrategy(state_dict_type="sharded"), ckpt_path="path/to/checkpoint/file")
    out["resume_sharded"] = fit(FSDPStrategy(), ckpt_path="path/to/checkpoint/sharded")

    # "Speed up model initialization": configure_model, idempotent
    class LazyLanguageModel(LanguageModel):
        def __init__(self, vocab_size):
            L.TrainModule.__init__(self)
            self.vocab_size = vocab_size
            self.model = None
            self.foreach = None

        def configure_model(self):
            if self.model is not None:
                return
            self.model = Transformer(  # 1B parameters
                vocab_size=self.vocab_size, **TINY
            )

    out["configure_model"] = fit(FSDPStrategy(auto_wrap_policy=policy), model_cls=LazyLanguageModel)

    # "Manual wrapping" with torch's `wrap`
    class MyModel(L.TrainModule):
        def configure_model(self):
            self.linear_layer = nn.Linear(32, 32)
            self.block = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

            # Modules get sharded across processes as soon as they are wrapped with `wrap`.
            linear_layer = wrap(self.linear_layer)
            for i, layer in enumerate(self.block):
                self.block[i] = wrap(layer)

            self.model = nn.Sequential(linear_layer, nn.ReLU(), self.block)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters())

        # The guide's snippet stops here; a step and data so that fit() has something to do:
        def training_step(self, batch):
            return self.model(batch).pow(2).mean()

        def train_dataloader(self):
            return DataLoader(torch.randn(8, 32), batch_size=2)

    model = MyModel()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp", precision="bf16-mixed", **ONE_EPOCH)
    trainer.fit(model)
    out["manual_units"] = list(trainer.strategy.units)
    return out


@pytest.mark.slow
def test_seed_001_fsdp_guide(in_tmp):
    data_dir = write_wikitext(str(in_tmp / "wikitext-2"))
    out = shardwise.launch(_run, data_dir, devices=2)[0]
    base = out["fsdp"]
    assert base and all(math.isfinite(x) for x in base)
    # Wrapping, sharding strategy (enum or string, HYBRID_SHARD on one node, NO_SHARD), activation
    # checkpointing and offload change memory and speed, not the losses.
    for name in ("FSDPStrategy()", "policy+SHARD_GRAD_OP+limit", "size_policy+HYBRID+ac", "offload+NO_SHARD"):
        assert out[name] == pytest.approx(base, abs=2e-3), name
    assert out["foreach=False"] and all(math.isfinite(x) for x in out["foreach=False"])
    # Resuming a finished epoch from either checkpoint format trains no further batch.
    assert out["resume_full"] == [] and out["resume_sharded"] == []
    assert out["configure_model"] and all(math.isfinite(x) for x in out["configure_model"])
    assert len(out["manual_units"]) == 3, out["manual_units"]  # linear_layer + the two block layers
