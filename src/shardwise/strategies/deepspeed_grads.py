"""Where DeepSpeed's ZeRO optimizers keep this rank's gradients before the step, read without moving them.

The per-step health check (trainer/nonfinite.py) reduces every gradient the
engine holds to one norm each, and only the norms travel. From ZeRO-2 on
DeepSpeed clears param.grad, so this module finds the partitions in the
optimizer instead, and hands them over where they live. Two reads here used to
be wrong on a GPU (issue 36, item 3):
- ZeRO-3: DeepSpeed's `safe_get_local_grad` synchronises the host with the
  reduce stream and copies the fp32 partition to the GPU, once per parameter;
  with the optimizer offloaded that is every gradient of the model copied to
  the device each step (tens of GB for a 70B model) and one host wait per
  parameter. Here the reduce stream is waited for once and each parameter's
  partition is a view into DeepSpeed's flat buffer on its own device (pinned
  CPU under offload), so its norm is computed there.
- ZeRO-1/2 with the optimizer offloaded: the fp32 partition on the host is
  filled by non-blocking device-to-host copies that DeepSpeed itself waits for
  at the top of `step()` (`_wait_for_offload_copies`). Read before that wait,
  a buffer may still hold the previous window's values or zeros: a false
  "all zero" or a missed NaN. The wait is made here first (it is idempotent:
  DeepSpeed clears its pending events).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import nn


def _wait_for_host_copies(optimizer: Any) -> None:
    """Block until the device-to-host gradient copies DeepSpeed issued are complete (ZeRO-1/2 offload)."""
    wait = getattr(optimizer, "_wait_for_offload_copies", None)
    if callable(wait):
        wait()  # DeepSpeed's own wait, the one step() makes first
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # another DeepSpeed version: no event to wait on, so the whole device


def _wait_for_reduce_stream(optimizer: Any, on_host: bool) -> None:
    """ZeRO-3 reduces and partitions gradients on its own stream. A reader on the device only needs its
    stream ordered after it (no host wait); a reader on the host (offloaded partitions) needs the copies
    done, so the host waits, once per step rather than once per parameter."""
    stream = getattr(optimizer, "reduce_and_partition_stream", None)
    if stream is None or not hasattr(stream, "synchronize"):
        return  # a synchronised device (CPU): nothing is in flight
    if on_host:
        stream.synchronize()
    else:
        torch.cuda.current_stream().wait_stream(stream)


def _zero3_local(optimizer: Any, params: Sequence[nn.Parameter]) -> List[Optional[torch.Tensor]]:
    positions = getattr(optimizer, "grad_position", None)
    flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    offloaded = bool(getattr(optimizer, "offload_optimizer", False))
    # DeepSpeed's private map from ds_id to the partition on the device (the name is mangled by its class).
    on_device = getattr(optimizer, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None)
    if positions is None or flats is None or (not offloaded and on_device is None):
        from deepspeed.utils import safe_get_local_grad  # another layout: DeepSpeed's own (slow) getter

        return [safe_get_local_grad(p) for p in params]
    if not offloaded:
        _wait_for_reduce_stream(optimizer, on_host=False)
        return [on_device.get(p.ds_id) for p in params]  # fp32 views into one flat buffer, in model order
    _wait_for_reduce_stream(optimizer, on_host=True)
    swappable = getattr(optimizer, "_swappable_optimizer_subgroup", lambda i: False)
    held: List[Optional[torch.Tensor]] = []
    for p in params:
        where = positions.get(optimizer.get_param_id(p))
        if where is None:  # no partition of it on this rank
            held.append(None)
            continue
        group, offset, count = where
        if swappable(group):
            # Swapped out to NVMe: DeepSpeed reads it in and releases the buffer again, so its norm is taken
            # while it is there; a one-element tensor holding the norm has that same norm.
            grad, _ = optimizer._get_fp32_grad_state_partition(param=p, release_swap_buffers=True)
            held.append(torch.linalg.vector_norm(grad.float()).reshape(1))
            continue
        flat_grad = flats[group].grad
        held.append(None if flat_grad is None else flat_grad.narrow(0, offset, count))
    return held


def local_gradients(optimizer: Any, stage: int, offload_optimizer: bool, params: Sequence[nn.Parameter]) -> list:
    """This rank's gradient partitions held by a ZeRO-`stage` optimizer after the window's last backward,
    each on the device it lives on (no copy); None entries for parameters with nothing here."""
    if stage == 3:
        return _zero3_local(optimizer, params)
    if offload_optimizer:
        _wait_for_host_copies(optimizer)
        return [group.grad for group in getattr(optimizer, "single_partition_of_fp32_groups", [])]
    held = []
    for group in getattr(optimizer, "averaged_gradients", {}).values():
        flat = getattr(group, "flat_partition", None)  # the compact buffer, else a list of tensors
        held.extend([flat] if flat is not None else list(group or []))
    return held
