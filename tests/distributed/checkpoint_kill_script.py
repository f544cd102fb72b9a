"""A training script the checkpoint tests run as a subprocess and SIGKILL.

`python checkpoint_kill_script.py --strategy ddp --root R --kill-at 7` trains
(self-launching 2 workers for ddp / fsdp), saves a checkpoint every 3 steps
and, at step 7, kills the whole job with SIGKILL: with --kill-mode step right
after that step, with --kill-mode save in the middle of that step's save
(the temporary checkpoint is written, one of its files cut in half, nothing
committed). `--resume` runs fit(ckpt_path="last") to the end, then an
uninterrupted reference run from scratch in the same processes. Rank 0
appends every step's loss (as repr of a float) to R/losses.jsonl as it goes.

`killed_expert_parallel_run` is test_expert_parallel.py's GPT-MoE run under
dp 2 x ep 2 (helpers/moe_runs.py), which that test launches on 4 workers
and whose workers all get SIGKILL after a step; it resumes the run's
checkpoint at ep 2, at ep 1 and on one process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.callbacks import ModelCheckpoint
from shardwise.distributed.context import current as launch_context

SAVE_EVERY = 3


class Net(TrainModule):
    def configure_model(self) -> None:
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.LayerNorm(32),
            nn.GELU(),
            nn.Dropout(0.25),
            nn.Linear(32, 32),
            nn.LayerNorm(32),
            nn.Linear(32, 3),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(60, 8, generator=g), torch.randint(0, 3, (60,), generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)


class Recorder:
    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = path, tag

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as fh:
                fh.write(
                    json.dumps(
                        {
                            "run": self.tag,
                            "step": trainer.global_step,
                            "epoch": trainer.current_epoch,
                            "loss": repr(float(outputs)),
                        }
                    )
                    + "\n"
                )


def kill_job() -> None:
    # Under the self-launcher the parent is the supervisor; its death takes
    # every worker with it (PR_SET_PDEATHSIG), like a node losing power.
    target = os.getppid() if launch_context().launched_by_shardwise else os.getpid()
    os.kill(target, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Killer:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            kill_job()


def kill_inside_save(step: int) -> None:
    """At `step`: write the temporary checkpoint, cut a file of it in half, die before the commit."""
    from shardwise.checkpoint import training

    original = training.PendingCheckpoint.commit

    def commit(self):
        trainer_step = int(os.path.basename(self.final).split("step=")[1].split(".")[0].split("-")[0])
        if trainer_step == step:
            torch.distributed.barrier() if torch.distributed.is_initialized() else None
            if self.strategy.is_global_zero:
                files = (
                    [os.path.join(r, f) for r, _, fs in os.walk(self.tmp) for f in fs]
                    if os.path.isdir(self.tmp)
                    else [self.tmp]
                )
                victim = max(files, key=os.path.getsize)
                with open(victim, "r+b") as fh:
                    fh.truncate(os.path.getsize(victim) // 2)
                kill_job()
            else:
                signal.pause()  # wait to be killed with the others
        return original(self)

    training.PendingCheckpoint.commit = commit


def strategy_for(name: str):
    return {"single": "single", "ddp": "ddp", "fsdp": shardwise.FSDPStrategy()}[name]


def fit(args, root: str, tag: str, ckpt_path=None, seed: int = 7, callbacks=()) -> None:
    shardwise.seed_everything(seed)
    devices = 1 if args.strategy == "single" else 2
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy_for(args.strategy),
        max_steps=args.max_steps,
        logger=False,
        enable_progress_bar=False,
        default_root_dir=root,
        callbacks=[
            Recorder(os.path.join(args.root, "losses.jsonl"), tag),
            ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_top_k=2),
            *callbacks,
        ],
    )
    trainer.fit(Net(), loader(), ckpt_path=ckpt_path)


class StepLosses:
    """Rank 0 appends each optimizer step's logged global loss (the last micro-batch's train_loss)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.is_last_microbatch and trainer.is_global_zero:
            loss = float(trainer.callback_metrics["train_loss"])
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"run": "killed", "step": trainer.global_step, "loss": repr(loss)}) + "\n")


class KillWorld:
    """At `step`, rank 0 SIGKILLs every worker of the job (the others' pids from root/pid.<rank>), itself last."""

    def __init__(self, step: int, root: str) -> None:
        self.step, self.root = step, root

    def on_train_batch_end(self, trainer, module, *args) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            for name in sorted(os.listdir(self.root)):
                if name.startswith("pid.") and int(name[4:]) != trainer.global_rank:
                    with open(os.path.join(self.root, name)) as fh:
                        os.kill(int(fh.read()), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def killed_expert_parallel_run(root: str, kill_at: int) -> None:
    """On each of 4 workers (shardwise.launch from test_expert_parallel): its dp2 x ep2 GPT-MoE run, checkpointing
    into root/checkpoints, every worker SIGKILLed at once after step `kill_at` (the launcher survives: it holds
    no training state, and reports the ranks' deaths)."""
    from helpers.moe_runs import train

    with open(os.path.join(root, f"pid.{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpid()))
    losses = StepLosses(os.path.join(root, "losses.jsonl"))
    train(4, 2, root=root, save=True, callbacks=[losses, KillWorld(kill_at, root)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--root", required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-mode", default="step", choices=("step", "save"))
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    if args.resume:
        # Another seed on purpose: everything must come from the checkpoint.
        fit(args, os.path.join(args.root, "run"), "resumed", ckpt_path="last", seed=12345)
        fit(args, os.path.join(args.root, "reference"), "reference")
        return
    if args.kill_mode == "save":
        kill_inside_save(args.kill_at)
        fit(args, os.path.join(args.root, "run"), "killed")
    else:
        fit(args, os.path.join(args.root, "run"), "killed", callbacks=[Killer(args.kill_at)])


if __name__ == "__main__":
    main()
