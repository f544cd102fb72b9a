"""Test-wide settings: DeepSpeed on CPU, quiet thread pools, a temporary HOME for the session.

Set at import, before any test module imports transformers or DeepSpeed, and in os.environ, so the
worker processes the tests start inherit them. The temporary HOME (and the XDG and Hugging Face
directories under it) keeps the suite from reading the user's own configuration (an Accelerate
default config, a Hugging Face token) and from writing into their caches. One cache is kept: the
C++ ops DeepSpeed compiles (DeepSpeedCPUAdam, minutes on 2 cores), which depend on the torch build,
not on the user.
"""

import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _compiled_ops_dir() -> str:
    """Where torch keeps compiled C++ ops for this user and build: with TORCH_EXTENSIONS_DIR unset,
    the user cache's torch_extensions/py<ver>_<accelerator> (a set TORCH_EXTENSIONS_DIR is used as is)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{version}_{accelerator}")


os.environ.setdefault("TORCH_EXTENSIONS_DIR", _compiled_ops_dir())  # before HOME moves: the user's cache
SESSION_HOME = tempfile.mkdtemp(prefix="shardwise-tests-home-")
os.environ.update(
    {
        "HOME": SESSION_HOME,
        "XDG_CACHE_HOME": os.path.join(SESSION_HOME, ".cache"),
        "XDG_CONFIG_HOME": os.path.join(SESSION_HOME, ".config"),
        "HF_HOME": os.path.join(SESSION_HOME, ".cache", "huggingface"),
    }
)


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A Trainer under FSDP or DeepSpeed in this process creates a private process group of one that lives
    until exit (as it would in a user's script); between tests it would make the next one that needs its
    own group (the planner's fake world, another strategy) fail for a reason that is not its own."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
