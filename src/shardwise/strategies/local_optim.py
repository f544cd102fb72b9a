"""Step optimizers whose kernels do not understand DTensor on each rank's local shards.

Under FSDP2 every parameter is a DTensor. torch's optimizers handle it, but a
third-party kernel (bitsandbytes, a hand-written optimizer calling ops DTensor
has no rule for) fails on it. An element-wise optimizer (Adam, AdamW, Lion, SGD,
their paged / 8-bit variants) needs only the rank's own shard of a parameter, its
gradient and its state, so its step can run on plain local tensors. Optimizers
whose update needs a global norm (LAMB, Adafactor) are not element-wise and need
DTensor support instead.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor


def wants_local_step(optimizer: torch.optim.Optimizer, setting: Optional[bool]) -> bool:
    """Explicit setting wins; by default step on local shards every optimizer not from torch itself."""
    if setting is not None:
        return bool(setting)
    return not type(optimizer).__module__.startswith("torch.")


def apply_local_shard_step(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make `optimizer.step` run on local shards (idempotent); returns the same object.

    Every caller gets it (the Trainer, a hand-written loop, torch.distributed.checkpoint's state
    initialisation before a load). During `step`, each DTensor parameter in `param_groups` is replaced
    by a detached view of its local shard (same storage, so the update lands in the sharded parameter)
    whose `.grad` is the local gradient shard, and its optimizer state is re-keyed and unwrapped to
    local tensors. Afterwards everything is put back: state shaped like the shard becomes DTensors with
    the parameter's placements again, so `state_dict()`, DCP and resharding on resume work as for a
    torch optimizer; the optimizer object, its param-group dicts (LR schedulers) and hooks are untouched.
    State not shaped like the shard (8-bit optimizers' per-block absmax) is per rank and has no global
    layout: saving such an optimizer is refused with an error instead of being written wrongly.
    """
    if getattr(optimizer, "_shardwise_local_step", False):
        return optimizer
    inner_step = optimizer.step  # possibly already wrapped by an LR scheduler: keep its bookkeeping
    inner_state_dict = optimizer.state_dict

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if any(a is not None for a in args) or kwargs.get("closure") is not None:
            raise ValueError(
                f"{type(self).__name__}.step(closure) is not supported on local shards: the closure's "
                "backward fills the sharded gradients after the step has read them. Call backward, "
                "then step() without a closure."
            )
        with on_local_shards(self):
            return inner_step()

    def state_dict(self: torch.optim.Optimizer) -> Any:
        keys = sorted(getattr(self, "_shardwise_rank_local_state", ()))
        if keys:
            raise RuntimeError(
                f"{type(self).__name__} keeps optimizer state that is not shaped like the parameter shards "
                f"({', '.join(keys)}; e.g. an 8-bit optimizer's per-block scales), stepped on each rank's local "
                "shard under FSDP. It has no global layout, so it cannot be saved in a checkpoint that loads "
                "correctly: use its 32-bit variant (e.g. bitsandbytes PagedAdamW32bit / AdamW32bit) to checkpoint, "
                "or DeepSpeed ZeRO, which steps the optimizer on its own flat partitions."
            )
        return inner_state_dict()

    # Bound methods, so torch's LR schedulers can still wrap `optimizer.step.__func__`.
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.state_dict = types.MethodType(state_dict, optimizer)
    optimizer._shardwise_local_step = True
    return optimizer


@contextlib.contextmanager
def on_local_shards(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within this block the optimizer sees plain local tensors (parameters, gradients, state)."""
    swapped: List[Tuple[dict, list]] = []
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []
    hidden: List[Tuple[torch.Tensor, torch.Tensor]] = []  # plain empty parameters whose grad is put back after
    for group in optimizer.param_groups:
        params = group["params"]
        local_params = []
        for p in params:
            if not isinstance(p, DTensor):
                if p.numel() == 0 and p.grad is not None:
                    hidden.append((p, p.grad))
                    p.grad = None
                local_params.append(p)
                continue
            local = p.to_local().detach()  # shares the shard's storage: updates land in the parameter
            # A rank may hold none of a small parameter (LoRA A with r below the shard group's size). It is
            # stepped without a gradient, which optimizers skip: bitsandbytes' CUDA kernels fail on an empty
            # tensor and call exit(1), with no Python traceback. Nothing is lost: there is nothing to update.
            if p.grad is not None and local.numel():
                local.grad = p.grad.to_local()
            state = optimizer.state.pop(p, None)
            if state is not None:
                optimizer.state[local] = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
            pairs.append((p, local))
            local_params.append(local)
        swapped.append((group, params))
        group["params"] = local_params
    try:
        yield
    finally:
        for group, params in swapped:
            group["params"] = params
        for p, grad in hidden:
            p.grad = grad
        for p, local in pairs:
            state = optimizer.state.pop(local, None)
            if state is not None:
                optimizer.state[p] = {k: _restore(optimizer, k, v, p, local) for k, v in state.items()}
            local.grad = None


def _restore(optimizer: torch.optim.Optimizer, key: str, value: Any, param: DTensor, local: torch.Tensor) -> Any:
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.dim() == 0:
        return value  # step counters, hyperparameters
    if value.shape == local.shape:
        # Shaped like the shard: the same layout as the parameter (exp_avg, exp_avg_sq, momentum).
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    if not hasattr(optimizer, "_shardwise_rank_local_state"):
        optimizer._shardwise_rank_local_state = set()
    optimizer._shardwise_rank_local_state.add(key)
    return value
