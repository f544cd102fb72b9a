"""A relative step-time model: enough to rank configurations, not to promise seconds.

Step time = compute + the communication that compute cannot hide + offload
traffic. Compute is training FLOPs (3x the forward; activation checkpointing
adds one more forward, 4/3) at a model FLOPs utilisation that drops for small
micro-batches (kernels on few tokens run below peak). Communication is the
bytes each rank sends per optimizer step with ring collectives, per engine
(the table in strategies/accounting.py, beside the strategies), over the
named interconnect (inside a node) or network (across nodes; a ring that
spans nodes runs at the slower of the two). A fraction OVERLAP of the
compute time hides communication (prefetching / bucketed all-reduce).
Sequence and tensor parallel add collectives over activations inside every
layer (Ulysses' all-to-alls, tp's all-gathers and reduce-scatters), on the
intra-node link and not hidden: the next matmul waits for them. CPU
offload adds host<->device copies over PCIe and the optimizer step on the
host. Every constant is a named, documented assumption; `--interconnect`,
`--network` and `--gpu` pick among them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from shardwise.plan.candidates import Candidate
from shardwise.plan.errors import PlanError
from shardwise.plan.moe import MoEFacts, expert_comm_bytes
from shardwise.strategies.accounting import accounting_for

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


def gpu_of_this_machine(default: str = "a100") -> str:
    """The GPUS entry for the CUDA device this process sees (a Trainer planning its own run), else `default`."""
    if not torch.cuda.is_available():
        return default
    name = torch.cuda.get_device_name().lower()
    found = [g for g in GPUS if g != "cpu" and re.search(rf"(?<![a-z0-9]){g}(?![0-9])", name)]
    return found[0] if found else default


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
    shape: Optional[Tuple[int, int, int]] = None,
    replicated_flops_per_token: float = 0.0,
    experts: Optional[MoEFacts] = None,
) -> StepCost:
    """Modelled seconds per optimizer step for one device's `batch_size` sequences.

    shape: (hidden, key/value width, layers) of the model, for the activation collectives of
    sequence / tensor parallel; a tp x sp group's micro-batch (cand.micro_batch sequences) is split
    over its devices, so each computes as much as a device without them, plus what it repeats for its
    group (replicated_flops_per_token: a bundled GPT's head under sp, plan/parallel.py).
    experts: a mixture-of-experts model's facts (plan/moe.py): under expert parallel FSDP moves less of the
    experts, and the routed tokens' all-to-all is added, on the intra-node link when the ep group fits in
    a node (the network otherwise) and not hidden: the experts wait for their tokens.
    """
    half = precision not in ("32-true", "64-true")
    peak = GPUS[hw.gpu]["half" if half else "single"]
    tokens_micro = cand.micro_batch * seq_len / cand.plan.sp  # a rank's rows in each matmul
    mfu = BASE_MFU * tokens_micro / (tokens_micro + MFU_HALF_TOKENS)
    recompute = 4.0 / 3.0 if cand.plan.uses_ac else 1.0
    period = cand.plan.selective_ac_option
    if cand.plan.ac == "selective" and isinstance(period, int) and period > 1:
        recompute = 1.0 + 1.0 / (3.0 * period)  # one block in `period` is recomputed
    compute = (flops_per_token * recompute + replicated_flops_per_token) * batch_size * seq_len / (peak * mfu)

    k, w, n = cand.accumulation, max(1, world), float(params)
    acct = accounting_for(cand.plan)
    intra, inter = INTERCONNECTS[hw.interconnect], NETWORKS[hw.network]
    flat_bw = intra if num_nodes <= 1 else min(intra, inter)
    comm_bytes, comm, parallel_bytes = 0.0, 0.0, 0.0
    if w > 1:
        ring_bytes, intra_bytes, inter_bytes = acct.comm_bytes(
            cand.plan, n, w, num_nodes, k, precision, accumulation_sync
        )
        comm_bytes = ring_bytes + intra_bytes + inter_bytes
        comm = ring_bytes / flat_bw + intra_bytes / intra + inter_bytes / inter
    offload = 0.0
    if cand.plan.offload_optimizer:
        shard = n / w
        offload = acct.host_traffic(cand.plan, shard, k, precision) / HOST_LINK
        per_node_gpus = max(1, w // max(1, num_nodes))
        offload += shard / (CPU_ADAM_PARAMS_PER_S / per_node_gpus)
    if shape is not None:
        # sp's all-to-alls and tp's gathers sit between a layer's matmuls, which wait for them:
        # nothing hides them (FSDP's prefetched all-gathers and bucketed reductions overlap).
        hidden, kv_dim, layers = shape
        tokens = cand.micro_batch * seq_len
        parallel_bytes = acct.activation_comm_bytes(cand.plan, tokens, hidden, kv_dim, layers, k, precision)
    a2a_seconds = 0.0
    if experts is not None and cand.plan.ep > 1 and w > 1:
        saved, a2a = expert_comm_bytes(
            experts,
            cand.plan,
            w,
            k,
            cand.micro_batch * seq_len,
            2.0 if half else 4.0,
            2.0 if precision in ("bf16-true", "16-true") else 4.0,
            2.0 if half else 4.0,
        )
        comm = max(0.0, comm - saved / flat_bw)
        comm_bytes = max(0.0, comm_bytes - saved) + a2a
        per_node = max(1, w // max(1, num_nodes))
        a2a_seconds = a2a / (intra if cand.plan.ep <= per_node else min(intra, inter))
    exposed = max(0.0, comm - OVERLAP * compute) + parallel_bytes / intra + a2a_seconds
    comm, comm_bytes = comm + parallel_bytes / intra + a2a_seconds, comm_bytes + parallel_bytes
    return StepCost(
        seconds=compute + exposed + offload, compute=compute, comm=comm, offload=offload, comm_bytes=comm_bytes
    )
