"""Lightning's rank-zero helpers: run a function, print or warn on global rank 0 only.

`from lightning.pytorch.utilities.rank_zero import rank_zero_only` ports as
`from shardwise.utilities.rank_zero import rank_zero_only`. The rank is asked of
the process's launch environment at each call (distributed/env.py), so the
helpers are right before and after the process group starts; a script that
sets `rank_zero_only.rank` itself, as some Lightning code does, is obeyed.

A function wrapped by `rank_zero_only` carries a mark (`RANK_ZERO_MARK`): when the
Trainer calls a callback or module hook so marked while the model's parameters
are sharded across ranks (FSDP), every rank first gathers them whole, rank 0 runs
the hook and every rank shards them again (trainer/hooks.py), so a forward inside
it runs on rank 0 alone instead of waiting for the other ranks' shards.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any, Callable, Optional, TypeVar

from shardwise.distributed import env

T = TypeVar("T")

# The attribute rank_zero_only sets on the function it returns (read through bound methods too).
RANK_ZERO_MARK = "_shardwise_rank_zero_only"

log = logging.getLogger("shardwise")


def _rank() -> int:
    rank = getattr(rank_zero_only, "rank", None)
    return env.global_rank() if rank is None else int(rank)


def rank_zero_only(fn: Callable[..., T], default: Optional[T] = None) -> Callable[..., Optional[T]]:
    """Decorator: call `fn` on global rank 0; elsewhere return `default` without calling it."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Optional[T]:
        if _rank() == 0:
            return fn(*args, **kwargs)
        return default

    setattr(wrapped, RANK_ZERO_MARK, True)
    return wrapped


rank_zero_only.rank = None  # type: ignore[attr-defined]  # None: the launch environment's global rank


def rank_prefixed_message(message: str, rank: Optional[int]) -> str:
    return f"[rank: {rank}] {message}" if rank is not None else message


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 3, **kwargs: Any) -> None:
    log.info(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 3, **kwargs: Any) -> None:
    log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_warn(message: Any, stacklevel: int = 3, **kwargs: Any) -> None:
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_deprecation(message: Any, stacklevel: int = 3, **kwargs: Any) -> None:
    kwargs.setdefault("category", DeprecationWarning)
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


__all__ = [
    "RANK_ZERO_MARK",
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
