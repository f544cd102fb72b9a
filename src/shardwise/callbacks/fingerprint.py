"""`BatchFingerprint`: a hash of each optimizer step's global batch, to prove two runs trained on the same data.

A resumed run, a run on another number of processes, or a run with another
data loader configuration should see the same samples at every step; the
losses alone cannot show it (a repeated sample gives a plausible loss). Each
rank hashes every sample of its micro-batches (the row of token ids, or sample
ids, along the batch dimension); at the optimizer step the per-sample hashes
of the data-parallel ranks are gathered (8 bytes a sample), sorted, and hashed
again. Sorting makes the value independent of how the global batch was split
over ranks and micro-batches, so one process with batch 8 and 4 processes with
batch 2 agree when they trained on the same 8 samples at that step. Ranks of a
sequence- or tensor-parallel group read the same samples and count once.

The value goes to the loggers as `batch_fingerprint` (the hash's first 52 bits,
exact in a float64; a float32 logger rounds it) and, exactly, to a JSON-lines
file, one `{"step": N, "fingerprint": "<16 hex digits>"}` per step, which
`shardwise check fingerprints A B` compares. The history is saved in
checkpoints, so a resumed run's file holds every step once.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from shardwise.callbacks.base import Callback
from shardwise.distributed import ops

FILE_NAME = "batch_fingerprints.jsonl"


def _identity_tensor(batch: Any, key: Optional[str]) -> torch.Tensor:
    """The tensor whose rows identify the batch's samples: batch[key], else input_ids, else the first tensor."""
    if key is not None:
        if not isinstance(batch, Mapping) or key not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
            raise ValueError(
                f"BatchFingerprint(key={key!r}): the batch has no {key!r} (it holds {keys}). Name a key the "
                "batch has, or leave key=None for input_ids or the batch's first tensor."
            )
        return torch.as_tensor(batch[key])
    if isinstance(batch, Mapping):
        candidates = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    elif isinstance(batch, (list, tuple)):
        candidates = list(batch)
    else:
        candidates = [batch]
    for value in candidates:
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError(
        f"BatchFingerprint found no tensor in a batch of type {type(batch).__name__}: pass key= naming the "
        "batch's token ids or sample ids."
    )


def sample_digests(batch: Any, key: Optional[str] = None) -> List[int]:
    """One 64-bit hash per sample (row along dimension 0) of the batch's identifying tensor."""
    ids = _identity_tensor(batch, key).detach()
    ids = ids.to("cpu", torch.float64 if ids.is_floating_point() else torch.int64)  # same ids, same bytes
    rows = ids.reshape(ids.shape[0] if ids.dim() else 1, -1).contiguous().numpy()
    return [int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "big") for row in rows]


def global_fingerprint(digests: List[int]) -> str:
    """The step's value: a hash of the sorted per-sample hashes (independent of the split over ranks)."""
    packed = b"".join(struct.pack(">Q", d) for d in sorted(digests))
    return hashlib.blake2b(packed, digest_size=8).hexdigest()


class BatchFingerprint(Callback):
    """Logs `batch_fingerprint` per optimizer step and writes every step's exact value to `path`.

    key: the batch entry whose rows identify samples (default: `input_ids`, else the batch's first tensor).
    path: the JSON-lines file (default: `<default_root_dir>/batch_fingerprints.jsonl`), written by global rank 0.
    """

    def __init__(self, key: Optional[str] = None, path: Optional[str] = None) -> None:
        self.key, self.path = key, path
        self.fingerprints: Dict[int, str] = {}
        self._pending: List[int] = []

    def _file(self, trainer: Any) -> str:
        return self.path or os.path.join(trainer.default_root_dir, FILE_NAME)

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._pending = []
        if trainer.is_global_zero:  # a fresh file: this run's history (restored on resume), then one line a step
            os.makedirs(os.path.dirname(os.path.abspath(self._file(trainer))), exist_ok=True)
            with open(self._file(trainer), "w") as f:
                f.writelines(_line(step, value) for step, value in sorted(self.fingerprints.items()))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._pending.extend(sample_digests(batch, self.key))
        if not trainer.is_last_microbatch:
            return
        shares = ops.all_gather_object((trainer.strategy.data_parallel_rank, self._pending))
        self._pending = []
        by_replica = dict(reversed(shares))  # one share per data-parallel rank: an sp/tp group counts once
        value = global_fingerprint([d for digests in by_replica.values() for d in digests])
        step = int(trainer.global_step)
        self.fingerprints[step] = value
        if trainer.is_global_zero:
            with open(self._file(trainer), "a") as f:
                f.write(_line(step, value))
        trainer.log_metrics({"batch_fingerprint": float(int(value[:13], 16))}, step=step)

    def state_dict(self) -> Dict[str, Any]:
        return {"fingerprints": {str(step): value for step, value in self.fingerprints.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.fingerprints = {int(step): value for step, value in state.get("fingerprints", {}).items()}


def _line(step: int, value: str) -> str:
    return json.dumps({"step": step, "fingerprint": value}) + "\n"


def read_fingerprints(path: str) -> Dict[int, str]:
    """A run's fingerprints by step (a folder means its batch_fingerprints.jsonl); a later line of a step wins."""
    if os.path.isdir(path):
        path = os.path.join(path, FILE_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path} does not exist: a run writes it when trained with callbacks=[BatchFingerprint()] "
            "(shardwise.callbacks.fingerprint)."
        )
    out: Dict[int, str] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    entry = json.loads(line)
                    out[int(entry["step"])] = str(entry["fingerprint"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number} is not a fingerprint line ({exc}): {line.strip()[:80]}")
    return out


def compare_fingerprints(a: Dict[int, str], b: Dict[int, str]) -> Tuple[bool, str]:
    """(same, a sentence): whether the steps both runs took saw the same global batches."""
    common = sorted(set(a) & set(b))
    if not common:
        return False, f"The runs share no step (steps {_span(a)} and {_span(b)}): nothing to compare."
    differ = [step for step in common if a[step] != b[step]]
    if differ:
        return False, (
            f"{len(differ)} of {len(common)} common steps trained on different global batches, the first at step "
            f"{differ[0]} ({a[differ[0]]} vs {b[differ[0]]})."
        )
    return True, f"The {len(common)} common steps ({common[0]}-{common[-1]}) trained on the same global batches."


def _span(fingerprints: Dict[int, str]) -> str:
    return f"{min(fingerprints)}-{max(fingerprints)}" if fingerprints else "none"
