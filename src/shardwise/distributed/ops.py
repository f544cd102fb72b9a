"""Collectives that are safe to call whether or not a process group exists.

Single-process runs and multi-rank runs share the Trainer's code, so every
collective here degrades to the identity without a process group. They also
fail loudly instead of hanging: `barrier` with a timeout uses gloo's
monitored barrier, or a barrier on the rendezvous store for other backends,
and names the ranks that never arrived.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def collective_device(group: Any = None) -> torch.device:
    """The device a collective on `group` (default: the world) needs its tensors on.

    NCCL moves only CUDA tensors (the device `Strategy.setup_environment` made
    current: cuda:LOCAL_RANK, or the one visible GPU under per-task binding);
    gloo moves CPU tensors, and a "cpu:gloo,cuda:nccl" group takes CPU ones
    too. The one place that decides it, so every helper here agrees (and a
    test can substitute a device nothing else uses).
    """
    if not is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = torch.accelerator.current_accelerator()  # xccl, hccl, ...: the current accelerator
    return (
        torch.device(accelerator.type, torch.accelerator.current_device_index()) if accelerator else torch.device("cpu")
    )


def full_tensor(tensor: Any, device: Optional[torch.device] = None) -> Any:
    """`DTensor.full_tensor()` with its collective on `collective_device()`.

    Under FSDP `cpu_offload=True` a shard (a parameter, a gradient, the
    partial norms of sharded gradients) is a CPU tensor on an NCCL mesh, and
    NCCL moves only CUDA tensors: the shard travels through a staging copy on
    the collective device. The result is on `device` if given, else where the
    local shard lives. Anything that is not a DTensor comes back unchanged.
    """
    if not isinstance(tensor, DTensor):
        return tensor
    local = tensor.to_local()
    home = torch.device(device) if device is not None else local.device
    target = collective_device()
    if local.device == target:
        return tensor.full_tensor().to(home)
    staged = DTensor.from_local(
        local.to(target),
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )
    return staged.full_tensor().to(home)


def reduce(value: Any, op: str = "mean", device: Optional[torch.device] = None) -> torch.Tensor:
    """All-reduce a number or tensor; 'mean' divides the sum by the world size.

    The result is on `device` if given, else where `value` was (CPU for a
    Python number); the collective itself runs on `collective_device()`, so
    callers may pass CPU tensors and numbers under NCCL.
    """
    tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    home = torch.device(device) if device is not None else tensor.device
    if not is_initialized():
        return tensor.to(home)
    if op not in ("mean", *_OPS):
        raise ValueError(f"reduce op {op!r}: use one of mean, {', '.join(_OPS)}")
    if tensor.is_floating_point() is False and op == "mean":
        tensor = tensor.float()
    tensor = tensor.to(collective_device())
    dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        tensor /= dist.get_world_size()
    return tensor.to(home)


def barrier(name: str = "", timeout_s: Optional[float] = None) -> None:
    """Wait for every rank; with a timeout, name the ranks that never came.

    gloo: its monitored barrier. Other backends (NCCL): a barrier on the rendezvous store
    (`store_barrier`), since `dist.barrier()` there waits for the process group's own timeout
    (10-30 minutes) however short `timeout_s` is."""
    if not is_initialized():
        return
    if timeout_s is not None and dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as exc:
            raise RuntimeError(
                f"barrier {name!r} timed out after {timeout_s:.0f}s: some rank did not reach it "
                f"(a collective called from only some ranks?). Backend said: {exc}"
            ) from exc
        return
    if timeout_s is not None:
        store_barrier(name, timeout_s)
        return
    dist.barrier()


_store_barriers: Dict[str, int] = {}


def store_barrier(name: str, timeout_s: float) -> None:
    """Wait for every rank of the world on the default group's store, at most `timeout_s`; a rank
    that never came is named. Each rank counts its calls of `name`, so the n-th call of every rank
    meets the n-th of the others (every rank calls the same barriers in the same order)."""
    store = distributed_c10d._get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    count = _store_barriers[name] = _store_barriers.get(name, 0) + 1
    key = f"shardwise/barrier/{name}/{count}"
    store.set(f"{key}/rank{me}", "1")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "1")
    try:
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
        raise RuntimeError(
            f"barrier {name!r} timed out after {timeout_s:.0f}s: rank(s) {', '.join(map(str, missing))} "
            f"did not reach it (a collective called from only some ranks, or a rank still busy?). Store said: {exc}"
        ) from exc


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> List[Any]:
    if not is_initialized():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
