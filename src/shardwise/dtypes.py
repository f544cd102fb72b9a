"""The dtype names a user may type (`--dtype bf16`, `export_dtype="float16"`) and the torch dtype each means.

One table, so that `shardwise convert`, the fine-tuning recipe's export and
anything else that casts weights accept the same spellings. Names inside
files (safetensors' "BF16") are the safetensors library's business.
"""

from __future__ import annotations

from typing import Optional

import torch

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
KEEP = "keep"  # no cast
CAST_CHOICES = (KEEP, *DTYPES)


def cast_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The torch dtype `name` means; None for None or "keep" (leave tensors as they are)."""
    if name is None or name == KEEP:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: use one of {', '.join(CAST_CHOICES)}.")
    return DTYPES[name]
