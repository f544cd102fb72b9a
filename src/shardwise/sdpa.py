"""Which kernel `F.scaled_dot_product_attention` runs on a CUDA GPU, and attention that avoids the math one.

SDPA picks its kernel at run time, silently: flash attention, then the
memory-efficient kernel, then the math fallback, which materialises the
seq x seq score matrix (and keeps it for the backward). The rules are
torch's (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
`can_use_flash_attention` / `can_use_mem_efficient_attention`): flash takes
no mask and only fp16/bf16 on sm80-sm121; the memory-efficient kernel takes
masks and fp32 but, in the torch releases this project runs on, not grouped
heads (`enable_gqa=True` with fewer key/value heads than query heads). So a
GQA model with a padding or packed-document mask, or in fp32, falls back to
math: S x S memory per head, where the planner had counted flash (issue 36,
item 5). `cuda_backend` is that decision as a pure function. `attention`
is the SDPA call the models make: where grouped heads would send it to math
but repeated key/value heads would not, it repeats them (two K/V-sized
copies, O(seq), instead of an O(seq^2) matrix). The planner's trace predicts
with the same function (plan/kernels.py) and sets `planning_target` so that
the models decide as they will on the target GPU, not on the planning CPU.

cuDNN attention is left out of the prediction: torch tries it after math
(so never) except on sm90/sm100 with a recent cuDNN in recent releases,
where it comes first and takes masked GQA in fp16/bf16; predicting math
there only over-counts, and `attention` repeats the heads anyway. A newer
torch whose memory-efficient kernel accepts grouped heads makes the same
over-count; neither direction ever under-counts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

FLASH, EFFICIENT, MATH = "flash", "efficient", "math"
DEFAULT_CAPABILITY = (9, 0)  # what the planner assumes when the target GPU is not named: an H100

_HALF = (torch.float16, torch.bfloat16)


def _within(capability: Tuple[int, int], low: Tuple[int, int], high: Tuple[int, int]) -> bool:
    return low <= tuple(capability) <= high


def _efficient_alignment(dtype: torch.dtype, capability: Tuple[int, int]) -> int:
    # minimum_gemm_alignment: tensor cores from sm80 (sm70 for half) need 128-bit aligned rows.
    half = dtype in _HALF
    major = capability[0]
    aligned = 4 if major >= 8 else 1
    if major >= 8 or (major >= 7 and half):
        aligned = max(aligned, 128 // (16 if half else 32))
    return aligned


def cuda_backend(
    dtype: torch.dtype,
    *,
    mask: bool,
    gqa: bool,
    head_dim: int,
    value_head_dim: Optional[int] = None,
    capability: Tuple[int, int] = DEFAULT_CAPABILITY,
    dropout: float = 0.0,
    causal_non_square: bool = False,
    requires_grad: bool = True,
) -> str:
    """The SDPA backend torch picks on a CUDA device of `capability` (default priority: flash, efficient,
    math), for query/key/value in `dtype`, with or without an attention mask, with grouped key/value heads
    (`gqa`: enable_gqa=True and fewer key/value heads than query heads). Returns FLASH, EFFICIENT or MATH."""
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    flash = (
        not mask
        and head_dim == value_head_dim
        and 0 < head_dim <= 256
        and _within(capability, (8, 0), (12, 1))
        and dtype in _HALF
        and not causal_non_square
    )
    if flash and requires_grad and (_within(capability, (8, 6), (8, 9)) or _within(capability, (12, 0), (12, 1))):
        # Its backward on sm86-89 / sm120-121 fails for these head sizes, so torch does not pick it.
        flash = head_dim <= 192 or (dropout == 0.0 and head_dim > 224)
    if flash:
        return FLASH
    aligned = _efficient_alignment(dtype, capability)
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability[0] >= 8 else (torch.float16, torch.float32)
    efficient = (
        _within(capability, (5, 0), (12, 1))
        and dtype in dtypes
        and head_dim > 0
        and value_head_dim > 0
        and head_dim % aligned == 0
        and value_head_dim % aligned == 0
        and not gqa
    )
    return EFFICIENT if efficient else MATH


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> Tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


# The device attention is decided for while the planner traces on the CPU: ("cuda", capability) or None.
_PLANNING: Optional[Tuple[str, Tuple[int, int]]] = None


@contextlib.contextmanager
def planning_target(capability: Tuple[int, int] = DEFAULT_CAPABILITY) -> Iterator[None]:
    """Inside: `attention` decides as it will on a CUDA GPU of `capability` (the planner's fake trace)."""
    global _PLANNING
    previous, _PLANNING = _PLANNING, ("cuda", tuple(capability))
    try:
        yield
    finally:
        _PLANNING = previous


def _target(query: Tensor) -> Optional[Tuple[int, int]]:
    """The CUDA capability this call's kernel is chosen for, or None off CUDA (CPU runs are left as they are)."""
    if _PLANNING is not None:
        return _PLANNING[1]
    if query.device.type == "cuda":
        return _device_capability(query.device.index if query.device.index is not None else 0)
    return None


def repeats_kv_heads(
    dtype: torch.dtype,
    *,
    mask: bool,
    head_dim: int,
    capability: Tuple[int, int],
    dropout: float = 0.0,
    causal_non_square: bool = False,
) -> bool:
    """Whether grouped key/value heads should be repeated before SDPA: with enable_gqa the call would run
    the math kernel, and with as many key/value heads as query heads it would not."""
    common = dict(head_dim=head_dim, capability=capability, dropout=dropout, causal_non_square=causal_non_square)
    grouped = cuda_backend(dtype, mask=mask, gqa=True, **common)
    return grouped == MATH and cuda_backend(dtype, mask=mask, gqa=False, **common) != MATH


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
) -> Tensor:
    """`F.scaled_dot_product_attention` on [B, H, S, D] tensors whose key/value may have fewer heads than the
    query (grouped-query attention), kept off the math kernel on CUDA where repeating the heads can."""
    grouped = query.size(-3) != key.size(-3)
    capability = _target(query) if grouped else None
    if capability is not None and repeats_kv_heads(
        query.dtype,
        mask=attn_mask is not None,
        head_dim=query.size(-1),
        capability=capability,
        dropout=dropout_p,
        causal_non_square=is_causal and query.size(-2) != key.size(-2),
    ):
        groups = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        grouped = False
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=grouped,
    )
