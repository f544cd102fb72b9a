"""Importing DeepSpeed on the right accelerator, for the strategy and for checkpoint conversion.

DeepSpeed chooses its accelerator once per process, when it is first imported (or
when it is told to switch), so both the strategy (deepspeed.py) and the conversion
of its checkpoints (deepspeed_checkpoint.py, which runs without a strategy) go
through `ensure_accelerator_env` / `import_deepspeed` here; `apply_rank_env` gives
DeepSpeed the rank variables it reads (its device among them). Importing this
module does not import DeepSpeed.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Optional

import torch

from shardwise.distributed.env import DistEnv, apply_device_local_rank, apply_env_default
from shardwise.strategies.deepspeed_config import DeepSpeedConfigError

_DS_ACCELERATOR_SET_HERE = False  # DS_ACCELERATOR=cpu came from an earlier CPU run in this process


def ensure_accelerator_env(accelerator: Optional[str] = None) -> None:
    """Point DeepSpeed at the right accelerator before it is imported (it picks one once, at import).

    Without CUDA, or when the user asked for accelerator='cpu', DeepSpeed must
    use its CPU accelerator; an already-imported DeepSpeed on another
    accelerator is switched, since its choice is a process-wide singleton.
    Training on CUDA, an inherited DS_ACCELERATOR other than cuda (a job
    script's `export DS_ACCELERATOR=cpu`) would put DeepSpeed's buffers and
    collectives on the CPU while the model is on the GPU: an error naming it.
    """
    global _DS_ACCELERATOR_SET_HERE
    if accelerator == "cuda":
        inherited = os.environ.get("DS_ACCELERATOR")
        if inherited == "cpu" and _DS_ACCELERATOR_SET_HERE:
            del os.environ["DS_ACCELERATOR"]  # ours, from a CPU run earlier in this process
            _DS_ACCELERATOR_SET_HERE = False
        elif inherited not in (None, "cuda"):
            raise DeepSpeedConfigError(
                f"DS_ACCELERATOR={inherited!r} is set in the environment but the model trains on CUDA: DeepSpeed "
                "would keep its buffers and collectives on that accelerator. Unset DS_ACCELERATOR (or set it "
                "to cuda) for GPU runs."
            )
        if "deepspeed" in sys.modules:
            from deepspeed.accelerator import get_accelerator, set_accelerator

            if get_accelerator().device_name() == "cpu":
                from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

                set_accelerator(CUDA_Accelerator())
        return
    want_cpu = accelerator == "cpu" or (accelerator is None and not torch.cuda.is_available())
    if not want_cpu:
        return

    if "deepspeed" not in sys.modules:
        if "DS_ACCELERATOR" not in os.environ:
            os.environ["DS_ACCELERATOR"] = "cpu"
            _DS_ACCELERATOR_SET_HERE = True
        if os.environ["DS_ACCELERATOR"] != "cpu":
            raise DeepSpeedConfigError(
                f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']!r} but training runs on "
                "the CPU; unset it or set DS_ACCELERATOR=cpu."
            )
        return
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())


def apply_rank_env(env: DistEnv, device: torch.device) -> None:
    """RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / LOCAL_RANK as DeepSpeed reads them, also when the group exists.

    DeepSpeed takes LOCAL_RANK as its device index (the engine's set_device, zero.Init's device), so on CUDA
    it is the index of this rank's device: 0 on every rank when each task sees one GPU (srun
    --gpus-per-task=1), where the node-local rank (3, say) is no device at all. shardwise's own
    detect_env() still reports the node-local rank (env.apply_device_local_rank).
    """
    for key, value in (
        ("RANK", env.global_rank),
        ("WORLD_SIZE", env.world_size),
        ("LOCAL_WORLD_SIZE", env.local_world_size),
    ):
        apply_env_default(key, str(value))  # not taken for a launcher's by a later Trainer in this process
    if device.type == "cuda":
        apply_device_local_rank(env.local_rank, device)
    else:
        apply_env_default("LOCAL_RANK", str(env.local_rank))


def import_deepspeed(accelerator: Optional[str] = None, log_level: int = logging.WARNING):
    """The deepspeed module, imported on `accelerator`'s backend, its logger at `log_level`."""
    ensure_accelerator_env(accelerator)
    try:
        import deepspeed
    except ImportError as exc:  # pragma: no cover - the extra is missing
        raise ImportError("strategy='deepspeed' needs DeepSpeed: pip install 'shardwise[deepspeed]'.") from exc
    from deepspeed.utils import logger

    logger.setLevel(log_level)  # its INFO lines would bury the progress bar
    # DeepSpeed calls torch collectives that torch has deprecated; the warning
    # repeats every step and names nothing the user can change.
    warnings.filterwarnings(
        "ignore",
        category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
    )
    return deepspeed
