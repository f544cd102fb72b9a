"""Test-wide settings: DeepSpeed on CPU, quiet thread pools, a temp HOME for caches."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
