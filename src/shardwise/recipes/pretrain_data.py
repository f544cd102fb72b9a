"""The pre-training recipe's data: `--data` parsed into weighted corpora, each split into a training slice and a
held-out slice for evaluation.

A corpus is a folder `shardwise prepare` wrote (corpus/). The held-out part of each is its last samples, the
corpus's weight's share of `eval_samples` (largest remainder, as the mixture's blocks share), so the evaluation
mixes the corpora as training does. `CorpusSlice` is a range of a corpus's token stream read as a corpus of its
own, so `PackedMixture` packs and orders the training slices as it would whole corpora; `HeldOut` is the
held-out samples in one fixed order (one block of their mixture holds each exactly once).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.corpus.mixture import PackedMixture, quotas
from shardwise.corpus.shards import TokenCorpus


def parse_data(spec: Any) -> List[Tuple[str, float]]:
    """`--data` as (folder, weight) pairs: "a:0.7,b:0.3", ["a:0.7", {path: b, weight: 0.3}] or {a: 0.7}."""
    if spec is None or spec == "" or spec == []:
        raise ValueError(
            "data: name at least one prepared corpus folder, e.g. --data corpora/web:0.7,corpora/code:0.3."
        )
    if isinstance(spec, dict):
        items: List[Any] = [{"path": k, "weight": v} for k, v in spec.items()]
    elif isinstance(spec, str):
        items = [part for part in spec.split(",") if part.strip()]
    else:
        items = list(spec)
    out = []
    for item in items:
        if isinstance(item, dict):
            if "path" not in item:
                raise ValueError(f"data entry {item!r}: a mapping needs path (and weight).")
            path, weight = str(item["path"]), item.get("weight", 1.0)
        else:
            path, _, tail = str(item).strip().rpartition(":")
            try:
                weight = float(tail)
            except ValueError:
                path, weight = str(item).strip(), 1.0
            if not path:
                path, weight = str(item).strip(), 1.0
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"data: the weight of {path!r} is {weight!r}, not a number.") from None
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"data: corpus {path!r} has weight {weight}; weights must be positive (drop the corpus to leave "
                "it out)."
            )
        out.append((path, weight))
    paths = [p for p, _ in out]
    if len(set(paths)) != len(paths):
        raise ValueError(f"data: a corpus is named twice in {paths}; give each folder once with its weight.")
    return out


class CorpusSlice(TokenCorpus):
    """Tokens [start, stop) of a prepared corpus, read as a corpus of their own (the train or held-out part)."""

    def __init__(self, path: str, start: int, stop: int) -> None:
        super().__init__(path)
        self.whole = TokenCorpus(path)  # reads the stream; this object's own bounds are the slice's
        self.start, self.stop = int(start), int(stop)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def window(self, start: int, end: int) -> Tuple[np.ndarray, np.ndarray]:
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {end}) are outside the slice's {self.num_tokens} tokens.")
        return self.whole.window(self.start + start, self.start + end)


def split_corpora(corpora: Sequence[Tuple[str, float]], seq_length: int, eval_samples: int) -> Tuple[list, list]:
    """(train, eval) as {name: (CorpusSlice, weight)} lists: each corpus's last samples, its weight's share of
    `eval_samples`, are held out. The train slice's name carries its range, so a checkpoint's mixture position
    is refused by a run that holds out another number of samples (its samples would be others)."""
    held = quotas([w for _, w in corpora], eval_samples) if eval_samples else [0] * len(corpora)
    train, held_out = {}, {}
    for (path, weight), n in zip(corpora, held):
        total = TokenCorpus(path).num_tokens
        cut = total - int(n) * seq_length
        if cut < seq_length:
            raise ValueError(
                f"corpus {path!r} holds {total} tokens: after holding out {n} evaluation samples of {seq_length} "
                f"tokens, not one training sample is left. Lower eval_samples or seq_length, or add data."
            )
        train[f"{path} [0:{cut}]"] = (CorpusSlice(path, 0, cut), weight)
        held_out[f"{path} [{cut}:{total}]"] = (CorpusSlice(path, cut, total), weight)
    return list(train.items()), list(held_out.items())


class HeldOut(Dataset):
    """The held-out samples, in a fixed order: one block of the held-out mixture holds each exactly once."""

    def __init__(self, corpora: list, seq_length: int, count: int, seed: int) -> None:
        self.mixture = PackedMixture(dict(corpora), seq_length, seed=seed, block=count, dp_rank=0, dp_size=1)
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return self.mixture.sample(i)
