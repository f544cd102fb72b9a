"""Lightning's cluster environments, refused by name: the launch environment is read, not configured, here.

torchrun's, SLURM's and shardwise's own launcher's variables are read by
distributed/env.py; a preemption signal (SLURM's --signal, SIGUSR1 by default
among Trainer(preemption_signals=...)) saves the run and exits 75, which the
job script turns into a requeue.
"""

from __future__ import annotations

from shardwise.utilities.refusal import build_refused_class

_READ = (
    "ranks, nodes and the master address are read from torchrun's, SLURM's or `shardwise launch`'s variables; "
    "there is nothing to configure"
)
ClusterEnvironment = build_refused_class("ClusterEnvironment", __name__, _READ)
LightningEnvironment = build_refused_class("LightningEnvironment", __name__, _READ)
TorchElasticEnvironment = build_refused_class("TorchElasticEnvironment", __name__, _READ)
KubeflowEnvironment = build_refused_class("KubeflowEnvironment", __name__, _READ + " (start it with torchrun)")
LSFEnvironment = build_refused_class("LSFEnvironment", __name__, _READ + " (start it with torchrun)")
MPIEnvironment = build_refused_class("MPIEnvironment", __name__, _READ + " (start it with torchrun)")
XLAEnvironment = build_refused_class("XLAEnvironment", __name__, "shardwise runs on CPUs and CUDA GPUs, not XLA")
SLURMEnvironment = build_refused_class(
    "SLURMEnvironment",
    __name__,
    "SLURM is detected from its variables; a requeue signal (#SBATCH --signal=SIGUSR1@90; SIGUSR1 is among "
    "Trainer(preemption_signals=...)) saves the run and exits 75: requeue in the job script "
    "(`[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID`) instead of auto_requeue",
)
