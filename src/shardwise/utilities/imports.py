"""`lightning.pytorch.utilities.imports` after the import rename: whether optional packages Lightning's examples
test for are installed. As in Lightning, a flag says whether the distribution is installed (its metadata),
without importing it."""

from importlib.metadata import PackageNotFoundError, version


def _installed(distribution: str) -> bool:
    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


_TORCHVISION_AVAILABLE = _installed("torchvision")

__all__ = ["_TORCHVISION_AVAILABLE"]
