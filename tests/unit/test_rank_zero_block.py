"""What the Trainer does around a hook wrapped in rank_zero_only (trainer/hooks.py rank_zero_block): the
mark survives binding, and ZeRO-3 is refused by name before the hook runs (the two-process FSDP case is in
tests/lightning_compat/test_ports.py)."""

import pytest

from shardwise import Callback, Trainer
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.trainer.hooks import rank_zero_block
from shardwise.utilities import rank_zero_only
from shardwise.utilities.rank_zero import RANK_ZERO_MARK


class _Sampler(Callback):
    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module):
        return "ran"

    def on_train_start(self, trainer, pl_module):
        return "ran"


def test_the_mark_is_read_through_the_bound_hook():
    sampler = _Sampler()
    assert getattr(sampler.on_train_epoch_end, RANK_ZERO_MARK, False)
    assert not getattr(sampler.on_train_start, RANK_ZERO_MARK, False)
    assert sampler.on_train_epoch_end(None, None) == "ran"  # one process: rank 0


def test_zero3_refuses_the_hook_by_name():
    trainer = Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=3), logger=False)
    with pytest.raises(RuntimeError, match=r"_Sampler\.on_train_epoch_end is wrapped in rank_zero_only.*ZeRO-3"):
        rank_zero_block(trainer, "_Sampler.on_train_epoch_end")
