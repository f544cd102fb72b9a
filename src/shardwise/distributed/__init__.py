"""Process bookkeeping: environment detection, local launching, safe collectives."""

from shardwise.distributed.env import DistEnv, detect_env
from shardwise.distributed.launch import launch

__all__ = ["DistEnv", "detect_env", "launch"]
