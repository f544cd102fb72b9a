"""ModelSummary: the table of a module's layers and parameter counts Lightning prints when fit starts.

`ModelSummary(max_depth=1)` (and `RichModelSummary`, the same table here)
prints, on global rank 0 at on_fit_start, each submodule down to
`max_depth` with its type and parameter count, then the trainable,
non-trainable and total counts and their size in MB. The counts are the
whole model's under every strategy: a sharded parameter (an FSDP DTensor, a
ZeRO-3 partition) counts its full size, not this rank's shard.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

from torch import nn

from shardwise.callbacks.base import Callback


def full_size(p: nn.Parameter) -> int:
    """A parameter's element count in the whole model (a DTensor's shape is global; ZeRO-3 keeps ds_numel)."""
    ds_numel = getattr(p, "ds_numel", None)
    return int(ds_numel) if ds_numel is not None else math.prod(p.shape)


def summary_rows(module: nn.Module, max_depth: int) -> List[Tuple[str, str, int, bool]]:
    """(name, type, parameters, training) for every submodule down to max_depth (-1: all)."""
    rows = []
    for name, child in module.named_modules():
        depth = name.count(".") + 1
        if not name or (max_depth >= 0 and depth > max_depth):
            continue
        rows.append((name, type(child).__name__, sum(full_size(p) for p in child.parameters()), child.training))
    return rows


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(int(n))


def render_summary(module: nn.Module, max_depth: int = 1) -> str:
    """The table and totals ModelSummary prints."""
    rows = summary_rows(module, max_depth)
    params = list(module.parameters())
    trainable = sum(full_size(p) for p in params if p.requires_grad)
    total = sum(full_size(p) for p in params)
    size_mb = sum(full_size(p) * p.element_size() for p in params) / 1e6
    table = [("", "Name", "Type", "Params", "Mode")] + [
        (str(i), name, kind, _count(n), "train" if training else "eval")
        for i, (name, kind, n, training) in enumerate(rows)
    ]
    widths = [max(len(r[c]) for r in table) for c in range(5)]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    lines.insert(1, "-" * max(len(line) for line in lines))
    lines += [
        "-" * max(len(line) for line in lines),
        f"{_count(trainable):<8} Trainable params",
        f"{_count(total - trainable):<8} Non-trainable params",
        f"{_count(total):<8} Total params",
        f"{size_mb:<8.3f} Total estimated model params size (MB)",
    ]
    return "\n".join(lines)


class ModelSummary(Callback):
    """Print the module's layers and parameter counts when fit starts (global rank 0)."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"ModelSummary(max_depth={max_depth!r}): use -1 (every layer), 0 (none) or more.")
        self.max_depth = max_depth
        self.summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if self.max_depth == 0 or not trainer.is_global_zero:
            return
        print(render_summary(pl_module, self.max_depth))


class RichModelSummary(ModelSummary):
    """Lightning's rich-rendered ModelSummary; the same table here."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
