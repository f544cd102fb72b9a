"""Per-rank memory of each strategy, measured as tracked tensor memory (exact, repeatable).

Two processes, fp32 Adam, the seed Transformer with the seed's wrap policy.
The assertions are the seed's claims, checked on this machine: FULL_SHARD's
peak is at most 0.6x DDP's, SHARD_GRAD_OP sits between them (it keeps
parameters gathered from forward to backward), and activation checkpointing
lowers activation memory.
"""

import pytest
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.demos import PythonDocsText

from helpers.lm import LAYERS, LanguageModel, PeakOfSteps

SIZES = dict(nlayers=8, nhid=1024, ninp=128, nhead=4)


def _strategy(name):
    policy = LAYERS | {nn.Embedding}
    return {
        "ddp": "ddp",
        "full": FSDPStrategy(auto_wrap_policy=policy),
        "grad_op": FSDPStrategy(auto_wrap_policy=policy, sharding_strategy="SHARD_GRAD_OP"),
        "no_shard": FSDPStrategy(auto_wrap_policy=policy, sharding_strategy="NO_SHARD"),
        "full_ac": FSDPStrategy(auto_wrap_policy=policy, activation_checkpointing_policy=LAYERS),
    }[name]


def measure(names, batch_size=2, block_size=32):
    data = PythonDocsText(block_size=block_size)
    out = {}
    for name in names:
        shardwise.seed_everything(0)
        probe = PeakOfSteps()
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy(name),
            max_steps=2,
            callbacks=[probe],
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            # Memory only: no FLOP count of the first step (a dispatch mode on every op, a third of a fit here).
            throughput=False,
        )
        trainer.fit(LanguageModel(data.vocab_size, **SIZES), DataLoader(data, batch_size=batch_size))
        out[name] = (probe.peak, probe.breakdown)
    return out


def measure_both():
    # Model states dominate at a small batch (the seed's regime: batch 1, 1B parameters);
    # activations dominate at a larger one, which is where checkpointing pays.
    states = measure(["ddp", "full", "grad_op", "no_shard"], batch_size=2, block_size=32)
    acts = measure(["full", "full_ac"], batch_size=8, block_size=64)
    return states, acts


@pytest.fixture(scope="module")
def measured():
    return shardwise.launch(measure_both, devices=2)[0]


@pytest.fixture(scope="module")
def peaks(measured):
    return measured[0]


def test_full_shard_at_most_0_6_of_ddp(peaks):
    assert peaks["full"][0] <= 0.6 * peaks["ddp"][0], {k: v[0] for k, v in peaks.items()}


def test_shard_grad_op_between_full_shard_and_ddp(peaks):
    assert peaks["full"][0] < peaks["grad_op"][0] < peaks["ddp"][0], {k: v[0] for k, v in peaks.items()}


def test_parameters_gradients_and_optimizer_state_are_halved(peaks):
    ddp, full = peaks["ddp"][1], peaks["full"][1]
    # Sharded across 2 ranks: the optimizer state is exactly half (up to FSDP's padding of uneven dims).
    assert abs(full["optimizer"] - ddp["optimizer"] / 2) <= 0.01 * ddp["optimizer"], (ddp, full)


def test_activation_checkpointing_lowers_activation_memory(measured):
    acts = measured[1]
    assert acts["full_ac"][1]["activations"] < 0.8 * acts["full"][1]["activations"], acts
    assert acts["full_ac"][0] < acts["full"][0], acts


if __name__ == "__main__":  # python tests/distributed/test_memory_ratios.py: print the table
    from shardwise.memory import format_bytes

    for res in shardwise.launch(measure_both, devices=2)[0]:
        first = next(iter(res.values()))[0]
        for name, (peak, b) in res.items():
            print(
                f"{name:10s} {format_bytes(peak):>10s} {peak / first:.2f}x  "
                + " ".join(f"{k}={format_bytes(v)}" for k, v in b.items())
            )
