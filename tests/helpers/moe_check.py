"""A small mixture-of-experts TrainModule for `shardwise check` (importable by the check's worker processes).

The bundled GPT-MoE (2 blocks of 8 experts, top-2) with its router losses: the loss is the summed
cross-entropy plus the weighted load-balancing and z losses, and `loss_weight` counts the target tokens,
so the Trainer divides by the step's global token count and one process, ep ranks and dp x ep ranks
take the same step from the same global batch.
"""

from __future__ import annotations

import torch

from shardwise import TrainModule
from shardwise.models.gpt_moe import GPTMoE, gpt_moe_config


class TinyMoE(TrainModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            config = gpt_moe_config("gpt-moe-tiny", vocab_size=64, block_size=32, router_z_loss_coef=1e-3)
            self.model = GPTMoE(config)

    def loss_weight(self, batch) -> torch.Tensor:
        return torch.tensor(batch[0][:, 1:].numel())

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model.loss(self.model(tokens[:, :-1]), tokens[:, 1:])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
