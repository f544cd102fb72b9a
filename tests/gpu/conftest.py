"""GPU suite settings: DeepSpeed on CUDA (tests/conftest.py points it at the CPU for the CPU suite).

An inherited DS_ACCELERATOR=cpu with a model on CUDA is refused by
shardwise (strategies/deepspeed_env.py ensure_accelerator_env), so the GPU suite
drops the one tests/conftest.py set, before any worker inherits it.
"""

import os

import gpu_common

if gpu_common.DEVICE_TYPE == "cuda" and os.environ.get("DS_ACCELERATOR") == "cpu":
    import torch

    if torch.cuda.is_available():
        del os.environ["DS_ACCELERATOR"]
