"""Expert parallel for Hugging Face MoE experts through transformers' own token dispatch.

A transformers 5.x experts module (Qwen3-MoE's, Mixtral's: stacked `gate_up_proj` / `down_proj`, built
with `use_experts_implementation`) computes its experts with the model's own code: the kernel the config
names (`_experts_implementation`), and the layout and bias variants each model declares. Under expert
parallel its stacked weights are already split over the ep mesh by `strategies/experts.py`; this file
only makes its forward reach them: transformers' `AllToAllEP` sends each (token, expert) pair to the rank
holding the expert with an uneven all-to-all, runs the module's own forward there on local expert ids,
and sends the results back, weighting them on the sender. The module learns its local expert count and
that its experts are split (`num_experts`, `_is_expert_parallel`, as transformers' `MoEParamShard` sets
them). The ranks of an ep group read different batches here, so the group that shares a batch (what
transformers calls the tp group) is each rank alone: a one-rank mesh made without a world collective.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["is_hf_experts", "install_hf_dispatch"]

_OWN_MESH: dict = {}  # (device type, rank) -> the one-rank mesh, made once per process


def is_hf_experts(module: nn.Module) -> bool:
    """An experts module built by transformers' `use_experts_implementation` (it carries the model config
    and the `_is_expert_parallel` switch its forward reads)."""
    if "transformers" not in sys.modules:  # nothing of transformers can exist before it is imported
        return False
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "config")


def _own_mesh(device_type: str) -> DeviceMesh:
    """A 1-rank DeviceMesh of this rank: the ranks that hold the same batch as this one, under ep."""
    rank = dist.get_rank()
    key = (device_type, rank)
    if key not in _OWN_MESH:
        group = dist.new_group([rank], use_local_synchronization=True)
        _OWN_MESH[key] = DeviceMesh.from_group(group, device_type, mesh_dim_names=("batch",))
    return _OWN_MESH[key]


def install_hf_dispatch(experts: nn.Module, ep_mesh: DeviceMesh, total_experts: int) -> None:
    """Route `experts`' tokens over `ep_mesh` by transformers' all-to-all, around the module's own forward.

    Call it after the stacked weights became DTensor Shard(0) on `ep_mesh` (experts.apply_expert_parallel).
    The forward swaps those for their local shards while it runs (FSDP2 hands it the unsharded DTensor)."""
    from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

    experts.num_experts = total_experts // ep_mesh.size()
    experts._is_expert_parallel = True  # the forward skips the rows sent to no local expert
    experts.routes_tokens_itself = True
    EpDispatchExpertsParallel().install_forward(
        experts, ep_mesh, tp_mesh=_own_mesh(ep_mesh.device_type), ep_implementation="all_to_all"
    )


def describe(experts: Any) -> str:
    """How an HF experts module computes (for error messages): its class and experts implementation."""
    impl = getattr(getattr(experts, "config", None), "_experts_implementation", None) or "eager"
    return f"{type(experts).__name__} (experts_implementation={impl!r})"
