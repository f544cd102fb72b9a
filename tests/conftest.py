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
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_USER_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_USER_CACHE, "torch_extensions"))
SESSION_HOME = tempfile.mkdtemp(prefix="shardwise-tests-home-")
os.environ.update({
    "HOME": SESSION_HOME,
    "XDG_CACHE_HOME": os.path.join(SESSION_HOME, ".cache"),
    "XDG_CONFIG_HOME": os.path.join(SESSION_HOME, ".config"),
    "HF_HOME": os.path.join(SESSION_HOME, ".cache", "huggingface"),
})


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_HOME, ignore_errors=True)
