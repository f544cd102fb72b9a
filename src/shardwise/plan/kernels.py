"""Attention and dropout traced with the target's kernels, not the planning machine's.

`F.scaled_dot_product_attention` picks its kernel by device, dtype and
arguments. On CUDA (fp16/bf16: flash; fp32, masks, dropout: memory-efficient)
the backward keeps only the output and an O(seq) logsumexp per head -- no
seq x seq matrix -- unless neither fused kernel takes the call: grouped
key/value heads (enable_gqa) with a mask or in fp32 fall back to the math
kernel there too (sdpa.cuda_backend has torch's rules), and such a call is
traced through the math kernel, seq x seq matrix and all. The models' own
attention (sdpa.attention) repeats the heads instead where that keeps it
off math, and decides so during the trace as on the target GPU. On the CPU the flash kernel handles most calls too, but
dropout (and some GQA shapes) take the math path, which saves the attention
probabilities and the dropout mask: seq^2 x heads per layer, which a CUDA
run never allocates. Inside `target_attention("cuda")` every SDPA call goes
through the flash kernel's own op (CPU build, same saved tensors as CUDA's
flash / memory-efficient kernels: output + logsumexp), so the fake trace holds what the GPU will. Models that ask for
`flash_attention_2` are built with SDPA (flash-attn need not be installed)
and traced the same way. An eager attention (a model that computes
softmax(QK^T) itself) is traced as written: it keeps the matrix on any device.

Dropout differs the same way. On CUDA `F.dropout` runs the fused
`native_dropout` kernel, which saves a one-byte bool mask; on the CPU it
multiplies by a noise tensor of the input's dtype and saves that: 4 bytes
per element in fp32, four times the GPU's, for every dropout of every layer
(the demo Transformer with Lightning's dropout 0.2 has four per encoder and
six per decoder layer, one of them FFN-wide). Inside
`target_attention("cuda")` dropout goes through `native_dropout` (CPU
kernel, CUDA's saved tensors: the bool mask).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Tuple

import torch
import torch.nn.functional as F

from shardwise import sdpa

FLASH_IMPLEMENTATIONS = (
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn",
    "kernels-community/vllm-flash-attn3",
)


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and key.dim() >= 3 and key.size(-3) != query.size(-3):
        # The CUDA kernels read the shared K/V heads in place; expanding them here adds two
        # K/V-sized copies per layer, small next to what the math path would keep.
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    if query.dim() != 4:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out[0]


_ORIGINAL_SDPA = F.scaled_dot_product_attention
_ORIGINAL_DROPOUT = F.dropout


def _target_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    # CUDA's fused path (what at::dropout takes for 0 < p < 1 on a CUDA tensor): a bool mask is saved.
    if training and not inplace and 0.0 < p < 1.0 and input.numel() > 0 and input.is_floating_point():
        return torch.native_dropout(input, p, True)[0]
    return _ORIGINAL_DROPOUT(input, p, training, inplace)


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_CAPABILITY = [sdpa.DEFAULT_CAPABILITY]  # the target GPU's, while target_attention is active


def cuda_choice(*args: Any, **kwargs: Any) -> str:
    """The kernel an SDPA call with these arguments gets on the target GPU (sdpa.FLASH / EFFICIENT / MATH)."""
    call = dict(zip(_NAMES, args), **kwargs)
    query, key, value = call["query"], call["key"], call["value"]
    heads_differ = query.dim() >= 3 and key.size(-3) != query.size(-3)
    return sdpa.cuda_backend(
        query.dtype,
        mask=call.get("attn_mask") is not None,
        gqa=bool(call.get("enable_gqa", False)) and heads_differ,
        head_dim=query.size(-1),
        value_head_dim=value.size(-1),
        capability=_CAPABILITY[0],
        dropout=float(call.get("dropout_p", 0.0) or 0.0),
        causal_non_square=bool(call.get("is_causal", False)) and query.size(-2) != key.size(-2),
        requires_grad=query.requires_grad or key.requires_grad or value.requires_grad,
    )


def _math(*args: Any, **kwargs: Any) -> torch.Tensor:
    # The math kernel as torch composes it: softmax(QK^T) is materialised and kept for the backward.
    call = dict(zip(_NAMES, args), **kwargs)
    return torch.ops.aten._scaled_dot_product_attention_math(
        call["query"],
        call["key"],
        call["value"],
        call.get("attn_mask"),
        float(call.get("dropout_p", 0.0) or 0.0),
        bool(call.get("is_causal", False)),
        scale=call.get("scale"),
        enable_gqa=bool(call.get("enable_gqa", False)),
    )[0]


def _target_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    if cuda_choice(*args, **kwargs) == sdpa.MATH:
        return _math(*args, **kwargs)
    try:
        out = _flash(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        out = None  # an argument the flash op does not take: the planning machine's own kernel
    return _ORIGINAL_SDPA(*args, **kwargs) if out is None else out


@contextlib.contextmanager
def target_attention(target: str, capability: Tuple[int, int] = sdpa.DEFAULT_CAPABILITY) -> Iterator[None]:
    """Inside: SDPA and dropout save what they save on `target` ("cuda": the kernel torch picks on a GPU
    of `capability` -- flash / memory-efficient attention, or math where neither takes the call --
    and dropout's bool mask; "cpu": unchanged).

    The module attribute is swapped (not a TorchFunctionMode): torch.nn.functional's own wrappers
    (multi_head_attention_forward) call SDPA by its module-level name, and a function mode is
    switched off inside the wrapper it intercepts. Code that imported the function object itself
    before planning keeps the CPU kernel.
    """
    if target != "cuda" or F.scaled_dot_product_attention is _target_sdpa:
        yield
        return
    F.scaled_dot_product_attention, F.dropout = _target_sdpa, _target_dropout
    previous, _CAPABILITY[0] = _CAPABILITY[0], tuple(capability)
    try:
        with sdpa.planning_target(capability):
            yield
    finally:
        F.scaled_dot_product_attention, F.dropout = _ORIGINAL_SDPA, _ORIGINAL_DROPOUT
        _CAPABILITY[0] = previous


def hf_attention_for_trace(config: Any, original: Any = None) -> None:
    """A config asking for flash-attention 2/3 is built with SDPA (traced as flash under target_attention)."""
    src = original if original is not None else config
    impl = None
    for key in ("_attn_implementation_internal", "_attn_implementation", "attn_implementation"):
        try:
            impl = impl or getattr(src, key, None)
        except Exception:
            pass
    if impl in FLASH_IMPLEMENTATIONS:
        try:
            config._attn_implementation = "sdpa"
        except Exception:  # older transformers: a plain attribute
            config.__dict__["_attn_implementation"] = "sdpa"


__all__ = ["target_attention", "hf_attention_for_trace", "cuda_choice", "FLASH_IMPLEMENTATIONS"]
