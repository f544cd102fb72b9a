"""`PackedMixture`: prepared corpora mixed by weight and packed into fixed-length samples, in one global
order that does not depend on the number of data-parallel ranks, so a run resumes exactly on any number.

Each corpus's token stream (shards.TokenCorpus) is cut into samples of
`seq_len` tokens (the last partial one dropped); a corpus is read in a seeded
permutation of its samples, a new one each time it is used up. The mixture is
an endless sequence of global sample indices g = 0, 1, 2, ...: blocks of
`block` indices hold each corpus exactly its weight's share (largest
remainder), in a seeded order per block, so any g maps to (corpus, sample) at
the cost of one block's arithmetic, with no history. Rank r of D takes the
indices g with g % D == r after the start: with a per-rank batch of b, step s
trains on g in [s*b*D, (s+1)*b*D) whatever D is, the same global batch.

The position is one number, the global samples consumed, the same on every
rank; `state_dict()` holds it, so the checkpoint of a run on N ranks resumes
on M (`elastic_state`: checkpoint/loader_state.py takes it at any world size)
and continues after exactly the samples consumed: none repeated, none skipped,
as long as every rank takes the same batch size (a global batch divides over
the ranks). Documents keep their boundaries as the fine-tuning recipe's
packing keeps them: `labels` is -100 at each document's first token and
`position_ids` restart at each document (and at each sample's start).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset

from shardwise.corpus.shards import TokenCorpus

_CORPUS_BITS = 40  # sample_id = corpus << 40 | the sample's number in that corpus's reading order


def quotas(weights: Sequence[float], block: int) -> np.ndarray:
    """Each corpus's samples per block: its share of `block`, rounded by largest remainder (sums to block)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"mixture weights must be non-negative with a positive sum, got {list(weights)}.")
    exact = w / w.sum() * block
    q = np.floor(exact).astype(np.int64)
    q[np.argsort(-(exact - q), kind="stable")[: block - int(q.sum())]] += 1
    return q


class PackedMixture(IterableDataset):
    """corpora: {name: (folder or TokenCorpus, weight)} or a sequence of (folder, weight).

    dp_rank / dp_size: this rank's place among the data-parallel ranks (default: torch.distributed's rank and
    world size when the iteration starts; ranks of a sequence- or tensor-parallel group must pass the same).
    """

    elastic_state = True  # the state means the same at any world size (checkpoint/loader_state.py)

    def __init__(
        self,
        corpora: Union[Mapping[str, Tuple[Any, float]], Sequence[Tuple[Any, float]]],
        seq_len: int,
        seed: int = 0,
        block: int = 1024,
        dp_rank: Optional[int] = None,
        dp_size: Optional[int] = None,
    ) -> None:
        items = list(corpora.items()) if isinstance(corpora, Mapping) else [(str(p), (p, w)) for p, w in corpora]
        if not items:
            raise ValueError("PackedMixture needs at least one corpus.")
        self.names = [name for name, _ in items]
        self.corpora = [c if isinstance(c, TokenCorpus) else TokenCorpus(os.fspath(c)) for _, (c, _) in items]
        self.weights = [float(w) for _, (_, w) in items]
        self.seq_len, self.seed, self.block = int(seq_len), int(seed), int(block)
        self.quota = quotas(self.weights, self.block)
        self.samples = np.array([c.num_tokens // self.seq_len for c in self.corpora], dtype=np.int64)
        empty = [n for n, k, q in zip(self.names, self.samples, self.quota) if k == 0 and q > 0]
        if empty:
            raise ValueError(
                f"corpus {empty[0]!r} holds fewer than seq_len={self.seq_len} tokens: no sample can be cut from "
                "it. Lower seq_len, add data, or give it weight 0."
            )
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = 0  # global samples consumed: the position
        self._block_cache: Tuple[int, Optional[np.ndarray], Optional[np.ndarray]] = (-1, None, None)
        self._perm_cache: Dict[Tuple[int, int], np.ndarray] = {}

    # ------------------------------------------------------------------ the order
    def _block(self, b: int) -> Tuple[np.ndarray, np.ndarray]:
        """Block b's corpus per slot and each slot's number among its corpus's slots in the block."""
        if self._block_cache[0] != b:
            slots = np.repeat(np.arange(len(self.quota)), self.quota)
            order = np.random.default_rng([self.seed, 0, b]).permutation(slots)
            rank = np.empty(self.block, dtype=np.int64)
            for c in range(len(self.quota)):
                where = np.flatnonzero(order == c)
                rank[where] = np.arange(len(where))
            self._block_cache = (b, order, rank)
        return self._block_cache[1], self._block_cache[2]  # type: ignore[return-value]

    def _permutation(self, c: int, epoch: int) -> np.ndarray:
        key = (c, epoch)
        if key not in self._perm_cache:
            if len(self._perm_cache) > 2 * len(self.corpora):
                self._perm_cache.clear()
            self._perm_cache[key] = np.random.default_rng([self.seed, 1, c, epoch]).permutation(self.samples[c])
        return self._perm_cache[key]

    def locate(self, g: int) -> Tuple[int, int, int]:
        """(corpus, its reading-order number, its packed sample) of global sample g."""
        b, slot = divmod(int(g), self.block)
        order, rank = self._block(b)
        c = int(order[slot])
        n = b * int(self.quota[c]) + int(rank[slot])  # the corpus's n-th sample read
        epoch, within = divmod(n, int(self.samples[c]))
        return c, n, int(self._permutation(c, epoch)[within])

    def sample(self, g: int) -> Dict[str, torch.Tensor]:
        """Global sample g: input_ids, labels, position_ids (seq_len each) and sample_id."""
        c, n, j = self.locate(g)
        tokens, starts = self.corpora[c].window(j * self.seq_len, (j + 1) * self.seq_len)
        is_start = np.zeros(self.seq_len, dtype=bool)
        is_start[starts] = True
        labels = np.where(is_start, -100, tokens)
        idx = np.arange(self.seq_len)
        positions = idx - np.maximum.accumulate(np.where(is_start | (idx == 0), idx, 0))
        return {
            "input_ids": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
            "sample_id": torch.tensor((c << _CORPUS_BITS) | n),
        }

    # ------------------------------------------------------------------ iteration and state
    def _replica(self) -> Tuple[int, int]:
        if self.dp_size is not None:
            return int(self.dp_rank or 0), int(self.dp_size)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        rank, size = self._replica()
        g = self.consumed + rank
        while True:
            # Every rank has taken the same count when a step ends: the global count is the same on each.
            self.consumed = g - rank + size
            yield self.sample(g)
            g += size

    def state_dict(self) -> Dict[str, Any]:
        return {
            "consumed": self.consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "block": self.block,
            "weights": dict(zip(self.names, self.weights)),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = [k for k in ("seed", "seq_len", "block", "weights") if state.get(k) != mine[k]]
        if changed:
            raise ValueError(
                f"The checkpoint's data mixture differs in {', '.join(changed)} "
                f"({[state.get(k) for k in changed]} saved, {[mine[k] for k in changed]} now): its position "
                "would point at other samples. Resume with the same corpora, weights, seq_len and seed."
            )
        self.consumed = int(state["consumed"])
