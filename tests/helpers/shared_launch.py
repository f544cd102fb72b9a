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


def init_process_group() -> None:
    """`dist.init_process_group("gloo")` for a worker's own group, kept over several runs (a strategy adopts a
    group it did not create and leaves it at its teardown), on a store prefix of its own.

    torch names a default group created again in the same process as it named the first ("0"), on the
    launcher's store, which outlives it: a second plain `init_process_group` in a worker of the shared launch
    (test_lora.py's runs, then test_moe_expert_parallel.py's) read the first group's peer addresses, and both
    ranks then waited in their first barrier until the test timed out. shardwise's strategies create their
    groups on a prefix per generation (strategies/base.py `generation_store`); this does the same.
    """
    import torch.distributed as dist

    from shardwise.distributed.env import detect_env
    from shardwise.strategies.base import generation_store

    env = detect_env()
    if env is None:
        raise RuntimeError("init_process_group() is for a launched worker (RANK and WORLD_SIZE are not set)")
    dist.init_process_group("gloo", store=generation_store(env, 600.0), rank=env.global_rank, world_size=env.world_size)
