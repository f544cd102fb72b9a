"""`shardwise inspect CKPT`: whether every file of a checkpoint is intact, and what it holds, without loading it.

Exit status 0 when every file verifies, 1 when any is damaged, missing or
from another run (the report says which, on stdout; the first problem is
repeated on stderr). --no-verify skips the hashing and only describes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from jsonargparse import ArgumentParser


def parser() -> ArgumentParser:
    p = ArgumentParser(description="Verify a checkpoint's files and list what it holds, without loading its tensors.")
    p.add_argument("ckpt", help="a checkpoint (file or directory), or a checkpoint directory (uses its last)")
    p.add_argument("--limit", type=int, default=50, help="tensors to list (0: all)")
    p.add_argument("--json", type=bool, default=False, help="print the summary as JSON")
    p.add_argument("--no_verify", type=bool, default=False, help="do not check the files' sha256 (describe only)")
    return p


def run(cfg: Any) -> int:
    from shardwise.checkpoint.inspect import describe, problems, render

    summary = describe(cfg.ckpt, verify_files=not cfg.no_verify)
    if cfg.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(render(summary, limit=cfg.limit or len(summary.get("tensors", []))))
    if summary["ok"]:
        return 0
    found = problems(summary)
    print(f"shardwise inspect: error: {found[0] if found else 'the checkpoint is not intact'}", file=sys.stderr)
    return 1
