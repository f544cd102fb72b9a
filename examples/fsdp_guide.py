"""The FSDP guide's language model, with each of the guide's recipes one flag away.

    python examples/fsdp_guide.py                      # strategy="fsdp", 2 processes
    python examples/fsdp_guide.py --recipe wrap        # auto_wrap_policy={encoder, decoder layers}
    python examples/fsdp_guide.py --recipe grad_op     # sharding_strategy="SHARD_GRAD_OP"
    python examples/fsdp_guide.py --recipe no_shard    # sharding_strategy="NO_SHARD"
    python examples/fsdp_guide.py --recipe ac          # + activation_checkpointing_policy
    python examples/fsdp_guide.py --recipe offload     # + cpu_offload=True (a no-op warning on CPU)
    python examples/fsdp_guide.py --recipe manual      # shardwise.wrap() inside configure_model
    python examples/fsdp_guide.py --recipe foreach     # optimizer with foreach=False
    python examples/fsdp_guide.py --recipe ddp         # the baseline the guide compares against

The seed's sizes are `--size 1b` (32 layers) and `--size 2b` (64 layers); the
default `--size tiny` runs in seconds on a laptop CPU. Each run ends by printing
the peak tracked tensor memory per rank, as the guide prints
torch.cuda.max_memory_allocated().
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.callbacks import DeviceStatsMonitor
from shardwise.demos import load_text_dataset
from shardwise.models import Transformer

SIZES = {
    "tiny": dict(nlayers=2, nhid=256, ninp=64, nhead=4),
    "1b": dict(nlayers=32, nhid=4096, ninp=1024, nhead=64),
    "2b": dict(nlayers=64, nhid=4096, ninp=1024, nhead=64),
}
LAYERS = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


class LanguageModel(TrainModule):
    def __init__(self, vocab_size, size="tiny", manual_wrap=False, foreach=None):
        super().__init__()
        self.vocab_size, self.size, self.manual_wrap, self.foreach = vocab_size, size, manual_wrap, foreach
        self.model = None

    def configure_model(self):
        if self.model is not None:  # idempotent
            return
        # Under FSDP this runs on the meta device: nothing is allocated until sharded.
        self.model = Transformer(vocab_size=self.vocab_size, **SIZES[self.size])
        if self.manual_wrap:
            # Each layer becomes its own FSDP unit; a no-op under DDP or one device.
            for layers in (self.model.encoder_layers, self.model.decoder_layers):
                for i, layer in enumerate(layers):
                    layers[i] = shardwise.wrap(layer)

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, foreach=self.foreach)


def strategy_for(recipe):
    return {
        "default": "fsdp",
        "ddp": "ddp",
        "wrap": FSDPStrategy(auto_wrap_policy=LAYERS),
        "grad_op": FSDPStrategy(auto_wrap_policy=LAYERS, sharding_strategy="SHARD_GRAD_OP"),
        "no_shard": FSDPStrategy(auto_wrap_policy=LAYERS, sharding_strategy="NO_SHARD"),
        "ac": FSDPStrategy(auto_wrap_policy=LAYERS, activation_checkpointing_policy=LAYERS),
        "offload": FSDPStrategy(auto_wrap_policy=LAYERS, activation_checkpointing_policy=LAYERS, cpu_offload=True),
        "manual": "fsdp",
        "foreach": FSDPStrategy(auto_wrap_policy=LAYERS),
    }[recipe]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe",
        default="default",
        choices=["default", "ddp", "wrap", "grad_op", "no_shard", "ac", "offload", "manual", "foreach"],
    )
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--data-dir", default=None, help="a local WikiText-2 folder (default: bundled text)")
    args = parser.parse_args()

    shardwise.seed_everything(42)
    dataset = load_text_dataset(args.data_dir)
    train_dataloader = DataLoader(dataset, batch_size=8)
    model = LanguageModel(
        dataset.vocab_size,
        size=args.size,
        manual_wrap=args.recipe == "manual",
        foreach=False if args.recipe == "foreach" else None,
    )
    trainer = Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy=strategy_for(args.recipe),
        max_steps=args.max_steps,
        callbacks=[DeviceStatsMonitor()],
        enable_checkpointing=False,
    )
    trainer.fit(model, train_dataloader)
    trainer.print(
        f"Memory used: {shardwise.max_memory_allocated() / 1e6:.02f} MB per rank "
        f"({args.recipe}, {trainer.global_step} steps)"
    )


if __name__ == "__main__":
    main()
