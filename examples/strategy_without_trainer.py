"""The low-level layer: a hand-written loop driven by a strategy, without the Trainer.

This is what Lightning users know as Fabric: the strategy sets up processes,
builds the model on the meta device, shards and initialises it, and owns
backward, gradient sync during accumulation, clipping and the optimizer step
-- the loop itself stays yours.

    python examples/strategy_without_trainer.py            # FSDP on 2 local processes
    python examples/strategy_without_trainer.py ddp
"""

import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import shardwise
from shardwise.models import GPT, Block, gpt_config


def train(strategy_name: str = "fsdp", steps: int = 12, accumulate: int = 2) -> list:
    shardwise.seed_everything(0)
    if strategy_name == "fsdp":
        strategy = shardwise.FSDPStrategy(auto_wrap_policy={Block}, precision="32-true")
    else:
        strategy = shardwise.build_strategy(strategy_name)
    strategy.setup_environment()  # joins the process group shardwise.launch / torchrun created

    config = gpt_config("gpt-tiny")
    with strategy.module_init_context():  # meta device: nothing allocated yet
        model = GPT(config)
    model = strategy.setup_module(model)  # shard, then materialise and initialise
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    tokens = torch.randint(
        0, config.vocab_size, (256, config.block_size + 1), generator=torch.Generator().manual_seed(0)
    )
    loader = strategy.setup_dataloader(DataLoader(tokens, batch_size=4, shuffle=True))
    losses = []
    for i, batch in enumerate(loader):
        if len(losses) == steps:
            break
        # The loader yields CPU tensors; the model is on strategy.root_device (a GPU under NCCL).
        # move_to_device also handles dicts, Hugging Face's BatchEncoding, namedtuples and dataclasses.
        batch = shardwise.move_to_device(batch, strategy.root_device)
        last = (i + 1) % accumulate == 0
        # Under FSDP, non-final micro-batches still reduce-scatter (gradients stay sharded) and only
        # defer what can wait (FSDPStrategy's accumulation_sync); DDP skips its all-reduce.
        with strategy.no_backward_sync(model, enabled=not last):
            with strategy.autocast():
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            strategy.backward(loss / accumulate, model)
        if last:
            strategy.clip_gradients(model, optimizer, max_norm=1.0)
            strategy.optimizer_step(optimizer)
            optimizer.zero_grad()
            losses.append(float(strategy.reduce(loss.detach(), "mean")))
            if strategy.is_global_zero:
                print(f"step {len(losses)}: loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    shardwise.launch(train, name, devices=2)
