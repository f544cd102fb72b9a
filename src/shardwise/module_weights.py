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
A module that saved one dict or Namespace argument (`save_hyperparameters(config)`)
and whose __init__ takes none of its keys gets it back as that one argument.

`record_hyperparameters` is save_hyperparameters with Lightning's rules (which
arguments, names, a dict or Namespace, `ignore`), shared by the TrainModule and
the DataModule: what it records is what this loader rebuilds from.
"""

from __future__ import annotations

import argparse
import inspect
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

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
    named = [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [n for n in named if params[n].default is inspect.Parameter.empty and n not in overrides]
    if hparams and not any(k in named for k in hparams) and len(required) == 1:
        # save_hyperparameters(config): the dict (or Namespace) was one argument; Lightning passes it back so.
        from shardwise.utilities import AttributeDict

        return {required[0]: AttributeDict(hparams), **{k: v for k, v in overrides.items() if k in named}}
    return {k: v for k, v in values.items() if k in named}


def _init_frames_arguments(obj: Any, frame: Optional[types.FrameType]) -> Dict[str, Any]:
    """The arguments of every __init__ of `obj` on the stack from `frame` outwards, the outermost (the most
    derived class's) winning, **kwargs flattened: Lightning's collect_init_args."""
    found: List[Dict[str, Any]] = []
    while frame is not None:
        info = inspect.getargvalues(frame)
        if frame.f_code.co_name == "__init__" and info.args and info.locals.get(info.args[0]) is obj:
            args = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
            if info.keywords:
                args.update(info.locals.get(info.keywords) or {})
            found.append(args)
        elif found:
            break  # past the constructor chain
        frame = frame.f_back
    out: Dict[str, Any] = {}
    for args in found:  # innermost first: the most derived class's values win
        out.update(args)
    for name in ("frame", "__class__"):
        out.pop(name, None)
    return out


def record_hyperparameters(
    obj: Any,
    args: Sequence[Any],
    ignore: Union[None, str, Sequence[str]],
    frame: Optional[types.FrameType],
    values: Dict[str, Any],
) -> None:
    """save_hyperparameters(*args, ignore=, frame=) as Lightning's, into `obj.hparams` (updated, not replaced).

    No args: every __init__ argument; names: those; one dict / Namespace: its items. `values` (keywords,
    shardwise's older form) are recorded as given. ignore: names left out (and removed if recorded before).
    """
    if ignore is None:
        ignored: List[str] = []
    elif isinstance(ignore, str):
        ignored = [ignore]
    elif isinstance(ignore, (list, tuple, set)):
        ignored = [name for name in ignore if isinstance(name, str)]
    else:
        raise TypeError(f"save_hyperparameters(ignore={ignore!r}): pass a name or a list of names.")
    if values and not args:
        recorded: Any = dict(values)
    else:
        caller = frame or inspect.currentframe().f_back.f_back  # type: ignore[union-attr]
        init_args = _init_frames_arguments(obj, caller)
        others = [a for a in args if not isinstance(a, str)]
        if not args:
            recorded = init_args
        elif len(others) == 1 and len(args) == 1:
            recorded = others[0]
        elif others:
            raise TypeError(
                "save_hyperparameters() takes argument names (strings) or one dict / Namespace, "
                f"not {', '.join(type(a).__name__ for a in others)} among names."
            )
        else:
            missing = [a for a in args if a not in init_args]
            if missing:
                raise ValueError(
                    f"save_hyperparameters({', '.join(map(repr, args))}): {missing} are not arguments of "
                    f"{type(obj).__name__}.__init__ (it takes {sorted(init_args)})."
                )
            recorded = {a: init_args[a] for a in args}
        if isinstance(recorded, argparse.Namespace):
            recorded = vars(recorded)
        if not isinstance(recorded, dict):
            raise ValueError(
                f"save_hyperparameters({recorded!r}): hyperparameters are a dict, an argparse Namespace or "
                f"__init__ argument names, not a single {type(recorded).__name__}."
            )
        recorded = {**recorded, **values}
    hparams = obj.hparams
    hparams.update({k: v for k, v in recorded.items() if k not in ignored})
    for name in ignored:  # a subclass may drop what its base class recorded
        hparams.pop(name, None)
    modules = sorted(k for k, v in hparams.items() if isinstance(v, torch.nn.Module))
    if modules:
        # A checkpoint keeps plain data only (it is loaded without executing code), so such a value comes back
        # as its repr and load_from_checkpoint could not rebuild the module from it; its weights are saved anyway.
        warnings.warn(
            f"save_hyperparameters: {modules} are nn.Module instances, whose weights the checkpoint saves anyway "
            f"and which a checkpoint cannot hold as hyperparameters; leave them out with "
            f"self.save_hyperparameters(ignore={modules}).",
            stacklevel=3,
        )


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
    module.hparams.update({**hparams, **kwargs})  # a module that saved no hyperparameters still shows them
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
