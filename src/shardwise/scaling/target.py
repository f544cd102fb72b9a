"""What `shardwise check` runs: the user's TrainModule and its data, named so that every process builds the same.

The check runs the module in this process (the one-process reference) and in N
worker processes started by `shardwise.launch`, so the module is described by
something each process can build from: an import path (`pkg.mod.Class`, with
or without `python:`), a script (`train.py`, or `train.py:Class` when it
defines several TrainModules; imported, not run: its `if __name__ ==
"__main__":` block stays untouched), a class or factory importable by the
workers, or an instance (copied). Init args go through jsonargparse against the
class's signature, as `shardwise fit` does, so `--init_args.n_layer 2` is typed
and a misspelt name is refused before any process starts.

The data is a Dataset, a DataLoader, or the module's own `train_dataloader()`.
Each run gets it with its own batch size -- the micro-batch on N ranks, the
whole global batch in the reference -- by rebuilding the same loader (same
dataset, sampler, collate function), so that the shuffling is the user's own.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from torch.utils.data import DataLoader, Dataset, IterableDataset

from shardwise.data import rebuild
from shardwise.module import TrainModule


class CheckSetupError(ValueError):
    """The module or data given to `shardwise check` cannot be built; the message says how to name them."""


@dataclass
class ModuleSource:
    """The user's TrainModule: an import path or script (str), a class or factory, or an instance, plus init args."""

    target: Any
    init_args: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.target, str):  # a script's path, absolute: the workers may start elsewhere
            path, colon, name = self.target.partition(":") if ".py:" in self.target else (self.target, "", "")
            if path.endswith(".py"):
                self.target = os.path.abspath(path) + colon + name

    def describe(self) -> str:
        if isinstance(self.target, str):
            return self.target
        if isinstance(self.target, TrainModule):
            return f"{type(self.target).__module__}.{type(self.target).__qualname__} (instance)"
        return f"{getattr(self.target, '__module__', '?')}.{getattr(self.target, '__qualname__', self.target)}"

    def factory(self) -> Any:
        """The class, factory or instance this source names (imports a script or module if needed)."""
        return load_target(self.target) if isinstance(self.target, str) else self.target

    def validate(self) -> None:
        """Refuse an unknown name or a mistyped init arg now, before any process starts."""
        target = self.factory()
        if inspect.isclass(target) and self.init_args:
            _parse_init_args(target, self.init_args)

    def build(self) -> TrainModule:
        target = self.factory()
        if isinstance(target, TrainModule):
            if self.init_args:
                raise CheckSetupError("init_args apply to a class or factory, not to a module instance.")
            module = copy.deepcopy(target)
        elif inspect.isclass(target) and self.init_args:
            module = _parse_init_args(target, self.init_args, instantiate=True)
        elif callable(target):
            module = target(**self.init_args)
        else:
            raise CheckSetupError(f"{self.describe()} is a {type(target).__name__}, not a TrainModule class.")
        if not isinstance(module, TrainModule):
            raise CheckSetupError(
                f"{self.describe()} built a {type(module).__name__}; `shardwise check` needs a shardwise.TrainModule."
            )
        if _attached(module):
            raise CheckSetupError(
                f"This {type(module).__name__} was already set up by a Trainer; pass its class (or a fresh instance)."
            )
        return module


def _attached(module: TrainModule) -> bool:
    try:
        module.trainer
    except RuntimeError:  # "not attached to a Trainer yet"
        return False
    return True


def _parse_init_args(cls: type, init_args: Dict[str, Any], instantiate: bool = False) -> Any:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, "init")
    try:
        cfg = parser.parse_object({"init": init_args})
    except Exception as exc:  # jsonargparse's ArgumentError: the argument's name and what was wrong
        raise CheckSetupError(f"init args for {cls.__name__}: {exc}".replace("\n", " ")) from None
    if not instantiate:
        return cfg
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes  # jsonargparse < 4.49
    return build(cfg).init


def load_target(spec: str) -> Any:
    """`pkg.mod.Class`, `python:pkg.mod.Class`, `train.py` or `train.py:Class` -> the object it names."""
    spec = spec[len("python:") :] if spec.startswith("python:") else spec
    path, _, name = spec.partition(":") if ".py:" in spec else (spec, "", "")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise CheckSetupError(f"{path}: no such script.")
        module = _import_script(path)
        return getattr(module, name) if name else _only_train_module(module, path)
    module_name, _, attr = spec.rpartition(".")
    if not module_name:
        raise CheckSetupError(f"{spec!r}: name the class as package.module.ClassName, or give a script path.")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise CheckSetupError(f"{spec}: cannot import it ({exc}).") from exc


def _import_script(path: str) -> ModuleType:
    """Import a script under a fixed name (once per process), its folder on sys.path for its own imports."""
    path = os.path.abspath(path)
    name = "shardwise_check_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    if name in sys.modules:
        return sys.modules[name]
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _only_train_module(module: ModuleType, path: str) -> type:
    found: List[type] = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, TrainModule) and obj.__module__ == module.__name__
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckSetupError(f"{path} defines no TrainModule subclass.")
    names = ", ".join(sorted(c.__name__ for c in found))
    raise CheckSetupError(f"{path} defines several TrainModules ({names}): name one, {path}:{found[0].__name__}.")


@dataclass
class DataSource:
    """The training data: a Dataset, a DataLoader, or None for the module's own train_dataloader()."""

    data: Any = None
    batch_size: Optional[int] = None  # the micro-batch per rank; None: the loader's (4 for a bare Dataset)
    shuffle: Optional[bool] = None  # a bare Dataset only; None: shuffled, as `shardwise fit` does

    def user_loader(self, module: TrainModule) -> Any:
        if self.data is None:
            make: Optional[Callable[[], Any]] = getattr(module, "train_dataloader", None)
            if not callable(make):
                raise CheckSetupError(
                    f"{type(module).__name__} has no train_dataloader(): give the data (--data, or data= in "
                    "Python), or define train_dataloader() on the module."
                )
            return make()
        if isinstance(self.data, DataLoader):
            return self.data
        if isinstance(self.data, Dataset):
            shuffle = True if self.shuffle is None else self.shuffle
            return DataLoader(self.data, batch_size=self.batch_size or 4, shuffle=shuffle)
        raise CheckSetupError(f"data must be a Dataset or a DataLoader, got {type(self.data).__name__}.")

    def loader(self, module: TrainModule, scale: int) -> "tuple[DataLoader, int]":
        """(the loader with `scale` micro-batches per batch, the micro-batch size)."""
        loader = self.user_loader(module)
        if not isinstance(loader, DataLoader):
            raise CheckSetupError(
                f"The training data is a {type(loader).__name__}; `shardwise check` needs a torch DataLoader, "
                "whose batch size it can change for the one-process run."
            )
        if loader.batch_size is None:
            raise CheckSetupError(
                "The DataLoader has a batch_sampler, so `shardwise check` cannot give the one-process run the "
                "global batch: use batch_size= (with a sampler= if the order is your own)."
            )
        micro = self.batch_size or loader.batch_size
        if micro * scale == loader.batch_size:
            return loader, micro
        if isinstance(loader.dataset, IterableDataset):  # no sampler to keep: the dataset orders itself
            return rebuild(loader, batch_size=micro * scale), micro
        return rebuild(loader, sampler=loader.sampler, batch_size=micro * scale), micro


def samples_available(loader: DataLoader) -> Optional[int]:
    """The dataset's length, or None when it has none (an IterableDataset)."""
    try:
        return len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
