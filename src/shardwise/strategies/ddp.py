"""DDP: every rank holds the whole model; gradients are averaged in backward.

The model is built on the meta device like everywhere else and materialised
with the same sharding-invariant init, so a DDP run starts from bitwise the
same weights as an FSDP or single-device run with the same seed. Gradients
live in DDP's communication buckets (gradient_as_bucket_view) instead of in
a second copy, which is the lowest-memory DDP configuration.

Lightning's DDPStrategy arguments port unchanged: `timeout` (a timedelta)
is timeout_s; `start_method` ("popen", "spawn", "fork") is accepted and
changes nothing, since shardwise's launcher starts the processes the same
way whichever is named; `process_group_backend` must be the backend the
device uses ("nccl" on CUDA, "gloo" elsewhere), checked at set-up; other
keyword arguments go to torch's DistributedDataParallel, as in Lightning.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.strategies.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(
        self,
        precision: Any = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = True,
        bucket_cap_mb: Optional[float] = None,
        timeout_s: float = 1800.0,
        compile: Any = None,
        timeout: Optional[datetime.timedelta] = None,  # Lightning's spelling of timeout_s
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        **ddp_kwargs: Any,  # further DistributedDataParallel arguments (broadcast_buffers=False, ...)
    ) -> None:
        if timeout is not None:
            timeout_s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"DDPStrategy(start_method={start_method!r}): use 'popen', 'spawn' or 'fork'.")
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"DDPStrategy(process_group_backend={process_group_backend!r}): shardwise uses 'nccl' on CUDA "
                "and 'gloo' elsewhere; leave it out."
            )
        super().__init__(precision=precision, timeout_s=timeout_s, compile=compile)
        self.process_group_backend = process_group_backend
        self.ddp_kwargs = dict(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **ddp_kwargs,
        )
        if bucket_cap_mb is not None:
            self.ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def setup_environment(self) -> None:
        wanted = "nccl" if self.accelerator == "cuda" else "gloo"
        if self.process_group_backend not in (None, wanted):
            raise ValueError(
                f"DDPStrategy(process_group_backend={self.process_group_backend!r}) on {self.accelerator}: "
                f"shardwise uses {wanted!r} there; leave process_group_backend out."
            )
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)  # with compile=True its blocks are compiled there, before DDP
        if self.world_size > 1:
            device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
            module = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        self.module = module
        return module

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def no_backward_sync(self, model: nn.Module, enabled: bool):
        if enabled and isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

    # Manual optimization: DDP synchronises gradients between its own forward and the backward that
    # follows, one pair per step. A training_step that runs several backward passes inside that
    # forward (a GAN) gets no synchronisation from it, so it runs on the unwrapped module (DDP's
    # reducer stays idle) and each backward's gradients are averaged here instead. Averaging after
    # every backward is exact however gradients accumulate: what earlier backward passes left is
    # already equal on every rank.
    def manual_model(self, model: nn.Module) -> nn.Module:
        return self.unwrap(model)

    def manual_backward(self, loss: torch.Tensor, model: nn.Module, **kwargs: Any) -> None:
        super().manual_backward(loss, model, **kwargs)
        if self.world_size > 1:
            average_gradients(self.unwrap(model), self.world_size)


@torch.no_grad()
def average_gradients(module: nn.Module, world_size: int) -> None:
    """All-reduce the mean of every gradient of `module`, one flat buffer per dtype and device."""
    groups: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for p in module.parameters():
        if p.grad is not None:
            groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
