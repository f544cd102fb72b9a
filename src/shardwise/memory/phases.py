# How shardwise.memory's tracker tells what a newly born storage is for, when nobody
# registered it: from the phase the program is in, and from the collective an op
# belongs to. Phases come from process-wide hooks: module forward hooks (inside a
# forward, and after a grad-enabled forward until its backward ends: activations),
# autograd's current graph task (inside a backward: activations), and optimizer step
# hooks (inside step(): optimizer state). Collectives name their buffers: FSDP's
# all-gather outputs are parameters, reduce-scatter buffers are gradients, and an
# all-reduce is a gradient only inside a backward (it also syncs metrics and norms).
# The tracker (memory/__init__.py) owns the lock and the books; this module holds
# only the phase counters and the op tables.
from __future__ import annotations

from typing import Callable

import torch
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

# Keyed by schema name so no distributed module has to be imported. Only the in-place c10d ops
# FSDP2, DDP and DeepSpeed issue: DTensor's redistributions (tensor parallel's all-gathers of
# activations and logits, its reduce-scatters and backward all-reduces of activation gradients) run
# as _c10d_functional ops and are activations like any other op's output; naming them parameters
# or gradients overstated a tp plan's parameters by the gathered logits.
PARAM_OPS = frozenset(
    {
        "fsdp::all_gather_copy_in",
        "fsdp::split_with_sizes_copy",
        "c10d::_allgather_base_",
        "c10d::allgather_",
        "c10d::allgather_into_tensor_coalesced_",
    }
)
GRAD_OPS = frozenset(
    {
        "fsdp::chunk_cat",
        "c10d::_reduce_scatter_base_",
        "c10d::reduce_scatter_",
        "c10d::reduce_scatter_tensor_coalesced_",
    }
)
BACKWARD_GRAD_OPS = frozenset({"c10d::allreduce_"})


def op_info(func) -> tuple[str | None, bool]:
    """(role implied by the op, whether an output aliases an input) for one overload.

    The role is "parameters", "gradients", "bw-gradients" (gradients only inside a
    backward) or None.
    """
    name = func._schema.name
    role = None
    if name in PARAM_OPS:
        role = "parameters"
    elif name in GRAD_OPS:
        role = "gradients"
    elif name in BACKWARD_GRAD_OPS:
        role = "bw-gradients"
    # lift_fresh "aliases" a tensor torch.tensor() built without dispatch: it is a birth.
    aliasing = name != "aten::lift_fresh" and any(r.alias_info is not None for r in func._schema.returns)
    return role, aliasing


class PhaseWatcher:
    """Which phase of a training step the tracking thread is in, kept by global hooks."""

    def __init__(self):
        self.reset()
        self.handles: list = []

    def reset(self) -> None:
        self.fwd_depth, self.in_opt, self.awaiting_backward, self.bw_task = 0, 0, False, -1

    def category(self) -> str:
        """The role of a storage born now: optimizer, activations or other."""
        if self.in_opt:
            return "optimizer"
        if self.fwd_depth or self.awaiting_backward:
            return "activations"
        task = torch._C._current_graph_task_id()
        if task != -1:
            if task != self.bw_task:
                # First op of this backward: learn when it ends, so allocations
                # after it (clipping, logging, data) are not called activations.
                self.bw_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self.backward_done)
            return "activations"
        return "other"

    def backward_done(self) -> None:
        if not self.fwd_depth:
            self.awaiting_backward = False

    def install(self, before_step: Callable, after_step: Callable) -> None:
        """Register the global hooks; before_step(opt) / after_step(opt) run around each
        optimizer step, outside the optimizer phase."""

        def fwd_pre(module, args):
            self.fwd_depth += 1

        def fwd_post(module, args, output):
            self.fwd_depth = max(0, self.fwd_depth - 1)
            if not self.fwd_depth and torch.is_grad_enabled():
                self.awaiting_backward = True

        def opt_pre(opt, args, kwargs):
            before_step(opt)
            self.in_opt += 1
            self.awaiting_backward = False

        def opt_post(opt, args, kwargs):
            self.in_opt = max(0, self.in_opt - 1)
            after_step(opt)

        self.handles = [
            nn_module.register_module_forward_pre_hook(fwd_pre),
            nn_module.register_module_forward_hook(fwd_post, always_call=True),
            register_optimizer_step_pre_hook(opt_pre),
            register_optimizer_step_post_hook(opt_post),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
