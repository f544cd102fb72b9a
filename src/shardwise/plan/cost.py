"""A relative step-time model: enough to rank configurations, not to promise seconds.

Step time = compute + the communication that compute cannot hide + offload
traffic. Compute is training FLOPs (3x the forward; activation checkpointing
adds one more forward, 4/3) at a model FLOPs utilisation that drops for small
micro-batches (kernels on few tokens run below peak). Communication is the
bytes each rank sends per optimizer step with ring collectives (all-reduce
2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n), per strategy:

  DDP, FSDP NO_SHARD  all-reduce gradients once per step (no_sync between micro-batches)
  FSDP FULL_SHARD     all-gather parameters in forward and again in backward, per micro-batch;
                      reduce-scatter gradients every micro-batch (FSDPStrategy's default
                      accumulation_sync="reduce_scatter"), once per step with "none"
  FSDP SHARD_GRAD_OP  one all-gather per micro-batch (kept for backward); reduce-scatter as FULL_SHARD
  FSDP HYBRID_SHARD   FULL_SHARD inside a node, all-reduce of the shards across nodes
  ZeRO-1              reduce-scatter gradients at the boundary, all-gather parameters after the step
  ZeRO-2              as ZeRO-1, but gradients are reduced every micro-batch
  ZeRO-3              all-gather in forward and backward, reduce-scatter, per micro-batch

over the named interconnect (inside a node) or network (across nodes; a ring
that spans nodes runs at the slower of the two). A fraction OVERLAP of the
compute time hides communication (prefetching / bucketed all-reduce). CPU
offload adds host<->device copies over PCIe and the optimizer step on the
host. Every constant is a named, documented assumption; `--interconnect`,
`--network` and `--gpu` pick among them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from shardwise.plan.candidates import Candidate
from shardwise.plan.presets import PlanError

# Dense bf16 peak FLOP/s (fp32 runs use the TF32 / fp32 figure), device memory for reference.
GPUS: Dict[str, Dict[str, float]] = {
    "a100": dict(half=312e12, single=156e12),
    "h100": dict(half=989e12, single=495e12),
    "h200": dict(half=989e12, single=495e12),
    "a10g": dict(half=125e12, single=31e12),
    "l4": dict(half=121e12, single=60e12),
    "v100": dict(half=125e12, single=15.7e12),
    "cpu": dict(half=1e12, single=1e12),
}
# Achievable collective bus bandwidth per GPU, bytes/s.
INTERCONNECTS: Dict[str, float] = {
    "nvlink": 200e9,  # A100 NVLink 3 (DGX / HGX), NCCL bus bandwidth
    "nvlink4": 360e9,  # H100 NVLink 4
    "pcie4": 20e9,  # PCIe gen 4 x16, no NVLink
    "pcie5": 40e9,
}
NETWORKS: Dict[str, float] = {
    "infiniband": 22e9,  # HDR 200 Gb/s, one NIC per GPU
    "ib-ndr": 45e9,  # NDR 400 Gb/s per GPU
    "efa": 6e9,  # 400 Gb/s per 8-GPU node
    "ethernet": 1.5e9,  # 100 GbE per 8-GPU node
}
HOST_LINK = 20e9  # PCIe gen 4 host <-> device, per GPU, for offload copies
CPU_ADAM_PARAMS_PER_S = 1.0e9  # DeepSpeedCPUAdam on one node's cores, parameters per second
BASE_MFU = 0.45  # model FLOPs utilisation at large micro-batches
MFU_HALF_TOKENS = 256  # utilisation halves at micro-batches of this many tokens
OVERLAP = 0.7  # fraction of compute time that can hide communication


@dataclass
class Hardware:
    gpu: str = "a100"
    interconnect: str = "nvlink"
    network: str = "infiniband"

    def __post_init__(self) -> None:
        for value, table, what in (
            (self.gpu, GPUS, "gpu"),
            (self.interconnect, INTERCONNECTS, "interconnect"),
            (self.network, NETWORKS, "network"),
        ):
            if value not in table:
                raise PlanError(f"Unknown {what} {value!r}; known: {', '.join(table)}.")


@dataclass
class StepCost:
    seconds: float
    compute: float
    comm: float  # communication time before overlap
    offload: float
    comm_bytes: float  # per rank per step


def step_cost(
    cand: Candidate,
    hw: Hardware,
    *,
    params: int,
    flops_per_token: float,
    batch_size: int,
    seq_len: int,
    world: int,
    num_nodes: int,
    precision: str,
    accumulation_sync: str = "reduce_scatter",
) -> StepCost:
    """Modelled seconds per optimizer step for one device's `batch_size` sequences."""
    half = precision not in ("32-true", "64-true")
    peak = GPUS[hw.gpu]["half" if half else "single"]
    tokens_micro = cand.micro_batch * seq_len
    mfu = BASE_MFU * tokens_micro / (tokens_micro + MFU_HALF_TOKENS)
    recompute = 4.0 / 3.0 if cand.activation_checkpointing else 1.0
    compute = flops_per_token * batch_size * seq_len * recompute / (peak * mfu)

    k, w, n = cand.accumulation, max(1, world), float(params)
    wb = 2.0 if half else 4.0  # bytes a gathered parameter travels in
    rb = 2.0 if precision in ("bf16-true", "16-true") else 4.0  # gradient reduction dtype
    ring = (w - 1) / w
    intra, inter = INTERCONNECTS[hw.interconnect], NETWORKS[hw.network]
    flat_bw = intra if num_nodes <= 1 else min(intra, inter)
    comm_bytes, comm = 0.0, 0.0
    if w > 1:
        if cand.kind == "ddp" or (cand.kind == "fsdp" and cand.sharding == "NO_SHARD"):
            comm_bytes = 2 * ring * n * rb
        elif cand.kind == "fsdp" and cand.sharding == "HYBRID_SHARD":
            per_node = max(1, w // max(1, num_nodes))
            inner = (per_node - 1) / per_node
            scatters = k if accumulation_sync == "reduce_scatter" else 1
            intra_bytes = k * 2 * inner * n * wb + scatters * inner * n * rb
            nodes = max(1, num_nodes)
            inter_bytes = 2 * (nodes - 1) / nodes * n / per_node * rb
            comm_bytes = intra_bytes + inter_bytes
            comm = intra_bytes / intra + inter_bytes / inter
        elif cand.kind == "fsdp":
            gathers = 1 if cand.sharding == "SHARD_GRAD_OP" else 2
            scatters = k if accumulation_sync == "reduce_scatter" else 1
            comm_bytes = k * gathers * ring * n * wb + scatters * ring * n * rb
        elif cand.stage == 3:
            comm_bytes = k * 3 * ring * n * wb
        else:
            reductions = k if cand.stage == 2 else 1
            comm_bytes = reductions * ring * n * wb + ring * n * wb
        if comm == 0.0:
            comm = comm_bytes / flat_bw
    offload = 0.0
    if cand.offload:
        shard = n / w
        h2d = (k * 2 * shard * 4) if cand.kind == "fsdp" else (k * 2 * shard * wb)
        offload = (h2d + shard * 4) / HOST_LINK
        per_node_gpus = max(1, w // max(1, num_nodes))
        offload += shard / (CPU_ADAM_PARAMS_PER_S / per_node_gpus)
    exposed = max(0.0, comm - OVERLAP * compute)
    return StepCost(
        seconds=compute + exposed + offload, compute=compute, comm=comm, offload=offload, comm_bytes=comm_bytes
    )
