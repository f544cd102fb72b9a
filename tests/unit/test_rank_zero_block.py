"""What the Trainer does around a hook wrapped in rank_zero_only (trainer/hooks.py rank_zero_block): the
mark survives binding, and under DeepSpeed ZeRO-3 a marked hook that runs no forward is called as written
(the two-process FSDP case, forwards and a hook that gathers nothing, is in tests/lightning_compat/test_ports.py)."""

from shardwise import Callback, Trainer
from shardwise.strategies.deepspeed import DeepSpeedStrategy
from shardwise.trainer.hooks import call_callbacks
from shardwise.utilities import rank_zero_only
from shardwise.utilities.rank_zero import RANK_ZERO_MARK


class _Sampler(Callback):
    def __init__(self):
        self.calls = []

    @rank_zero_only
    def on_train_epoch_end(self, trainer, pl_module):
        self.calls.append(type(trainer).__name__)  # prints / logs only: no forward
        return "ran"

    def on_train_start(self, trainer, pl_module):
        return "ran"


def test_the_mark_is_read_through_the_bound_hook():
    sampler = _Sampler()
    assert getattr(sampler.on_train_epoch_end, RANK_ZERO_MARK, False)
    assert not getattr(sampler.on_train_start, RANK_ZERO_MARK, False)
    assert sampler.on_train_epoch_end(None, None) == "ran"  # one process: rank 0


def test_a_marked_hook_without_forward_runs_under_zero3():
    sampler = _Sampler()
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=DeepSpeedStrategy(stage=3),
        logger=False,
        enable_checkpointing=False,
        callbacks=[sampler],
    )
    call_callbacks(trainer, "on_train_epoch_end")
    call_callbacks(trainer, "on_train_epoch_end")
    assert sampler.calls == ["Trainer", "Trainer"]
