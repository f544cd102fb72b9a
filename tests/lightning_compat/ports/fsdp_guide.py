# Lightning's FSDP guide, "Train models with billions of parameters using FSDP"
# (docs/source-pytorch/advanced/model_parallel/fsdp.rst, github.com/Lightning-AI/pytorch-lightning, commit
# 7f0c3436cd3f6ad3753125672024fc415cbcb414), Copyright The Lightning AI team, Apache License 2.0
# (http://www.apache.org/licenses/LICENSE-2.0): its "full code example" with the guide's own later steps applied
# as the guide writes them: the model built in configure_model ("Speed up model initialization", its "After"
# code), the layer set of "Identify large layers" as auto_wrap_policy and, as the guide advises, as
# activation_checkpointing_policy too ("Activation checkpointing"). Changed only in its import lines:
# lightning(.pytorch) -> shardwise.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shardwise as L
from shardwise.demos import Transformer, WikiText2
from shardwise.strategies import FSDPStrategy


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.model = None

    def configure_model(self):
        if self.model is not None:
            return
        self.model = Transformer(  # 1B parameters
            vocab_size=self.vocab_size,
            nlayers=32,
            nhid=4096,
            ninp=1024,
            nhead=64,
        )

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


L.seed_everything(42)

# Data
dataset = WikiText2()
train_dataloader = DataLoader(dataset)

# Model
model = LanguageModel(vocab_size=dataset.vocab_size)

# 1. Define a set of layers that FSDP should manage
#    Here we are choosing the large encoder and decoder layers
policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}

# 2. Pass the policy to the FSDPStrategy object
strategy = FSDPStrategy(
    auto_wrap_policy=policy,
    # Enable activation checkpointing on these layers
    activation_checkpointing_policy=policy,
)

# Trainer
trainer = L.Trainer(accelerator="cuda", devices=2, strategy=strategy)
trainer.fit(model, train_dataloader)
trainer.print(torch.cuda.memory_summary())
