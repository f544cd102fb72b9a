"""What the CUDA caching allocator reserves for a predicted peak of live tensors.

"Fits" is judged on reserved memory: an allocation fails when the allocator
cannot find or create a block, not when live tensors reach the device size.
The model, instead of a flat factor (the planner's old 1.25):

    reserved = allocated + fragmentation + rounding

- steady state (parameters, gradients, optimizer state, buffers) is
  allocated once per step pattern and reused block for block: it packs
  without fragmentation after the first step;
- transient blocks (activations, gathered FSDP units, logits, optimizer-step
  temporaries) are allocated and released every step. Without expandable
  segments (PyTorch's default) a freed large block can be split to serve
  smaller requests, and the next request of the same size then needs a fresh
  segment: at worst about one more copy of the *largest transient block*
  (`largest_transient`, recorded by the trace) stays reserved beside the peak;
- rounding: every block is rounded (512 B; >1 MiB requests come from
  2 MiB / 20 MiB segments, and a split segment's remainder is only reusable
  by smaller requests): ROUNDING of the transient bytes.
With `expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF) segments grow in
2 MiB pages and a freed block's pages are reused by any later size, so
fragmentation is modelled as zero and only the rounding stays
(EXPANDABLE_ROUNDING of the transient bytes). On the CPU there is no caching
allocator: reserved = allocated.

Beside the traced tensors, the CUDA libraries allocate through the same allocator: cuBLAS keeps one
workspace per (thread, stream) that runs a matmul, and a training step has two such threads (forward
on the caller's, backward on autograd's device thread). PyTorch sizes each at 32 MiB on Hopper and
newer and at 8 MiB + 128 KiB before (CUBLAS_WORKSPACE_CONFIG overrides it); measured on an H200 with
torch 2.11, a 2.4 MiB model peaked at 67.3 MiB allocated, 2.4 + 2 x 32 MiB + under 1 MiB. The planner
adds `workspace_bytes` to every CUDA row: nothing for a large model, the whole peak for a tiny one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

# GPUs whose cuBLAS workspace PyTorch sizes at 32 MiB (compute capability 9 and newer).
_LARGE_WORKSPACE_GPUS = ("h100", "h200", "gh200", "h800", "b100", "b200", "gb200")
MATMUL_THREADS = 2  # the caller's thread (forward) and autograd's device thread (backward)

ROUNDING = 0.05  # of transient bytes, default allocator (block splitting and size-class rounding)
EXPANDABLE_ROUNDING = 0.02  # of transient bytes, expandable segments (2 MiB pages)


def expandable_segments_from_env() -> bool:
    """What the run will use if nothing is said: PYTORCH_CUDA_ALLOC_CONF (PyTorch's default: off)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") or os.environ.get("PYTORCH_ALLOC_CONF", "")
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1")
    return False


def cublas_workspace_bytes(gpu: str) -> float:
    """One cuBLAS workspace as PyTorch sizes it: CUBLAS_WORKSPACE_CONFIG (":KiB:count" pairs) or the default."""
    conf = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = [p for p in conf.split(":") if p]
    if pairs and len(pairs) % 2 == 0 and all(p.isdigit() for p in pairs):
        return float(sum(int(pairs[i]) * int(pairs[i + 1]) for i in range(0, len(pairs), 2)) * 1024)
    if gpu.lower() in _LARGE_WORKSPACE_GPUS:
        return 4096 * 1024 * 8.0
    return 4096 * 1024 * 2.0 + 16 * 1024 * 8


@dataclass(frozen=True)
class Allocator:
    accelerator: str = "cuda"
    expandable_segments: bool = False
    factor: Optional[float] = None  # a flat reserved / allocated ratio the user asked for instead
    gpu: str = "a100"  # sizes the cuBLAS workspaces

    @property
    def workspace_bytes(self) -> float:
        """Library workspaces every CUDA step holds beside the traced tensors (module docstring)."""
        if self.accelerator != "cuda":
            return 0.0
        return MATMUL_THREADS * cublas_workspace_bytes(self.gpu)

    def reserved(self, allocated: float, steady: float, largest_transient: float) -> float:
        if self.factor is not None:
            return allocated * self.factor
        if self.accelerator != "cuda":
            return allocated
        transient = max(0.0, allocated - steady)
        if self.expandable_segments:
            return allocated + EXPANDABLE_ROUNDING * transient
        return allocated + min(largest_transient, allocated) + ROUNDING * transient

    def describe(self) -> str:
        if self.factor is not None:
            return f"reserved = allocated x {self.factor:g}"
        if self.accelerator != "cuda":
            return "reserved = allocated (no caching allocator on the CPU)"
        if self.expandable_segments:
            return f"reserved = allocated + {EXPANDABLE_ROUNDING:.0%} of transient bytes (expandable segments)"
        return f"reserved = allocated + largest transient block + {ROUNDING:.0%} of transient bytes"

    def assumptions(self) -> List[str]:
        if self.factor is not None:
            return [f"reserved memory is allocated x {self.factor:g} (--reserved-factor), not the allocator model"]
        if self.accelerator != "cuda":
            return ["CPU target: no caching allocator, reserved = allocated"]
        common = (
            f"{self.workspace_bytes / 2**20:.0f} MiB of cuBLAS workspaces ({MATMUL_THREADS} threads) are added to "
            "the traced peak; steady state (parameters, gradients, optimizer state) is reused block for block; "
            "transient = allocated - steady (activations, gathered units, logits, step temporaries)"
        )
        if self.expandable_segments:
            return [
                common,
                f"expandable_segments:True: no fragmentation, {EXPANDABLE_ROUNDING:.0%} page rounding "
                "of transient bytes",
            ]
        return [
            common,
            "default allocator (expandable_segments off): one extra copy of the largest transient "
            f"block may stay reserved by fragmentation, plus {ROUNDING:.0%} rounding of transient bytes; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True removes the fragmentation term",
        ]


__all__ = ["Allocator", "cublas_workspace_bytes", "expandable_segments_from_env", "ROUNDING", "EXPANDABLE_ROUNDING"]
