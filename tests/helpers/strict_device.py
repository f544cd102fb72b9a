"""A CPU stand-in for "NCCL only moves CUDA tensors", so collective-device bugs fail on CPU too.

`strict_cuda_collectives()` makes this gloo process behave, for the code
under test, like a rank of an NCCL job:

- `ops.collective_device()` answers cuda:0, as it would under NCCL;
- `tensor.to("cuda:0")` (and `.cuda()`) returns a `FakeCudaTensor`: a CPU
  tensor that reports `device == cuda:0`; arithmetic on it works, mixing it
  with a non-scalar CPU tensor raises as CUDA would, `.to("cpu")` gives the
  CPU tensor back;
- `dist.all_reduce`, `dist.broadcast`, `dist.all_gather_into_tensor`,
  `dist.send` and `dist.recv` refuse any tensor not on cuda (NCCL's own
  rule), then run over gloo on the CPU data inside the fake;
- `DTensor.full_tensor()` refuses a DTensor whose local shard is not on
  cuda (a CPU shard on an NCCL mesh, as under FSDP cpu_offload); a DTensor
  built by `DTensor.from_local(<fake CUDA tensor>, ...)` counts as on cuda;
- `torch.empty / zeros / ones / full(..., device="cuda:0")` give fakes too, and `copy_` between
  a fake and a CPU tensor works, as it does between CUDA and CPU.
Model-internal collectives that do not go through those functions (FSDP's
reduce-scatter, DTensor's other functional collectives, DDP's reducer) are
untouched, so a whole Trainer / recipe run works under it. Module-level, so
spawned worker processes can import it.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE_CUDA = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=FAKE_CUDA, requires_grad=data.requires_grad
        )
        out.cpu_data = data
        return out

    def __repr__(self) -> str:
        return f"FakeCudaTensor({self.cpu_data!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cpu"
        ):
            rest = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}
            return args[0].cpu_data.to(**rest).clone()
        flat, _ = tree_flatten((args, kwargs))
        cross_device_ok = func in (torch.ops.aten.copy_.default,)  # CUDA copies to and from the host
        for t in (
            [] if cross_device_ok else flat
        ):  # CUDA's rule: other tensors must be CUDA too, except 0-dim CPU scalars
            if isinstance(t, torch.Tensor) and not isinstance(t, FakeCudaTensor) and t.dim() > 0:
                raise RuntimeError(
                    f"{func}: expected all tensors to be on the same device, but found at "
                    f"least two devices, cuda:0 and {t.device} (FakeCudaTensor)"
                )
        out = func(
            *tree_map(lambda t: t.cpu_data if isinstance(t, FakeCudaTensor) else t, args),
            **tree_map(lambda t: t.cpu_data if isinstance(t, FakeCudaTensor) else t, kwargs),
        )
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write:
            return args[0]  # in place (x /= n): the fake's CPU data was updated
        return tree_map(lambda t: FakeCudaTensor(t) if isinstance(t, torch.Tensor) else t, out)


class _ToFakeCuda(TorchDispatchMode):
    """Turns copies to cuda (which this CPU build cannot make) into FakeCudaTensors; pinning into a copy."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and kwargs.get("device") is not None
            and torch.device(kwargs["device"]).type == "cuda"
            and not isinstance(args[0], FakeCudaTensor)
        ):
            rest = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory")}
            return FakeCudaTensor(args[0].to(**rest).clone())
        if func is torch.ops.aten._pin_memory.default:  # pinning needs a CUDA driver; keep pageable memory
            return args[0].clone()
        return func(*args, **kwargs)


class _FactoriesOnFakeCuda(TorchFunctionMode):
    """`torch.empty / zeros / ones / full(..., device="cuda")` (refused by a CPU-only build before any
    dispatch) make a FakeCudaTensor; indexing a fake gives a fake view, copy_ into one fills its data."""

    FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in self.FACTORIES and device is not None and torch.device(device).type == "cuda":
            return FakeCudaTensor(func(*args, **{**kwargs, "device": torch.device("cpu")}))
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeCudaTensor):
            # Indexing sets a CUDA device guard before dispatch; a view of the CPU data aliases it the same way.
            return FakeCudaTensor(args[0].cpu_data[args[1]])
        if func is torch.Tensor.copy_ and isinstance(args[0], FakeCudaTensor):  # same guard: copy into the CPU data
            source = args[1].cpu_data if isinstance(args[1], FakeCudaTensor) else args[1]
            args[0].cpu_data.copy_(source, *args[2:], **kwargs)
            return args[0]
        return func(*args, **kwargs)


def _strict(name: str, original, calls: Dict[str, int]):
    def collective(tensor, *args, **kwargs):
        # FSDP2's own all-gather goes through dist.all_gather_into_tensor before torch 2.13 (all_gather_single
        # from 2.13 on): model-internal, like its reduce-scatter, so it is left unchecked on every version.
        if sys._getframe(1).f_globals.get("__name__", "").startswith("torch.distributed.fsdp"):
            return original(tensor, *args, **kwargs)
        tensors = [tensor] + [a for a in args if isinstance(a, torch.Tensor)]
        for t in tensors:
            if t.device.type != "cuda":
                raise ValueError(
                    f"dist.{name} got a tensor on {t.device}; the group's backend (NCCL, "
                    "simulated by tests/helpers/strict_device.py) only moves CUDA tensors"
                )
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
        with _ToFakeCuda(), _FactoriesOnFakeCuda():
            yield
    finally:
        torch.cuda._lazy_init = saved_init


@contextlib.contextmanager
def strict_cuda_collectives() -> Iterator[Dict[str, int]]:
    """Simulate NCCL's device rule on a gloo rank; yields the count of checked collectives by name."""
    from shardwise.distributed import ops

    calls: Dict[str, int] = {}
    patched = {
        name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "send", "recv")
    }
    saved_device = ops.collective_device
    for name, fn in patched.items():
        setattr(dist, name, _strict(name, fn, calls))
    ops.collective_device = lambda group=None: FAKE_CUDA
    saved_dtensor = _patch_dtensor(calls)
    try:
        with fake_cuda_copies():
            yield calls
    finally:
        for name, fn in patched.items():
            setattr(dist, name, fn)
        ops.collective_device = saved_device
        _restore_dtensor(saved_dtensor)


def _patch_dtensor(calls: Dict[str, int]):
    from torch.distributed.tensor import DTensor

    saved = (DTensor.__dict__["from_local"], DTensor.__dict__["full_tensor"])
    from_local, full_tensor = DTensor.from_local, DTensor.full_tensor

    def strict_from_local(local_tensor, *args, **kwargs):
        if not isinstance(local_tensor, FakeCudaTensor):
            return from_local(local_tensor, *args, **kwargs)
        out = from_local(local_tensor.cpu_data, *args, **kwargs)
        out._strict_on_cuda = True  # its shard was staged on the (fake) collective device
        return out

    def strict_full_tensor(self, *args, **kwargs):
        if not getattr(self, "_strict_on_cuda", False):
            raise ValueError(
                f"DTensor.full_tensor() on a shard on {self._local_tensor.device}; the mesh's backend "
                "(NCCL, simulated by tests/helpers/strict_device.py) only moves CUDA tensors"
            )
        calls["full_tensor"] = calls.get("full_tensor", 0) + 1
        return FakeCudaTensor(full_tensor(self, *args, **kwargs))

    DTensor.from_local = staticmethod(strict_from_local)
    DTensor.full_tensor = strict_full_tensor
    return saved


def _restore_dtensor(saved) -> None:
    from torch.distributed.tensor import DTensor

    DTensor.from_local, DTensor.full_tensor = saved
