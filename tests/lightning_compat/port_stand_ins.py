"""What the Lightning ports need from outside both frameworks, made here so both runs get the same thing.

Lightning's examples download WikiText2 and MNIST and draw images with torchvision. The harness
(port_harness.py) replaces, identically under shardwise and under Lightning: the downloads by same-shaped
synthetic data (each made by its own generator, so the scripts' seeded random stream is untouched), and
torchvision by the three functions the scripts call (`utils.make_grid`, `utils.save_image`,
`transforms.ToTensor`): torchvision's wheels on PyPI are CUDA builds that cannot load beside torch's CPU
wheel, and what these functions make (image grids for TensorBoard and PNG files) enters no compared number.
`torch.cuda.memory_summary()`, which the FSDP guide prints at its end, raises on a machine without CUDA (a
torch behaviour, the same under both); there it is replaced by a line saying so.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import math
import sys
import types
from typing import Any, Iterator, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset, random_split


class SyntheticWikiText2(Dataset):
    """WikiText2's shape without its download: (input, target) blocks of 35 token ids, a vocab_size."""

    def __init__(self, data_dir: Any = None, block_size: int = 35, download: bool = True) -> None:
        self.vocab_size = 1000
        self.block_size = block_size
        generator = torch.Generator().manual_seed(0)  # its own generator: the seeded stream is the script's
        self.data = torch.randint(0, self.vocab_size, (4100 * block_size + 1,), generator=generator)

    def __len__(self) -> int:
        return 4100

    def __getitem__(self, index: int) -> Any:
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class SyntheticMNIST(Dataset):
    """MNIST's shape without its download: 60,000 / 10,000 28 x 28 uint8 images and labels 0-9, each drawn
    on first use from a generator seeded by its index. `transform` is applied to the uint8 image as
    torchvision's ToTensor would be to MNIST's; without one the item is that float image already."""

    def __init__(self, root: Any = None, train: bool = True, download: bool = True, transform: Any = None, **_: Any):
        self.train, self.transform = train, transform

    def __len__(self) -> int:
        return 60000 if self.train else 10000

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index + (0 if self.train else 60000))
        image = torch.randint(0, 256, (28, 28), dtype=torch.uint8, generator=generator)
        label = int(torch.randint(0, 10, (), generator=generator))
        return (self.transform or ToTensor())(image), label


def synthetic_mnist_datamodule(base: type) -> type:
    """Lightning's demos.mnist_datamodule.MNISTDataModule (its splits, seed, batch size, shuffling,
    drop_last) over SyntheticMNIST, on `base` (the framework's LightningDataModule). num_workers defaults to
    0 instead of 16: worker processes change no batch and no random draw, only the start-up time."""

    class MNISTDataModule(base):  # type: ignore[misc, valid-type]
        name = "mnist"

        def __init__(self, data_dir: str = "./data", val_split: int = 5000, num_workers: int = 0,
                     normalize: bool = False, seed: int = 42, batch_size: int = 32) -> None:  # fmt: skip
            super().__init__()
            self.val_split, self.num_workers, self.batch_size = val_split, num_workers, batch_size

        def setup(self, stage: str) -> None:
            dataset = SyntheticMNIST(train=True)
            self.dataset_train, self.dataset_val = random_split(
                dataset, [len(dataset) - self.val_split, self.val_split], generator=torch.Generator().manual_seed(42)
            )

        def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
            return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                              drop_last=True, pin_memory=True)  # fmt: skip

        def train_dataloader(self) -> DataLoader:
            return self._loader(self.dataset_train, True)

        def val_dataloader(self) -> DataLoader:
            return self._loader(self.dataset_val, False)

        def test_dataloader(self) -> DataLoader:
            return self._loader(SyntheticMNIST(train=False), False)

    return MNISTDataModule


class ToTensor:
    """torchvision.transforms.ToTensor for a uint8 H x W image: float C x H x W in [0, 1]."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.unsqueeze(0).float().div(255)


def make_grid(tensor: torch.Tensor, nrow: int = 8, padding: int = 2, normalize: bool = False,
              value_range: Optional[Tuple[float, float]] = None, scale_each: bool = False,
              pad_value: float = 0.0) -> torch.Tensor:  # fmt: skip
    """torchvision.utils.make_grid: B x C x H x W images tiled into one 3 x H' x W' image, nrow per row."""
    tensor = tensor.detach().clone()
    if tensor.size(1) == 1:
        tensor = tensor.repeat(1, 3, 1, 1)
    if normalize:
        for image in tensor if scale_each else [tensor]:
            low, high = value_range if value_range is not None else (float(image.min()), float(image.max()))
            image.clamp_(min=low, max=high).sub_(low).div_(max(high - low, 1e-5))
    count, height, width = tensor.size(0), tensor.size(2) + padding, tensor.size(3) + padding
    columns = min(nrow, count)
    grid = tensor.new_full((3, math.ceil(count / columns) * height + padding, columns * width + padding), pad_value)
    for k in range(count):
        y, x = divmod(k, columns)
        grid[:, y * height + padding : (y + 1) * height, x * width + padding : (x + 1) * width] = tensor[k]
    return grid


def save_image(tensor: torch.Tensor, fp: str, **kwargs: Any) -> None:
    """torchvision.utils.save_image: the grid as an 8-bit PNG."""
    from PIL import Image

    grid = make_grid(tensor, **kwargs) if tensor.dim() == 4 else tensor
    pixels = grid.mul(255).add_(0.5).clamp_(0, 255).permute(1, 2, 0).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(fp)


def _torchvision_modules() -> dict:
    root, utils, transforms = (types.ModuleType(f"torchvision{s}") for s in ("", ".utils", ".transforms"))
    for module in (root, utils, transforms):  # importlib.util.find_spec reads it from sys.modules
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    utils.make_grid, utils.save_image = make_grid, save_image
    transforms.ToTensor = ToTensor
    root.utils, root.transforms = utils, transforms
    return {"torchvision": root, "torchvision.utils": utils, "torchvision.transforms": transforms}


@contextlib.contextmanager
def outside_world() -> Iterator[None]:
    """torchvision's three functions importable, and torch.cuda.memory_summary answering without CUDA,
    for the length of one port's run; whatever was there before is put back."""
    saved = {name: sys.modules.get(name) for name in _torchvision_modules()}
    sys.modules.update(_torchvision_modules())
    summary = torch.cuda.memory_summary
    if not torch.cuda.is_available():
        torch.cuda.memory_summary = lambda *args, **kwargs: "(no CUDA device: no CUDA memory summary)"
    try:
        yield
    finally:
        torch.cuda.memory_summary = summary
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
