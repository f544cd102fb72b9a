"""The worker side of tests/recipes/conftest.py's shared launch: several files' runs in one pair of processes.

Module-level so that the launched workers import it (a module named conftest is not importable from them).
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence, Tuple


def run_in_turn(jobs: Sequence[Tuple[Callable[..., Any], Sequence[Any]]]) -> List[Any]:
    """Worker of shardwise.launch: each job's `fn(*args)` in turn; a process group one leaves is taken down
    (on every rank together) so the next starts as in a launch of its own."""
    import sys

    import torch.distributed as dist

    out = []
    for fn, args in jobs:
        out.append(fn(*args))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            if "deepspeed.utils.groups" in sys.modules:
                # DeepSpeed caches the groups it derived from the one just destroyed (world, data-parallel);
                # DeepSpeedStrategy.teardown drops them when it destroys its group, as here.
                release = getattr(sys.modules["deepspeed.utils.groups"], "_release_process_group_references", None)
                if release is not None:
                    release(group=None)
    return out
