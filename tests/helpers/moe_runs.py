"""The GPT-MoE runs test_expert_parallel.py compares, importable without pytest (checkpoint_kill_script.py runs
the dp 2 x ep 2 one as a script of 4 workers and kills it; a script importing pytest may not self-launch).

A tiny GPT-MoE (8 experts, top-2, 2 blocks) trained in fp32 with SGD, gradient clipping and accumulation 2 on a
global batch of 8 sequences, returning the summed cross-entropy plus the router losses with `loss_weight`
counting the target tokens; `train` runs it on 1 process or under FSDP at a given ep degree.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.models import Block
from shardwise.models.gpt_moe import GPTMoE, gpt_moe_config

from helpers.lm import token_data

STEPS, GLOBAL_BATCH, ACCUMULATE, SEQ = 4, 8, 2, 16
SAVE_AT = 2


class TinyMoE(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPTMoE(
                gpt_moe_config(
                    "gpt-moe-tiny", vocab_size=64, block_size=32, router_aux_loss_coef=0.1, router_z_loss_coef=1e-3
                )
            )

    def loss_weight(self, batch) -> torch.Tensor:
        return torch.tensor(batch[0][:, 1:].numel())

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return self.model.loss(logits, tokens[:, 1:])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record:
    """Callback: each optimizer step's logged global loss, and the model's per-expert counts of the run."""

    def __init__(self) -> None:
        self.losses: List[float] = []
        self.counts: List[torch.Tensor] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_last_microbatch:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
            self.counts.append(module.model.expert_load.pop())


def data() -> TensorDataset:
    return token_data(STEPS * GLOBAL_BATCH, seq=SEQ + 1, vocab=64, seed=3)


def full_weights(module: TrainModule) -> Dict[str, torch.Tensor]:
    return {  # named as without activation checkpointing's wrapper
        n.replace("_checkpoint_wrapped_module.", ""): (p.full_tensor() if hasattr(p, "full_tensor") else p)
        .detach()
        .clone()
        for n, p in module.named_parameters()
    }


def train(
    devices: int,
    ep: int,
    root: str = "",
    save: bool = False,
    ckpt_path: Any = None,
    ac: bool = False,
    callbacks: Sequence[Any] = (),
    sp: int = 1,
) -> Dict[str, Any]:
    """One run; `save` checkpoints every SAVE_AT steps into root/checkpoints, where ckpt_path="last" looks.
    `sp`: Ulysses sequence parallel degree (its ranks read the same samples, so fewer samples per rank)."""
    shardwise.seed_everything(7)
    record = Record()
    every: List[Any] = [record, *callbacks]
    if save:
        every.append(ModelCheckpoint(every_n_train_steps=SAVE_AT, save_top_k=-1))
    checkpointed = {Block} if ac else None
    strategy = (
        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy=checkpointed, ep_size=ep, sp_size=sp)
        if devices > 1
        else "single"
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,  # the experts' gradients sit on a mesh of their own: one global norm across both
        callbacks=every,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=save,
        default_root_dir=root or None,
    )
    module = TinyMoE()
    per_rank = GLOBAL_BATCH // (devices // sp) // ACCUMULATE
    trainer.fit(module, DataLoader(data(), batch_size=per_rank, shuffle=False), ckpt_path=ckpt_path)
    return {"losses": record.losses, "counts": record.counts, "weights": full_weights(module)}
