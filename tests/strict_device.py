"""A CPU stand-in for "NCCL only moves CUDA tensors", so collective-device bugs fail on CPU too.

`strict_cuda_collectives()` makes this gloo process behave, for the code
under test, like a rank of an NCCL job:

- `ops.collective_device()` answers cuda:0, as it would under NCCL;
- `tensor.to("cuda:0")` (and `.cuda()`) returns a `FakeCudaTensor`: a CPU
  tensor that reports `device == cuda:0`; arithmetic on it works, mixing it
  with a non-scalar CPU tensor raises as CUDA would, `.to("cpu")` gives the
  CPU tensor back;
- `dist.all_reduce`, `dist.broadcast` and `dist.all_gather_into_tensor`
  refuse any tensor not on cuda (NCCL's own rule), then run over gloo on the
  CPU data inside the fake.
Model-internal collectives that do not go through those three functions
(FSDP's reduce-scatter, DTensor's functional collectives, DDP's reducer) are
untouched, so a whole Trainer / recipe run works under it. Module-level, so
spawned worker processes can import it.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE_CUDA = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                  device=FAKE_CUDA, requires_grad=data.requires_grad)
        out.cpu_data = data
        return out

    def __repr__(self) -> str:
        return f"FakeCudaTensor({self.cpu_data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            rest = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}
            return args[0].cpu_data.to(**rest).clone()
        flat, _ = tree_flatten((args, kwargs))
        for t in flat:  # CUDA's rule: other tensors must be CUDA too, except 0-dim CPU scalars
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor) and t.dim() > 0:
                raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found at "
                                   f"least two devices, cuda:0 and {t.device} (FakeCudaTensor)")
        out = func(*tree_map(lambda t: t.cpu_data if isinstance(t, FakeCudaTensor) else t, args),
                   **tree_map(lambda t: t.cpu_data if isinstance(t, FakeCudaTensor) else t, kwargs))
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            return args[0]  # in place (x /= n): the fake's CPU data was updated
        return tree_map(lambda t: FakeCudaTensor(t) if isinstance(t, torch.Tensor) else t, out)


class _ToFakeCuda(TorchDispatchMode):
    """Turns copies to cuda (which this CPU build cannot make) into FakeCudaTensors; pinning into a copy."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cuda" and not isinstance(args[0], FakeCudaTensor):
            rest = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}
            return FakeCudaTensor(args[0].to(**rest).clone())
        if func is torch.ops.aten._pin_memory.default:  # pinning needs a CUDA driver; keep pageable memory
            return args[0].clone()
        return func(*args, **kwargs)


def _strict(name: str, original, calls: Dict[str, int]):
    def collective(tensor, *args, **kwargs):
        tensors = [tensor] + [a for a in args if isinstance(a, torch.Tensor)]
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(f"dist.{name} got a tensor on {t.device}; the group's backend (NCCL, "
                                 "simulated by tests/strict_device.py) only moves CUDA tensors")
        calls[name] = calls.get(name, 0) + 1
        unwrap = [t.cpu_data if isinstance(t, FakeCudaTensor) else t for t in (tensor, *args)]
        return original(*unwrap, **kwargs)
    return collective


@contextlib.contextmanager
def fake_cuda_copies() -> Iterator[None]:
    """`tensor.to("cuda:0")` gives a FakeCudaTensor instead of failing on this CPU-only build."""
    saved_init = torch.cuda._lazy_init
    torch.cuda._lazy_init = lambda: None  # `.to("cuda")` asks for CUDA before it dispatches
    try:
        with _ToFakeCuda():
            yield
    finally:
        torch.cuda._lazy_init = saved_init


@contextlib.contextmanager
def strict_cuda_collectives() -> Iterator[Dict[str, int]]:
    """Simulate NCCL's device rule on a gloo rank; yields the count of checked collectives by name."""
    from shardwise.distributed import ops

    calls: Dict[str, int] = {}
    patched = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather_into_tensor")}
    saved_device = ops.collective_device
    for name, fn in patched.items():
        setattr(dist, name, _strict(name, fn, calls))
    ops.collective_device = lambda group=None: FAKE_CUDA
    try:
        with fake_cuda_copies():
            yield calls
    finally:
        for name, fn in patched.items():
            setattr(dist, name, fn)
        ops.collective_device = saved_device
