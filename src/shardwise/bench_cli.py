"""`shardwise bench NAME [args]`: run one of the benchmark scripts behind BENCHMARKS.md.

The scripts live in the source checkout's benchmarks/ folder (they are not
part of the installed package); each prints the markdown table recorded in
BENCHMARKS.md together with the command and date.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional


def _bench_dir() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    candidate = os.path.normpath(os.path.join(here, "..", "..", "benchmarks"))
    return candidate if os.path.isdir(candidate) else None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(argv or [])
    folder = _bench_dir()
    if folder is None:
        print("shardwise bench: the benchmarks ship with the source checkout (benchmarks/); "
              "install shardwise from a clone with `pip install -e .`.", file=sys.stderr)
        return 2
    names = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_"))
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: shardwise bench NAME [args]\n\nbenchmarks: " + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"shardwise bench: unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [os.path.join(folder, name + ".py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0
