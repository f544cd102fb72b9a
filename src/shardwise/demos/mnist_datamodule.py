"""`lightning.pytorch.demos.mnist_datamodule`'s names, refused by name: they download MNIST, and shardwise never
downloads. Build the data set yourself (torchvision.datasets.MNIST(root, download=True) where downloading
is fine, or tensors of the same shape, 1 x 28 x 28 images and integer labels) and pass its loaders."""

from __future__ import annotations

from shardwise.utilities.refusal import build_refused_class, build_refused_function

__all__ = ["MNIST", "MNISTDataModule"]

_WHY = (
    "it downloads MNIST, and shardwise never downloads; use torchvision.datasets.MNIST(root, download=True) or "
    "same-shaped tensors (1 x 28 x 28 images, integer labels) in a DataLoader of your own"
)
MNIST = build_refused_function("MNIST", __name__, _WHY)
MNISTDataModule = build_refused_class("MNISTDataModule", __name__, _WHY)
