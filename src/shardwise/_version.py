"""The package version, in a module that imports nothing, so the checkpoint manifest can record it
without importing the package root (and with it the Trainer). Keep it equal to pyproject.toml's."""
__version__ = "0.1.0"
