"""`shardwise inspect CKPT`: what a checkpoint holds (format, step, world size, tensors), without loading it."""

from __future__ import annotations

import json
from typing import Any

from jsonargparse import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(description="List what a checkpoint holds, without loading its tensors.")
    p.add_argument("ckpt", help="a checkpoint (file or directory), or a checkpoint directory (uses its last)")
    p.add_argument("--limit", type=int, default=50, help="tensors to list (0: all)")
    p.add_argument("--json", type=bool, default=False, help="print the summary as JSON")
    return p


def run(cfg: Any) -> int:
    from shardwise.checkpoint.inspect import describe, render

    summary = describe(cfg.ckpt)
    if cfg.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(render(summary, limit=cfg.limit or len(summary["tensors"])))
    return 0
