"""Selective activation checkpointing computes the same gradients as none and full (issue 12, item 6)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from shardwise.models import GPT, GPTConfig
from shardwise.models.gpt import Block
from shardwise.strategies import FSDPStrategy
from shardwise.strategies.fsdp import apply_activation_checkpointing


def _grads(mode=None, option=None):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=64,
            block_size=16,
            n_layer=4,
            n_head=2,
            n_embd=32,
            norm="rmsnorm",
            mlp="swiglu",
            rope=True,
            bias=False,
            tie_embeddings=False,
        )
    )
    if mode is not None:
        apply_activation_checkpointing(model, {Block}, mode, option)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    wrapped = [isinstance(b, CheckpointWrapper) for b in model.blocks]
    return [p.grad.clone() for p in model.parameters()], wrapped


def test_modes_agree_and_wrap_what_they_say():
    reference, none = _grads()
    assert not any(none)
    for mode, option, expect in (
        ("full", None, [True] * 4),
        ("selective", "op", [True] * 4),
        ("selective", 2, [True, False, True, False]),
    ):
        grads, wrapped = _grads(mode, option)
        assert wrapped == expect, (mode, option)
        for a, b in zip(reference, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_modes_are_named():
    with pytest.raises(ValueError, match="activation_checkpointing_mode='partial'"):
        FSDPStrategy(activation_checkpointing_mode="partial")
    with pytest.raises(ValueError, match="selective_ac_option=0"):
        FSDPStrategy(activation_checkpointing_mode="selective", selective_ac_option=0)
    assert FSDPStrategy(activation_checkpointing_mode="selective", selective_ac_option="3").selective_ac_option == 3
