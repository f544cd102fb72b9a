"""`shardwise.utilities`: the helpers Lightning scripts import from `lightning.pytorch.utilities`.

The rank-zero helpers (rank_zero.py), `grad_norm` (the per-parameter and
total gradient norms a module logs in on_before_optimizer_step),
`AttributeDict` (the type of `self.hparams`: keys read as attributes),
`move_data_to_device`, and the type names (types.py). The rest of
Lightning's list is importable and refuses by name when used
(refusal.py), saying what to use instead.
"""

from __future__ import annotations

import os
import pickle
import warnings
from enum import Enum
from typing import Any, Dict, Union

import torch
from torch.distributed.tensor import DTensor

from shardwise.distributed.device import move_to_device
from shardwise.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from shardwise.utilities.refusal import NotProvidedError, build_refused_class, build_refused_function

_HERE = "shardwise.utilities"


class AttributeDict(Dict[str, Any]):
    """A dict whose keys are also attributes: `hparams.lr` and `hparams["lr"]` (Lightning's AttributeDict)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{key}'") from None

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(k)) for k in self)
        return "\n".join(f'{"":4}"{k}":{"":{width - len(str(k)) + 1}}{v}' for k, v in sorted(self.items()))


def grad_norm(module: torch.nn.Module, norm_type: Union[float, int, str], group_separator: str = "/") -> Dict[str, Any]:
    """Each parameter's gradient norm and their total norm, keyed as Lightning keys them
    (`grad_2.0_norm/<name>`, `grad_2.0_norm_total`). Sharded gradients (FSDP) are measured whole,
    which is a collective: call it on every rank, as from on_before_optimizer_step."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"grad_norm: norm_type must be a positive number or 'inf' (infinity norm), got {norm_type}")
    norms = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        norm = p.grad.detach().norm(norm_type)
        norms[f"grad_{norm_type}_norm{group_separator}{name}"] = (
            norm.full_tensor() if isinstance(norm, DTensor) else norm
        )
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack([n.float().cpu() for n in norms.values()]).norm(norm_type)
    return norms


def move_data_to_device(batch: Any, device: Union[str, torch.device]) -> Any:
    """Every tensor in `batch` (nested lists, tuples, dicts, dataclasses) moved to `device`."""
    return move_to_device(batch, torch.device(device) if isinstance(device, str) else device)


class LightningEnum(str, Enum):
    """An enum whose members compare equal to their string values, case-insensitively."""

    def __eq__(self, other: object) -> bool:
        other = other.value if isinstance(other, Enum) else str(other)
        return self.value.lower() == other.lower()

    def __hash__(self) -> int:
        return hash(self.value.lower())


class GradClipAlgorithmType(LightningEnum):
    VALUE = "value"
    NORM = "norm"


def is_picklable(obj: object) -> bool:
    try:
        pickle.dumps(obj)
        return True
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False


def suggested_max_num_workers(local_world_size: int) -> int:
    """DataLoader workers per process: the CPUs this process may use, shared by the node's processes, less one."""
    if local_world_size < 1:
        raise ValueError(f"suggested_max_num_workers: local_world_size must be >= 1, got {local_world_size}")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_world_size - 1)


def disable_possible_user_warnings(module: str = "") -> None:
    """Silence the advisory warnings a library raises for the user (Lightning's PossibleUserWarning);
    shardwise raises none of that category, so this only filters UserWarnings from `module`'s code."""
    warnings.filterwarnings("ignore", category=UserWarning, module=module or "shardwise")


CombinedLoader = build_refused_class(
    "CombinedLoader",
    _HERE,
    "the Trainer trains on one loader. Combine the datasets into one (torch.utils.data.ConcatDataset, or a "
    "Dataset whose __getitem__ returns a dict of samples), or pass a list of loaders to validate / test.",
)
measure_flops = build_refused_function(
    "measure_flops",
    _HERE,
    "the Trainer measures FLOPs itself (TFLOP/s and MFU are logged at every log step, callbacks/throughput.py); "
    "for one forward, use torch.utils.flop_counter.FlopCounterMode.",
)
_SHARED = "tie the weights inside the model (self.head.weight = self.embed.weight) in __init__ or configure_model"
find_shared_parameters = build_refused_function("find_shared_parameters", _HERE, _SHARED)
set_shared_parameters = build_refused_function("set_shared_parameters", _HERE, _SHARED)
is_shared_filesystem = build_refused_function(
    "is_shared_filesystem",
    _HERE,
    "checkpoints are written per rank and committed collectively wherever they are, so nothing needs to ask; "
    "see the checkpoints documentation for multi-node directories.",
)

__all__ = [
    "AttributeDict",
    "CombinedLoader",
    "GradClipAlgorithmType",
    "LightningEnum",
    "NotProvidedError",
    "disable_possible_user_warnings",
    "find_shared_parameters",
    "grad_norm",
    "is_picklable",
    "is_shared_filesystem",
    "measure_flops",
    "move_data_to_device",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "set_shared_parameters",
    "suggested_max_num_workers",
]
