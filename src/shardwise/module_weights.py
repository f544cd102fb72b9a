"""`TrainModule.load_from_checkpoint(path, **kwargs)`: a module on the CPU with a checkpoint's weights.

Lightning's classmethod, for every format a shardwise run writes: a "full"
file, a "sharded" (DCP) directory, a DeepSpeed directory (through the reader
its strategy registers). It goes through the checkpoint reader
(checkpoint/reader.py), so the files are verified against their checksums
before anything is decoded, nothing is ever unpickled outside the safe
loader's allow-lists, and the weights are read a group of tensors at a time
instead of the whole checkpoint at once. The module is built as
`cls(**hyper_parameters, **kwargs)` (keyword arguments win; names its
__init__ does not take are dropped unless it takes **kwargs, as Lightning
does), then `configure_model()` runs on the CPU so that layers built there
exist, `on_load_checkpoint(checkpoint)` sees the run's saved state (without
the tensors), and the weights are copied in, cast to the module's dtypes.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Union

import torch

import shardwise.strategies  # noqa: F401 (the strategies package registers DeepSpeed's checkpoint reader)
from shardwise.checkpoint.reader import open_checkpoint

_GROUP_BYTES = 256 * 2**20  # tensors read per call: bounded memory, few calls for a sharded directory


def constructor_arguments(cls: type, hparams: Dict[str, Any], overrides: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments `cls(...)` takes from the saved hyperparameters and the caller's overrides."""
    values = {**hparams, **overrides}
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return values
    return {k: v for k, v in values.items() if k in params and k != "self"}


def _groups(names: List[str], sizes: Dict[str, int]) -> List[List[str]]:
    out: List[List[str]] = [[]]
    total = 0
    for name in names:
        if out[-1] and total + sizes[name] > _GROUP_BYTES:
            out.append([])
            total = 0
        out[-1].append(name)
        total += sizes[name]
    return [g for g in out if g]


def load_from_checkpoint(
    cls: type,
    checkpoint_path: str,
    map_location: Union[None, str, torch.device] = None,
    strict: bool = True,
    **kwargs: Any,
) -> Any:
    """Build `cls` from the checkpoint's hyperparameters (and `kwargs`) and load its weights (module docstring)."""
    reader = open_checkpoint(checkpoint_path)
    saved = reader.trainer_state()
    hparams = dict(saved.get("hyper_parameters") or {})
    module = cls(**constructor_arguments(cls, hparams, kwargs))
    module.hparams.update({**hparams, **kwargs})
    with torch.device("cpu"):
        module.configure_model()
    module.on_load_checkpoint(saved)
    own = module.state_dict()
    infos = {t.name: t for t in reader.tensors()}
    missing = [name for name in own if name not in infos]
    unexpected = [name for name in infos if name not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"{type(module).__name__}.load_from_checkpoint({checkpoint_path!r}): the checkpoint does not match "
            f"the module built from its hyperparameters. Missing from the checkpoint: {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}; not in the module: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''}. Pass strict=False to load what matches."
        )
    wanted = [name for name in own if name in infos]
    for name in wanted:
        if tuple(own[name].shape) != infos[name].shape:
            raise RuntimeError(
                f"load_from_checkpoint: {name} has shape {tuple(infos[name].shape)} in {checkpoint_path} but "
                f"{tuple(own[name].shape)} in the module built from its hyperparameters."
            )
    sizes = {name: infos[name].nbytes for name in wanted}
    with torch.no_grad():
        for group in _groups(wanted, sizes):
            for name, tensor in reader.read(group).items():
                own[name].copy_(tensor)
    if map_location is not None:
        module.to(_device(map_location))
    return module


def _device(map_location: Any) -> Optional[torch.device]:
    if callable(map_location) or isinstance(map_location, dict):
        raise TypeError(
            "load_from_checkpoint(map_location=...) takes a device here (the weights are read on the CPU, then "
            "moved); a function or a dict of devices is not supported."
        )
    return torch.device(map_location)
