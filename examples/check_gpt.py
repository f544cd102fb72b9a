"""A GPT TrainModule to check before it is scaled out: `shardwise check` proves it trains the same on N ranks.

    shardwise check examples/check_gpt.py --strategy fsdp --devices 2 --accumulate_grad_batches 2
    shardwise check examples/check_gpt.py --init_args.preset llama-tiny --strategy deepspeed_stage_3
    python examples/check_gpt.py          # train it for real (2 processes, FSDP)

The module is what a user writes: the model built in configure_model (so
FSDP builds it on the meta device), a mean cross-entropy, AdamW, and its own
train_dataloader() over the Python help texts bundled with CPython. The check
imports this file (the `__main__` block below does not run), builds the
module with the init args given, trains 3 steps on 2 CPU processes and on one
process with the same global batch, and compares. A large preset is checked
at a small size: `--init_args.preset llama-2-7b --init_args.n_layer 2
--init_args.n_embd 256 --init_args.n_head 4`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from shardwise import Trainer, TrainModule
from shardwise.demos import PythonDocsText
from shardwise.models import GPT, gpt_config


class GPTModule(TrainModule):
    def __init__(
        self,
        preset: str = "gpt-tiny",
        n_layer: Optional[int] = None,
        n_embd: Optional[int] = None,
        n_head: Optional[int] = None,
        block_size: int = 32,
        batch_size: int = 4,
        lr: float = 3e-4,
    ) -> None:
        super().__init__()
        self.data = PythonDocsText(block_size=block_size)
        shape = {k: v for k, v in dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head).items() if v is not None}
        if n_head is not None:
            shape["n_kv_head"] = n_head
        self.config = gpt_config(preset, vocab_size=self.data.vocab_size, block_size=block_size, **shape)
        self.batch_size, self.lr = batch_size, lr
        self.model: Optional[GPT] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def training_step(self, batch):
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)


if __name__ == "__main__":
    trainer = Trainer(devices=2, strategy="fsdp", max_steps=20, accelerator="cpu", enable_checkpointing=False)
    trainer.fit(GPTModule())
