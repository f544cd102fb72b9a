"""A run that goes wrong on purpose, for test_faults.py.

    python fault_script.py MODE STRATEGY TIMEOUT_S OUT_DIR

MODE (what rank 1 does at global step 3, unless said otherwise):
  hang      sleeps forever inside training_step
  kill      SIGKILLs itself inside training_step (as the OOM killer would)
  raise0    rank 0 raises a config error; its clean-up closes the process
            group and takes 3 s, so rank 1 sees "Connection closed by peer" first
  preempt   no Trainer: each worker handles SIGTERM/SIGUSR1 by sleeping 1 s
            and exiting 75 (saved, preempted)
  ignore    no Trainer: each worker ignores SIGTERM/SIGUSR1
STRATEGY: ddp | fsdp | deepspeed (ZeRO-2). Started as `python fault_script.py ...` it launches
itself (the Trainer's supervisor, or launch_script for the preempt modes);
under `shardwise launch` each copy is one rank.
"""

import os
import signal
import sys
import time

MODE, STRATEGY, TIMEOUT_S, OUT = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]


def preempt_worker() -> None:
    rank = os.environ["RANK"]

    def on_signal(signum, _frame):
        with open(os.path.join(OUT, f"signal.{rank}"), "w") as fh:
            fh.write(signal.Signals(signum).name)
        time.sleep(1.0)  # "finish the step and save"
        sys.exit(75)

    handler = on_signal if MODE == "preempt" else signal.SIG_IGN
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, handler)
    open(os.path.join(OUT, f"ready.{rank}"), "w").close()
    while True:
        time.sleep(0.1)


if MODE in ("preempt", "ignore"):
    if "RANK" in os.environ:
        preempt_worker()
    from shardwise.distributed.launch import launch_script

    launch_script(2)

import torch  # noqa: E402

from shardwise import Trainer, TrainModule  # noqa: E402
from shardwise.distributed import progress  # noqa: E402
from shardwise.strategies import DDPStrategy, FSDPStrategy  # noqa: E402


class Model(TrainModule):
    def configure_model(self):
        self.net = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        step, rank = self.trainer.global_step, self.trainer.global_rank
        progress.mark("training_step", step)  # the lead's Trainer does this at every hook
        if step == 3:
            if MODE == "hang" and rank == 1:
                time.sleep(100000)
            if MODE == "kill" and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE == "raise0" and rank == 0:
                try:
                    raise ValueError("config error: warmup_steps must be < max_steps (rank 0 only)")
                finally:
                    torch.distributed.destroy_process_group()
                    time.sleep(3.0)
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if STRATEGY == "deepspeed":
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2, timeout_s=TIMEOUT_S)
else:
    strategy = (DDPStrategy if STRATEGY == "ddp" else FSDPStrategy)(timeout_s=TIMEOUT_S)
trainer = Trainer(
    accelerator="cpu",
    devices=2,
    strategy=strategy,
    max_steps=8,
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
)
trainer.fit(Model(), [torch.ones(2, 8)] * 16)
print("UNREACHABLE: the run finished")
