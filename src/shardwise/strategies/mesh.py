"""`ParallelMesh`: the one answer to "which ranks do what" for a ParallelPlan, and the DeviceMeshes built from it.

The world is laid out row-major over (dp_replicate, dp_shard, sp, tp), tp varying fastest, exactly as
`init_device_mesh` numbers a mesh of that shape, so tensor-parallel neighbours share a node. Every rank
question -- this rank's data-parallel rank and the number of them, the ranks that share a batch (sp x tp:
they read the same samples and together compute one loss), the ranks FSDP2 shards over (dp_shard x sp:
sp ranks hold the same parameters and their gradients add up), the replicas -- is answered here from the
global rank and the degrees alone, without a process group, so it is tested on fake ranks and used before
launch (samplers, the same-batch check, predict's shares, throughput totals, the recipe's schedule length).
Nothing else in the package does rank arithmetic: a new dimension (expert, pipeline) changes this file's
layout and every answer follows. `build` makes the DeviceMeshes with one set of dimension names;
`check_same_within_groups` lets a strategy prove on an epoch's first batch that each batch group read
the same samples, instead of training on mismatched shards silently.

Expert parallel (ep) is carved out of dp_shard, torchtitan's layout: the dp_shard coordinate is
(dp_shard // ep, dp_shard % ep), ep varying fastest, so the rank numbering and every answer above stay
those of the plan without ep, the ep ranks read different samples (they are data-parallel ranks) and
exchange tokens by all-to-all inside their `expert_group`; FSDP2 shards the other parameters over
dp_shard (x sp) as before and the experts over `expert_shard_group` (dp_shard / ep ranks, x sp).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.distributed import ops
from shardwise.strategies.parallel import FILL, MeshDims, ParallelPlan

DIMS = ("dp_replicate", "dp_shard", "sp", "tp")  # the world's dimensions, outermost first
SHARD_SP = "dp_shard_sp"  # FSDP2's shard dimension under sequence parallel: dp_shard and sp flattened
# Under expert parallel the world's DeviceMesh splits dp_shard in two, ep the inner part (EXPERT_DIMS).
EXPERT_SHARD = "dp_shard_mod_ep"  # the experts' FSDP dimension: dp_shard / ep ranks holding the same experts
EXPERT_DIMS = ("dp_replicate", EXPERT_SHARD, "ep", "sp", "tp")
EXPERT_SHARD_SP = "dp_shard_mod_ep_sp"  # the experts' FSDP dimension under sp: dp_shard_mod_ep and sp flattened


@dataclass(frozen=True)
class ParallelMesh:
    """The resolved degrees of one run and every rank question about them (pure: no process group).

    replicate_dim: whether FSDP2's mesh keeps a replicate dimension (2-D) -- an explicit
    device_mesh=(r, s), HYBRID_SHARD or NO_SHARD without tp/sp, or dp_replicate > 1 with them;
    FULL_SHARD / SHARD_GRAD_OP shard over a 1-D mesh.
    """

    dims: MeshDims
    replicate_dim: bool = False

    @classmethod
    def from_plan(cls, plan: ParallelPlan, world_size: int, num_nodes: int = 1) -> "ParallelMesh":
        """The layout of `plan` on `world_size` ranks (ValueError, naming the fix, if it cannot be laid out)."""
        dims = plan.mesh(world_size, num_nodes)
        if dims.tp * dims.sp * dims.ep == 1:
            two_d = plan.engine == "fsdp" and plan.dp_degrees != (1, FILL)
        else:
            two_d = dims.dp_replicate > 1
        return cls(dims, two_d)

    # ------------------------------------------------------------------ sizes
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def shape(self) -> tuple:
        d = self.dims
        return (d.dp_replicate, d.dp_shard, d.sp, d.tp)

    @property
    def batch_group_size(self) -> int:
        """Ranks that read the same samples and compute one loss together: sp x tp."""
        return self.dims.sp * self.dims.tp

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different samples: dp_replicate x dp_shard."""
        return self.dims.dp_replicate * self.dims.dp_shard

    @property
    def has_model_parallel(self) -> bool:
        """Whether any rank shares its batch with another (tp or sp > 1)."""
        return self.batch_group_size > 1

    @property
    def expert_parallel_size(self) -> int:
        """Ranks that split the experts between them and exchange tokens (ep)."""
        return self.dims.ep

    # ------------------------------------------------------------------ one rank
    def coordinates(self, rank: int) -> Dict[str, int]:
        """`rank`'s index along each dimension (row-major, tp fastest: init_device_mesh's numbering)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks.")
        out: Dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(DIMS, self.shape))):
            rest, out[name] = divmod(rest, size)
        return {name: out[name] for name in DIMS}

    def data_parallel_rank(self, rank: int) -> int:
        """`rank`'s index among the `data_parallel_size` readers of different samples."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dims.dp_shard + c["dp_shard"]

    def group(self, rank: int, over: Sequence[str]) -> List[int]:
        """The ranks that differ from `rank` only along the dimensions `over`, in mesh order."""
        unknown = [n for n in over if n not in DIMS]
        if unknown:
            raise ValueError(f"unknown mesh dimension(s) {unknown}; the dimensions are {', '.join(DIMS)}.")
        at = self.coordinates(rank)
        axes = [range(size) if name in over else (at[name],) for name, size in zip(DIMS, self.shape)]
        return [self.rank_at(*c) for c in itertools.product(*axes)]

    def rank_at(self, dp_replicate: int, dp_shard: int, sp: int, tp: int) -> int:
        """The global rank at these coordinates (the inverse of `coordinates`)."""
        d = self.dims
        return ((dp_replicate * d.dp_shard + dp_shard) * d.sp + sp) * d.tp + tp

    def batch_group(self, rank: int) -> List[int]:
        """The ranks that read `rank`'s samples (its sp x tp group): the loss is theirs together."""
        return self.group(rank, ("sp", "tp"))

    def batch_groups(self) -> List[List[int]]:
        """Every batch group once, in data-parallel rank order."""
        return [
            self.batch_group(self.rank_at(r, s, 0, 0))
            for r in range(self.dims.dp_replicate)
            for s in range(self.dims.dp_shard)
        ]

    def fsdp_group(self, rank: int) -> List[int]:
        """The ranks FSDP2 shards `rank`'s parameters over: dp_shard and sp together."""
        return self.group(rank, ("dp_shard", "sp"))

    def replicate_group(self, rank: int) -> List[int]:
        """The ranks that hold `rank`'s shard as replicas (the all-reduce of HSDP / NO_SHARD)."""
        return self.group(rank, ("dp_replicate",))

    def expert_rank(self, rank: int) -> int:
        """`rank`'s index in its expert group: it holds experts [i * E/ep, (i + 1) * E/ep)."""
        return self.coordinates(rank)["dp_shard"] % self.dims.ep

    def expert_group(self, rank: int) -> List[int]:
        """The ep ranks that split the experts and exchange tokens with `rank` (consecutive dp_shard ranks)."""
        ep = self.dims.ep
        return [
            r
            for r in self.group(rank, ("dp_shard",))
            if self.coordinates(r)["dp_shard"] // ep == (self.coordinates(rank)["dp_shard"] // ep)
        ]

    def expert_shard_group(self, rank: int) -> List[int]:
        """The ranks FSDP2 shards `rank`'s experts over: the dp_shard ranks holding the same experts (dp_shard / ep)
        and their sp ranks (the same experts, other slices of the same samples: their gradients add up)."""
        ep, mine = self.dims.ep, self.expert_rank(rank)
        return [r for r in self.group(rank, ("dp_shard", "sp")) if self.coordinates(r)["dp_shard"] % ep == mine]

    # ------------------------------------------------------------------ DeviceMeshes
    def build(self, device_type: str) -> "Meshes":
        """The DeviceMeshes of this layout (collective: every rank of the world calls it).

        Without tp / sp only FSDP2's data-parallel mesh exists, 1-D (dp_shard) or 2-D (dp_replicate,
        dp_shard); no group is made for dimensions of size one. With them one world mesh over all four
        dimensions, FSDP2 on (dp_replicate,) dp_shard x sp flattened, tp and sp on their own 1-D meshes.
        """
        d = self.dims
        if d.ep > 1:
            return self._build_expert(device_type)
        if not self.has_model_parallel:
            if self.replicate_dim:
                fsdp = init_device_mesh(device_type, (d.dp_replicate, d.dp_shard), mesh_dim_names=DIMS[:2])
            else:
                fsdp = init_device_mesh(device_type, (d.dp_shard,), mesh_dim_names=("dp_shard",))
            return Meshes(fsdp=fsdp)
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=DIMS)
        shard_name = SHARD_SP if d.sp > 1 else "dp_shard"
        fsdp = world["dp_shard", "sp"]._flatten(SHARD_SP) if d.sp > 1 else world["dp_shard"]
        if d.dp_replicate > 1:
            with warnings.catch_warnings():
                # torch (2.11-2.14) warns that slicing a flattened dimension from the root will be deprecated;
                # it is how a (replicate, shard x sp) mesh sharing the root with tp is made there.
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                fsdp = world["dp_replicate", shard_name]
        return Meshes(
            fsdp=fsdp,
            world=world,
            sp=world["sp"] if d.sp > 1 else None,
            tp=world["tp"] if d.tp > 1 else None,
        )

    def _build_expert(self, device_type: str) -> "Meshes":
        """Under ep: one world mesh over EXPERT_DIMS; FSDP2's mesh flattens (dp_shard_mod_ep, ep) back into
        dp_shard, with sp flattened in as without ep (and dp_replicate before it when there are replicas);
        the experts' FSDP2 mesh is dp_shard_mod_ep, with sp flattened in (same replicas): sp ranks hold the
        same experts and their gradients are summed there like every other parameter's; the ep mesh places
        the experts and carries the token all-to-all (between ranks of the same sp slice)."""
        d = self.dims
        shape = (d.dp_replicate, d.dp_shard // d.ep, d.ep, d.sp, d.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_DIMS)
        shard_name, expert_name = (SHARD_SP, EXPERT_SHARD_SP) if d.sp > 1 else ("dp_shard", EXPERT_SHARD)
        fsdp = world[(EXPERT_SHARD, "ep", "sp") if d.sp > 1 else (EXPERT_SHARD, "ep")]._flatten(shard_name)
        experts = world[EXPERT_SHARD, "sp"]._flatten(expert_name) if d.sp > 1 else world[EXPERT_SHARD]
        if d.dp_replicate > 1:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                fsdp = world["dp_replicate", shard_name]
                experts = world["dp_replicate", expert_name]
        return Meshes(fsdp=fsdp, world=world, sp=world["sp"] if d.sp > 1 else None, ep=world["ep"], expert_fsdp=experts)


@dataclass
class Meshes:
    """The DeviceMeshes of one run: FSDP2's, and with tp / sp the world's and each dimension's own."""

    fsdp: DeviceMesh
    world: Optional[DeviceMesh] = None
    sp: Optional[DeviceMesh] = None
    tp: Optional[DeviceMesh] = None
    ep: Optional[DeviceMesh] = None  # the experts' placement and token all-to-all (expert parallel)
    expert_fsdp: Optional[DeviceMesh] = None  # FSDP2's mesh for the experts: dp_shard / ep (and replicas)


def check_same_within_groups(batch: Any, groups: Sequence[Sequence[int]]) -> Optional[List[int]]:
    """The first of `groups` (lists of global ranks) whose ranks' batches differ, or None (collective)."""
    tensors = [t for t in _leaves(batch) if isinstance(t, torch.Tensor)]
    values = [0.0, 0.0, 0.0]
    for t in tensors:
        flat = t.detach().reshape(-1).double().cpu()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64).remainder_(9973) + 1
        values = [values[0] + flat.numel(), values[1] + float(flat.sum()), values[2] + float((flat * weights).sum())]
    gathered = ops.all_gather_object(values)
    for group in groups:
        first = gathered[group[0]]
        if any(gathered[r] != first for r in group[1:]):
            return list(group)
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


__all__ = ["ParallelMesh", "Meshes", "DIMS", "EXPERT_DIMS", "check_same_within_groups"]
