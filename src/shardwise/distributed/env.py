"""Where this process stands: rank, world size, node, device and backend.

Three ways a process can be started, and this file reads each one:
torchrun (RANK / WORLD_SIZE / LOCAL_RANK / ... in the environment), SLURM's
`srun` (SLURM_PROCID / SLURM_NTASKS / ...), or a plain `python train.py`,
which is either a single process or, when the Trainer asks for more devices,
the supervisor that starts the workers itself (see launch.py). Validation of
the user's `accelerator` / `devices` / `num_nodes` happens here too, so a
request for eight GPUs on a laptop fails before anything is started.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
from dataclasses import dataclass
from typing import Dict, Optional, Union

import torch
import torch.distributed as dist

from shardwise.distributed.context import current as launch_context

ACCELERATORS = ("auto", "cpu", "cuda")

# A worker that was asked to stop (SIGTERM / SIGINT / SLURM's --signal USR1),
# finished its step and saved a checkpoint exits with this code (EX_TEMPFAIL:
# "preempted, saved, resubmit me"); the launchers exit with it too.
PREEMPTED_EXIT_CODE = 75
# How long a launcher that forwarded a preemption signal waits for its workers
# to save and leave before it kills them: the user's setting, read by the
# launcher, which passes the value on in the launch context.
PREEMPT_GRACE_ENV = "SHARDWISE_PREEMPT_GRACE_S"
PREEMPT_GRACE_DEFAULT_S = 120.0


def preempt_grace_s() -> float:
    value = os.environ.get(PREEMPT_GRACE_ENV, "")
    try:
        return float(value) if value else PREEMPT_GRACE_DEFAULT_S
    except ValueError:
        raise ValueError(f"{PREEMPT_GRACE_ENV}={value!r}: use a number of seconds.") from None


@dataclass(frozen=True)
class DistEnv:
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    num_nodes: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single" | "shardwise" | "torchrun" | "slurm"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0


def resolve_accelerator(accelerator: str) -> str:
    if accelerator not in ACCELERATORS:
        raise ValueError(f"Unknown accelerator {accelerator!r}. Valid: {', '.join(ACCELERATORS)}.")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "accelerator='cuda' was requested but no CUDA device is visible "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}). "
            "Use accelerator='cpu' (FSDP and DDP run on CPU with gloo) or install a CUDA build of torch."
        )
    return accelerator


def available_devices(accelerator: str) -> int:
    if accelerator == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


# CPU "devices" are processes. Oversubscribing cores is legitimate for
# testing multi-rank layouts (a 2x2 mesh on a 2-core laptop), up to a point.
_CPU_OVERSUBSCRIPTION = 4


def resolve_devices(devices: Union[int, str], accelerator: str) -> int:
    """Number of processes per node, checked against what exists.

    Under an external launcher (torchrun, srun) that binds one GPU per task (`srun --gpus-per-task=1`,
    a CUDA_VISIBLE_DEVICES of its own per rank), each process sees one GPU, not the node's: that GPU is
    its device (device_for), so eight processes per node with one visible GPU each is a valid layout.
    """
    if isinstance(devices, str):
        if devices == "auto":
            return torch.cuda.device_count() if accelerator == "cuda" else 1
        if not devices.strip().isdigit():
            raise ValueError(f"devices={devices!r}: use a positive integer or 'auto'.")
        devices = int(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices={devices!r}: use a positive integer or 'auto'.")
    have = available_devices(accelerator)
    limit = have if accelerator == "cuda" else have * _CPU_OVERSUBSCRIPTION
    if devices > limit and accelerator == "cuda":
        launched = detect_env()
        if launched is not None and have == 1:
            return devices  # one GPU per task: every process trains on the one it sees (cuda:0)
        if launched is not None:
            raise ValueError(
                f"devices={devices} processes per node, but each process the launcher started sees {have} "
                f"CUDA devices (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
                f"local ranks {have} and up would have no GPU. Bind one GPU per task (srun "
                f"--gpus-per-task=1) so each rank sees only its own, or start at most {have} processes per node."
            )
    if devices > limit:
        what = (
            f"{have} CUDA device(s)"
            if accelerator == "cuda"
            else (f"{have} CPU core(s) (at most {limit} CPU processes, {_CPU_OVERSUBSCRIPTION} per core)")
        )
        raise ValueError(
            f"devices={devices} but this machine has {what}. Lower devices, or run across "
            "nodes with num_nodes and `shardwise launch` / torchrun / srun."
        )
    return devices


def _int_env(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


# Rank variables shardwise exported where no launcher had (DeepSpeed reads RANK / WORLD_SIZE / LOCAL_RANK
# from the environment, also in a single-process run), listed as "NAME=value;..." in this variable. The list
# travels with the environment, so neither this process nor a child started later with its environment (a
# test's subprocess, a script run from a notebook after a fit) takes them for a launcher's world: a later
# Trainer(devices=N) would see a world of one "started by torchrun" and refuse to launch its N workers. A
# launcher that sets other values replaces them, and then they are its own.
ENV_DEFAULTS_VAR = "SHARDWISE_ENV_DEFAULTS"


def _env_defaults() -> Dict[str, str]:
    listed = [item.partition("=") for item in os.environ.get(ENV_DEFAULTS_VAR, "").split(";") if "=" in item]
    entries = {name: value for name, _, value in listed}
    # All still as set, or none is ours: a launcher that set its own world (WORLD_SIZE=2) may have set RANK=0 too.
    return entries if all(os.environ.get(name) == value for name, value in entries.items()) else {}


def _write_env_defaults(entries: Dict[str, str]) -> None:
    if entries:
        os.environ[ENV_DEFAULTS_VAR] = ";".join(f"{name}={value}" for name, value in entries.items())
    else:
        os.environ.pop(ENV_DEFAULTS_VAR, None)


def apply_env_default(name: str, value: str) -> None:
    """os.environ.setdefault(name, value), remembered when it is this call that set it (ENV_DEFAULTS_VAR)."""
    if name not in os.environ:
        os.environ[name] = value
        _write_env_defaults({**_env_defaults(), name: value})


def drop_env_defaults() -> None:
    """Remove what apply_env_default set that is still as set: the environment as this process found it."""
    for name in _env_defaults():
        del os.environ[name]
    _write_env_defaults({})


def _launcher_int_env(name: str) -> Optional[int]:
    """_int_env, None where the value is one shardwise set itself (apply_env_default), here or in a parent."""
    if name in _env_defaults():
        return None
    return _int_env(name)


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[003-004,010],cpu1' -> 'gpu003'."""
    match = re.match(r"^([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return nodelist
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


# DeepSpeed takes os.environ["LOCAL_RANK"] as its CUDA device index (the engine's set_device, zero.Init's
# device, ZeRO's broadcasts), so with one GPU per task it must read 0 on every rank while the rank's place
# on its node (which rank of the node builds a cache, for one) is another number: (what LOCAL_RANK was set
# to, the node-local rank it stands for), remembered in this process only (a child process reads its own).
_LOCAL_RANK_IS_DEVICE: Optional[tuple] = None


def apply_device_local_rank(local_rank: int, device: torch.device) -> None:
    """Set LOCAL_RANK to `device`'s CUDA index for DeepSpeed; detect_env() still says `local_rank`."""
    global _LOCAL_RANK_IS_DEVICE
    index = device.index if device.type == "cuda" and device.index is not None else local_rank
    os.environ["LOCAL_RANK"] = str(index)
    _LOCAL_RANK_IS_DEVICE = (str(index), local_rank) if index != local_rank else None


def _local_rank() -> int:
    if _LOCAL_RANK_IS_DEVICE is not None and os.environ.get("LOCAL_RANK") == _LOCAL_RANK_IS_DEVICE[0]:
        return _LOCAL_RANK_IS_DEVICE[1]
    return _int_env("LOCAL_RANK") or 0


def detect_env() -> Optional[DistEnv]:
    """Read torchrun's or SLURM's environment; None for a plain process."""
    if _launcher_int_env("WORLD_SIZE") is not None and _launcher_int_env("RANK") is not None:
        world = _int_env("WORLD_SIZE")
        local_world = _int_env("LOCAL_WORLD_SIZE") or world
        return DistEnv(
            world_size=world,
            global_rank=_int_env("RANK"),
            local_rank=_local_rank(),
            node_rank=_int_env("GROUP_RANK") or _int_env("NODE_RANK") or 0,
            num_nodes=max(1, world // local_world),
            local_world_size=local_world,
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int_env("MASTER_PORT") or 29500,
            launcher="shardwise" if launch_context().launched_by_shardwise else "torchrun",
        )
    # SLURM: only when srun started several tasks (a batch script's own shell
    # also has SLURM_* variables, with SLURM_NTASKS possibly unset).
    ntasks = _int_env("SLURM_NTASKS")
    if ntasks and ntasks > 1 and _int_env("SLURM_PROCID") is not None and "SLURM_STEP_ID" in os.environ:
        num_nodes = _int_env("SLURM_NNODES") or 1
        return DistEnv(
            world_size=ntasks,
            global_rank=_int_env("SLURM_PROCID"),
            local_rank=_int_env("SLURM_LOCALID") or 0,
            node_rank=_int_env("SLURM_NODEID") or 0,
            num_nodes=num_nodes,
            local_world_size=max(1, ntasks // num_nodes),
            master_addr=os.environ.get("MASTER_ADDR")
            or _first_slurm_host(os.environ.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=_int_env("MASTER_PORT") or (12910 + (_int_env("SLURM_JOB_ID") or 0) % 1000),
            launcher="slurm",
        )
    return None


def global_rank() -> int:
    """This process's global rank: its process group's once joined, else its launcher's (torchrun, srun), else 0.

    The one way to ask outside a strategy (a strategy that is set up says the same as
    `strategy.global_rank`, and also for the planner's fake world). Never raises: it names
    files and decides who prints, so an unreadable RANK counts as 0.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.get_rank()
        except RuntimeError:  # torn down under us: the launcher's word below
            pass
    try:
        env = detect_env()
    except ValueError:
        return 0
    return env.global_rank if env is not None else 0


def is_global_zero() -> bool:
    """Whether this process is global rank 0 (or not distributed): the rank that prints and writes once."""
    return global_rank() == 0


def single_process_env() -> DistEnv:
    return DistEnv(1, 0, 0, 0, 1, 1, "127.0.0.1", 0, "single")


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def backend_for(device_type: str) -> str:
    # gloo everywhere but CUDA: the same code path, tested on CPU.
    return "nccl" if device_type == "cuda" else "gloo"


def device_for(accelerator: str, local_rank: int) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when every rank of the node sees every GPU.

    Per-task GPU binding (`srun --gpus-per-task=1`, a CUDA_VISIBLE_DEVICES of
    its own per rank) leaves one visible GPU, which is cuda:0 whatever
    LOCAL_RANK says; with fewer visible GPUs than LOCAL_RANK + 1 otherwise,
    no choice is right, so it is an error naming both.
    """
    if accelerator != "cuda":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if 1 < visible <= local_rank:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): start at most {visible} "
            "processes per node, or bind one GPU per task (srun --gpus-per-task=1) so each rank sees only its own."
        )
    return torch.device("cuda", local_rank)


def set_cpu_threads(local_world_size: int) -> None:
    """Give each local process its share of cores, so N ranks don't fight over them."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // max(1, local_world_size)))


# glibc returns large freed blocks to the kernel (mmap/munmap, heap trimming), so
# a training step that frees and re-allocates its big activations every
# iteration page-faults them back in each time: measured 10-30% of a CPU step.
# Keeping freed memory in the process (as jemalloc/tcmalloc setups do) removes
# that cost; tracked tensor memory is unaffected, RSS stays at its high-water
# mark. SHARDWISE_CPU_MALLOC=0 leaves glibc's defaults alone.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_TUNED = False


def tune_cpu_allocator(threshold_bytes: int = 1 << 30) -> bool:
    """Stop glibc from handing large freed blocks back to the kernel; True if applied."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED or os.environ.get("SHARDWISE_CPU_MALLOC", "1") == "0":
        return _MALLOC_TUNED
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, threshold_bytes) == 1 and ok
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    _MALLOC_TUNED = ok
    return ok
