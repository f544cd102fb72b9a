"""The position of a stateful train loader, saved per rank in every checkpoint and put back on resume.

shardwise's own sampler (data.ResumableSampler) needs no saved state: the
position is TrainState.batch_idx and the sampler skips by index at any world
size. A loader that streams (an IterableDataset, Hugging Face `datasets`
streaming, torchdata's StatefulDataLoader, litdata, mosaic streaming, a user's
own) cannot skip by index: it knows its position only through its own
`state_dict()` / `load_state_dict()`. Such a state belongs to one rank (each
rank streams its own share), so every rank's state is gathered and saved, and
each rank takes its own back on resume -- as Lightning does for
StatefulDataLoader. A position split over N ranks cannot be re-split over M by
anyone but the loader itself, so a mid-epoch resume on another number of
ranks is refused with the loader's name instead of silently repeating or
skipping samples -- unless the loader says its position is global
(`elastic_state = True`, as shardwise.corpus.PackedMixture does): then every
rank holds the same state, which resumes at any world size. At an epoch
boundary nothing is restored: the next epoch starts from a fresh iterator at
any world size.
"""

from __future__ import annotations

import io
import warnings
from typing import Any, Dict, Optional

import torch

from shardwise.checkpoint.errors import CheckpointMismatchError
from shardwise.checkpoint.safety import safe_torch_load
from shardwise.data import find_sampler
from shardwise.distributed import ops


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_part(loader: Any) -> Optional[Any]:
    """What holds the train data's position: the loader itself (StatefulDataLoader), else its dataset
    (a streaming dataset under a plain DataLoader), else None (shardwise's sampler, or nothing stateful)."""
    if loader is None or find_sampler(loader) is not None:
        return None
    if _has_state(loader):
        return loader
    dataset = getattr(loader, "dataset", None)
    return dataset if _has_state(dataset) else None


def _name(part: Any) -> str:
    return f"{type(part).__module__}.{type(part).__qualname__}"


def capture(loader: Any) -> Optional[Dict[str, Any]]:
    """Every rank's loader state, on every rank (collective), or None when the loader has none to save."""
    part = stateful_part(loader)
    if part is None:
        return None
    if part is not loader and getattr(loader, "num_workers", 0) > 0:
        # The dataset streams inside the worker processes; this process's copy never advanced.
        warnings.warn(
            f"The train dataset ({_name(part)}) has state_dict(), but the DataLoader reads it in "
            f"{loader.num_workers} worker processes, whose positions this process cannot see: the "
            "checkpoint holds no data position, and a mid-epoch resume restarts the epoch. Wrap it in "
            "torchdata's StatefulDataLoader (which collects the workers' states), or use num_workers=0.",
            stacklevel=4,
        )
        return None
    buffer = io.BytesIO()
    torch.save(part.state_dict(), buffer)  # as bytes: a tensor pickled through all_gather_object loses its storage
    return {
        "kind": _name(part),
        "per_rank": [
            safe_torch_load(io.BytesIO(blob), name="a train loader state from another rank")
            for blob in ops.all_gather_object(buffer.getvalue())
        ],
    }


def restore(loader: Any, saved: Optional[Dict[str, Any]], rank: int, world_size: int, batch_idx: int) -> bool:
    """Give this rank's loader its saved position; True when the position is the loader's (restored, or
    nothing to restore at an epoch boundary). Refuses a mid-epoch resume that would repeat or skip samples."""
    part = stateful_part(loader)
    if part is None or not saved:
        return False
    if batch_idx == 0:
        return True  # an epoch boundary: the next epoch's fresh iterator is the position, at any world size
    if saved["kind"] != _name(part):
        raise CheckpointMismatchError(
            f"The checkpoint holds the data position of a {saved['kind']}, but this run's train data is a "
            f"{_name(part)}. Resume with the same kind of loader, or from a checkpoint taken at an epoch's end."
        )
    ranks = len(saved["per_rank"])
    if getattr(part, "elastic_state", False):
        # A global position, the same on every rank (shardwise.corpus.PackedMixture): valid at any world size.
        if any(s != saved["per_rank"][0] for s in saved["per_rank"]):
            raise CheckpointMismatchError(
                f"The checkpoint's ranks hold different positions of {saved['kind']}, whose position should be "
                "the same on every rank: the ranks took different numbers of samples (unequal batch sizes?). "
                "Resume from an earlier checkpoint."
            )
        part.load_state_dict(saved["per_rank"][0])
        return True
    if ranks != world_size:
        raise CheckpointMismatchError(
            f"The checkpoint was saved mid-epoch by {ranks} process(es), each with its own position in its "
            f"share of the train data ({saved['kind']}); this run has {world_size}. That loader cannot re-split "
            f"its position over another number of processes, so resuming would repeat or skip samples. Resume "
            f"on {ranks} process(es), resume from a checkpoint taken at an epoch's end, or use data shardwise "
            "re-splits at any world size: a map-style dataset (shardwise's sampler) or a shardwise.corpus mixture."
        )
    part.load_state_dict(saved["per_rank"][rank])
    return True
