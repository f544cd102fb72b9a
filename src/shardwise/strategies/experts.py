"""Expert parallel applied to a model: its stacked experts split over the ep mesh, then sharded by FSDP2 apart.

`apply_expert_parallel` finds every experts module (stacked `gate_up_proj` / `down_proj` in transformers'
fused layout: the bundled GPT-MoE's and Hugging Face's Qwen3-MoE / Mixtral experts), turns each of its
stacked weights into a DTensor Shard(0) on the ep mesh (rank i of an ep group holds experts
[i * E/ep, (i + 1) * E/ep)), and makes its forward dispatch tokens by all-to-all (expert_parallel.py): a
module that knows expert parallel itself (the GPT-MoE) reads `expert_group`; any other gets
`experts_forward` as its forward. It runs on the unsharded (meta) model, before activation checkpointing.
`shard_experts` then gives each experts module an FSDP2 unit of its own over the experts' mesh
(dp_shard / ep ranks, torchtitan's "efsdp"), before the blocks are sharded over dp_shard, and sets its
gradient divide factor to the data-parallel world: an expert's local gradient already sums the
contributions of every ep rank's tokens (the all-to-all's backward brought them), so dividing by the
experts' own mesh would weigh them ep times more than the other parameters, and a step would differ from
one process's. DCP saves these DTensors with their placements, so a checkpoint resumes at another ep
degree and on one process through the existing checkpoint code.
"""

from __future__ import annotations

import types
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from shardwise.expert_parallel import experts_forward, is_experts
from shardwise.strategies import degrees
from shardwise.strategies.expert_parallel_hf import install_hf_dispatch, is_hf_experts

__all__ = ["apply_expert_parallel", "find_experts", "shard_experts", "count_experts", "clip_norm_by_mesh"]


def find_experts(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """Every stacked-experts module of `module` (name, module), in module order."""
    return [(name, m) for name, m in module.named_modules() if is_experts(m)]


def count_experts(module: nn.Module) -> int:
    """The experts per MoE layer (0 when the model has none)."""
    found = find_experts(module)
    return int(found[0][1].gate_up_proj.shape[0]) if found else 0


def _ep_forward(self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """A Hugging Face experts module's forward under expert parallel (bound by apply_expert_parallel)."""
    return experts_forward(
        hidden,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        self.gate_up_proj.shape[0],
        getattr(self, "act_fn", torch.nn.functional.silu),
        self.expert_group,
    )


def apply_expert_parallel(module: nn.Module, ep_mesh: DeviceMesh, model_name: str = "the model") -> int:
    """Split every experts module's stacked weights over `ep_mesh` (1-D) and route its tokens there.

    Returns the number of experts modules; ValueError, naming the fix, when the model has none or ep
    does not divide its expert count. Meta tensors stay meta (their local shard's shape)."""
    found = find_experts(module)
    ep = ep_mesh.size()
    if not found:
        degrees.refuse(degrees.experts_problem(ep, 0, model_name))
    rank = ep_mesh.get_local_rank()
    for _, experts in found:
        total = int(experts.gate_up_proj.shape[0])
        degrees.refuse(degrees.experts_problem(ep, total, model_name))
        for name, param in list(experts.named_parameters(recurse=False)):
            if isinstance(param, DTensor) or param.dim() == 0 or param.shape[0] != total:
                continue
            local = param.detach().chunk(ep, dim=0)[rank]
            local = torch.empty_like(local) if local.is_meta else local.clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(experts, name, nn.Parameter(dt, requires_grad=param.requires_grad))
        experts.expert_group = ep_mesh.get_group()
        experts.num_experts_total = total
        if is_hf_experts(experts):  # transformers' own all-to-all around the model's experts code
            install_hf_dispatch(experts, ep_mesh, total)
        elif not getattr(experts, "routes_tokens_itself", False):
            experts.forward = types.MethodType(_ep_forward, experts)
    return len(found)


def shard_experts(module: nn.Module, mesh: DeviceMesh, divide_factor: float, fsdp_kwargs: dict) -> List[nn.Module]:
    """fully_shard each experts module over the experts' FSDP mesh (the blocks' other `fsdp_kwargs`), its
    gradients divided by `divide_factor` (the data-parallel world, as the other parameters' are)."""
    from torch.distributed.fsdp import fully_shard

    units = []
    for _, experts in find_experts(module):
        fully_shard(experts, **{**fsdp_kwargs, "mesh": mesh})
        experts.set_gradient_divide_factor(float(divide_factor))
        if mesh.device_type == "cpu" and mesh.size() > 1:
            # gloo has no PREMUL_SUM: reduce with SUM, divide after. Not on a mesh of one rank, where torch
            # (2.13) divides by the factor when copying the unreduced gradient and again after.
            experts.set_force_sum_reduction_for_comms(True)
        units.append(experts)
    return units


def clip_norm_by_mesh(params: Sequence[nn.Parameter], max_norm: float, full_norm: Callable) -> torch.Tensor:
    """Clip gradients to a global 2-norm `max_norm`, the parameters grouped by their DTensor mesh; the total norm.

    Under expert parallel the experts' gradients live on the (dp_shard / ep, ep) mesh and the others on the
    dp_shard mesh, and DTensor operations do not mix meshes: each group's norm is taken and made whole
    (`full_norm`: the strategy's reduction of a partial norm) on its own, and the groups' norms combine as
    the square root of their squares. One mesh (every run without ep) is exactly the single-group norm."""
    groups: Dict[object, List[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(groups) == 1:
        norms = [full_norm(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0))]
    else:
        norms = [_group_norm([p.grad for p in g], full_norm) for g in groups.values()]
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() for n in norms]).norm()
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _group_norm(grads: List[torch.Tensor], full_norm: Callable) -> torch.Tensor:
    """The 2-norm of gradients that share one DTensor mesh. On a mesh of several dimensions (the experts':
    FSDP x ep) the squares of the local shards are summed over each sharded dimension's group in turn:
    DTensor's own reduction would merge those all-reduces into one over a flattened mesh, which torch
    (2.13) refuses to look up when the ranks of the experts' FSDP dimension (dp_shard / ep with sp) are
    not in mesh order."""
    mesh = getattr(grads[0], "device_mesh", None)
    placements = {tuple(g.placements) for g in grads} if mesh is not None else set()
    if mesh is None or mesh.ndim == 1 or len(placements) != 1:
        return full_norm(torch.nn.utils.get_total_norm(grads, norm_type=2.0))
    square = torch.nn.utils.get_total_norm([g.to_local() for g in grads], norm_type=2.0).float().square()
    for dim, placement in enumerate(next(iter(placements))):
        if not placement.is_replicate():
            dist.all_reduce(square, group=mesh.get_group(dim))
    return square.sqrt()
