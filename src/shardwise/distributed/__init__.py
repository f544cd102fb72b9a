"""Process bookkeeping: environment detection, the launch context, local launching, safe collectives."""

from shardwise.distributed.context import LaunchContext
from shardwise.distributed.env import DistEnv, detect_env, global_rank, is_global_zero
from shardwise.distributed.launch import launch

__all__ = ["DistEnv", "LaunchContext", "detect_env", "global_rank", "is_global_zero", "launch"]
