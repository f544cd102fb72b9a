"""The DeviceMeshes of FSDPStrategy, and the check that ranks meant to read the same samples do.

Without tensor or sequence parallel the mesh is FSDP2's alone: 1-D (shard) or 2-D (replicate, shard),
with the degrees the ParallelPlan decides. With tp or sp the world is one (dp_replicate, dp_shard,
sp, tp) mesh, row-major so tensor-parallel neighbours share a node; FSDP2 gets the data-parallel and
sp dimensions (sp flattened into the shard dimension), tensor and sequence parallel their own 1-D
meshes. The ranks of an sp x tp group read the same samples; `check_same_within_groups` lets the
strategy prove it on each epoch's first batch instead of training on mismatched shards silently.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.distributed import ops
from shardwise.strategies.parallel import FILL, ParallelPlan


def build_device_mesh(
    sharding_strategy: str,
    world_size: int,
    num_nodes: int,
    device_type: str,
    device_mesh: Optional[Union[DeviceMesh, Tuple[int, int]]] = None,
) -> DeviceMesh:
    """The mesh of the ParallelPlan's data-parallel degrees (parallel.py decides them and refuses what
    cannot be laid out): 1-D for sharding within the world, 2-D (replicate, shard) for hybrid /
    replicate-only / an explicit device_mesh=(replicate, shard).

    HYBRID_SHARD replicates across nodes and shards within one. On one node that is a 1 x N mesh:
    FSDP2 shards over the N ranks and the all-reduce over a replicate dimension of size 1 has
    nothing to combine, so the run trains like FULL_SHARD (and the same script scales out by
    num_nodes alone).
    """
    if isinstance(device_mesh, DeviceMesh):
        return device_mesh
    degrees = {}
    if device_mesh is not None:
        degrees["dp_replicate"], degrees["dp_shard"] = device_mesh
    plan = ParallelPlan("fsdp", sharding=sharding_strategy, **degrees)
    dims = plan.mesh(world_size, num_nodes)
    if plan.dp_degrees == (1, FILL):  # sharding only: one dimension
        return init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("replicate", "shard"))


def build_parallel_meshes(
    plan: ParallelPlan, world_size: int, num_nodes: int, device_type: str
) -> Tuple[DeviceMesh, DeviceMesh, Optional[DeviceMesh], Optional[DeviceMesh]]:
    """(world, fsdp, sp, tp) meshes for a plan with tensor or sequence parallel.

    One (dp_replicate, dp_shard, sp, tp) mesh over the world, row-major (tp neighbours on one node).
    FSDP2 shards over dp_shard and sp flattened (sp ranks hold the same parameters and their gradients
    add up; torchtitan's dp_shard_cp), with the replicate dimension in front when there is one.
    """
    dims = plan.mesh(world_size, num_nodes)
    world = init_device_mesh(
        device_type,
        (dims.dp_replicate, dims.dp_shard, dims.sp, dims.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "sp", "tp"),
    )
    shard_dims = ("dp_shard", "sp") if dims.sp > 1 else ("dp_shard",)
    shard_name = "dp_shard_sp" if dims.sp > 1 else "dp_shard"
    flat = world[shard_dims]._flatten(shard_name) if dims.sp > 1 else world[shard_name]
    fsdp = flat
    if dims.dp_replicate > 1:
        with warnings.catch_warnings():
            # torch (2.11-2.14) warns that slicing a flattened dimension from the root will be deprecated;
            # it is how a (replicate, shard x sp) mesh sharing the root with tp is made there.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            fsdp = world["dp_replicate", shard_name]
    return world, fsdp, world["sp"] if dims.sp > 1 else None, world["tp"] if dims.tp > 1 else None


def check_same_within_groups(batch: Any, group_size: int) -> Optional[List[int]]:
    """The first group of `group_size` consecutive ranks whose batches differ, or None (collective)."""
    tensors = [t for t in _leaves(batch) if isinstance(t, torch.Tensor)]
    values = [0.0, 0.0, 0.0]
    for t in tensors:
        flat = t.detach().reshape(-1).double().cpu()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(9973) + 1
        values = [values[0] + flat.numel(), values[1] + float(flat.sum()), values[2] + float((flat * weights).sum())]
    gathered = ops.all_gather_object(values)
    for start in range(0, len(gathered), group_size):
        group = gathered[start : start + group_size]
        if any(v != group[0] for v in group[1:]):
            return list(range(start, start + group_size))
    return None


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    else:
        yield obj
