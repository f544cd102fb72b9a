"""The package version, in a module that imports nothing: pyproject.toml reads it from here, and
the checkpoint manifest records it without importing the package root (and with it the Trainer)."""

__version__ = "0.1.0"
