"""Selective activation checkpointing, torchtitan's two flavours, beside full per-block checkpointing.

Full checkpointing keeps only each block's input and recomputes the whole
block in backward: the least memory, one extra forward of compute.
Selective checkpointing buys back most of that compute for a little memory:

- "op" (per operator): inside every checkpointed block, the outputs of the
  expensive ops -- matrix multiplies and attention -- are saved, the cheap
  element-wise ops (norms, activations, residual adds) are recomputed. As in
  torchtitan, every second plain `mm` is recomputed too, which roughly halves
  the saved matmul outputs at the cost of a few recomputed matmuls.
  (torch.utils.checkpoint.create_selective_checkpoint_contexts)
- an integer N (per layer): only every N-th selected block is checkpointed
  (fully); the others keep all their activations.

`checkpoint_kwargs(mode, option)` returns what `checkpoint_wrapper` needs for
a block, or None when that block is not to be checkpointed.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial
from typing import Any, Dict, Optional, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

MODES = ("full", "selective")

_aten = torch.ops.aten
# The ops whose outputs "op" mode saves (torchtitan's list, without the CUDA-only collectives).
SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten.max.default,  # fp8-style amax reductions: cheap to keep, costly to recompute
}


def normalize(mode: str, option: Union[str, int, None]) -> tuple:
    """("full", None) | ("selective", "op") | ("selective", N>=1); raises with the valid choices."""
    mode = str(mode).lower()
    if mode not in MODES:
        raise ValueError(
            f"activation_checkpointing_mode={mode!r}: use 'full' (recompute each selected block) or "
            "'selective' (with selective_ac_option='op' or an integer N)."
        )
    if mode == "full":
        return "full", None
    option = "op" if option is None else option
    if isinstance(option, str) and option.strip().isdigit():
        option = int(option)
    if option == "op" or (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
        return "selective", option
    raise ValueError(
        f"selective_ac_option={option!r}: use 'op' (save matmul / attention outputs, recompute the "
        "rest) or an integer N >= 1 (checkpoint every N-th block)."
    )


def _op_context():
    counts: Dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        # Count mm calls separately in forward and in recompute so both make the same choices.
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == _aten.mm.default:
            counts[phase] += 1
        save = func in SAVE_OPS and not (func == _aten.mm.default and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_kwargs(mode: str, option: Union[str, int, None], index: int) -> Optional[dict]:
    """Keyword arguments for checkpoint_wrapper for the `index`-th selected block, or None to leave it alone."""
    if mode == "full":
        return {}
    if option == "op":
        return {"context_fn": partial(_op_context)}  # a fresh mm counter per checkpointed call
    return {} if index % int(option) == 0 else None
