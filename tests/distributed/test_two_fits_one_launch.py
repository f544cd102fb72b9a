# Two checkpointing fits in the same launched worker processes (2 ranks, FSDP, a checkpoint every 2 steps).
#
# Each fit creates its own default process group on the launcher's store, which outlives both (the
# recipe's strategy.teardown() destroys it after each run). Before every group got a store prefix of its
# own per generation (strategies/base.generation_store),
# the second fit's groups rendezvoused on the first's keys: gloo read the first generation's peer
# addresses and the second fit hung, in init_process_group, its first barrier or the checkpoint group
# (seen in the fine-tuning recipe, whose rank 0 loads the weights first). Here rank 0 starts the second
# fit late, as it does there, so rank 1 reaches the rendezvous first; a watchdog turns a hang into a
# failure after 90 s. The second fit must also compute what the first did (same seed, same data).
from __future__ import annotations

import os

import pytest

HANG_S = 90


def _two_fits(root):
    import faulthandler
    import time

    import torch.distributed as dist

    import shardwise
    from shardwise import FSDPStrategy, Trainer
    from shardwise.callbacks import ModelCheckpoint

    from helpers.checkpoints import Net, full_state, loader

    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang fails the rank (and so the launch)
    out = []
    for run in ("first", "second"):
        if run == "second" and int(os.environ["RANK"]) == 0:
            time.sleep(2.0)  # rank 1 rendezvous first: it would read the first fit's keys
        shardwise.seed_everything(0)
        ckpt = ModelCheckpoint(dirpath=os.path.join(root, run), every_n_train_steps=2, save_top_k=-1)
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(),
            max_steps=4,
            logger=False,
            enable_progress_bar=False,
            default_root_dir=root,
            callbacks=[ckpt],
        )
        trainer.fit(Net(), loader())
        out.append(full_state(trainer))
        trainer.strategy.teardown()  # as the fine-tuning recipe does after each run
        assert not dist.is_initialized()  # the fit's own process group is gone: the next one is new
    faulthandler.cancel_dump_traceback_later()
    return out


@pytest.mark.slow
def test_two_checkpointing_fits_in_one_launch(tmp_path):
    import torch

    import shardwise

    first, second = shardwise.launch(_two_fits, str(tmp_path), devices=2)[0]
    for run in ("first", "second"):
        assert sorted(os.listdir(tmp_path / run)) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], (
            os.listdir(tmp_path / run)
        )
    assert first["step"] == second["step"] == 4
    assert all(torch.equal(first["model"][k], second["model"][k]) for k in first["model"])
