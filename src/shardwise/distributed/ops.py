"""Collectives that are safe to call whether or not a process group exists.

Single-process runs and multi-rank runs share the Trainer's code, so every
collective here degrades to the identity without a process group. They also
fail loudly instead of hanging: `barrier` uses gloo's monitored barrier,
which names the ranks that never arrived.
"""
from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def reduce(value: Any, op: str = "mean", device: Optional[torch.device] = None) -> torch.Tensor:
    """All-reduce a number or tensor; 'mean' divides the sum by the world size."""
    tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    if device is not None:
        tensor = tensor.to(device)
    if not is_initialized():
        return tensor
    if op not in ("mean", *_OPS):
        raise ValueError(f"reduce op {op!r}: use one of mean, {', '.join(_OPS)}")
    if tensor.is_floating_point() is False and op == "mean":
        tensor = tensor.float()
    dist.all_reduce(tensor, op=_OPS.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        tensor /= dist.get_world_size()
    return tensor


def barrier(name: str = "", timeout_s: Optional[float] = None) -> None:
    """Wait for every rank; on gloo with a timeout, name the ranks that never came."""
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
    dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if not is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> List[Any]:
    if not is_initialized():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
