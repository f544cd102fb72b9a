"""`TokenCorpus`: a prepared corpus read through memory maps, as one stream of tokens with document starts.

The shards prepare.py wrote are concatenated in their index order into one
token stream; nothing is read into memory until a slice of it is asked for,
so opening a corpus of any size costs a few kilobytes per shard. `window`
returns tokens [start, end) of the stream and where documents begin inside
it, which is all that packing into fixed-length samples needs. A corpus
encoded with loss masks (the fine-tuning recipe's cache) also has one mask
byte per token, which `read` returns beside the tokens.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

import numpy as np

from shardwise.corpus.prepare import INDEX


class TokenCorpus:
    """A prepared corpus folder (index.json + shards), opened lazily."""

    def __init__(self, path: str) -> None:
        index_path = os.path.join(path, INDEX)
        if not os.path.exists(index_path):
            partial = os.path.exists(os.path.join(path, "plan.json"))
            raise FileNotFoundError(
                f"{path} is not a prepared corpus (no {INDEX})"
                + (": its preparation did not finish; run prepare again with the same arguments to continue it."
                   if partial else ": prepare it first (shardwise prepare INPUTS --out PATH --tokenizer TOK).")
            )  # fmt: skip
        with open(index_path) as f:
            self.index = json.load(f)
        self.path = path
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size = int(self.index["vocab_size"])
        self.names = [s["name"] for s in self.index["shards"] if s["tokens"] > 0]
        sizes = [s["tokens"] for s in self.index["shards"] if s["tokens"] > 0]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # each shard's first token
        self._tokens: List[np.ndarray] = [None] * len(self.names)  # type: ignore[list-item]
        self._starts: List[np.ndarray] = [None] * len(self.names)  # type: ignore[list-item]
        self._masks: List[np.ndarray] = [None] * len(self.names)  # type: ignore[list-item]
        self.masked = bool(self.names) and all(s.get("masked") for s in self.index["shards"] if s["tokens"] > 0)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def _shard(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        if self._tokens[i] is None:
            base = os.path.join(self.path, self.names[i])
            self._tokens[i] = np.memmap(base + ".tokens", dtype=self.dtype, mode="r")
            self._starts[i] = np.load(base + ".starts.npy", mmap_mode="r")
        return self._tokens[i], self._starts[i]

    def read(self, start: int, end: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """(tokens [start, end) of the stream as int64, their loss mask as bool or None when there is none)."""
        tokens, masks = [], []
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            shard_tokens, _ = self._shard(i)
            lo, hi = int(start - self.offsets[i]), int(min(end, self.offsets[i + 1]) - self.offsets[i])
            tokens.append(np.asarray(shard_tokens[lo:hi], dtype=np.int64))
            if self.masked:
                if self._masks[i] is None:
                    self._masks[i] = np.memmap(os.path.join(self.path, self.names[i]) + ".mask", np.uint8, mode="r")
                masks.append(np.asarray(self._masks[i][lo:hi], dtype=bool))
            start = int(self.offsets[i]) + hi
            i += 1
        if not tokens:
            return np.zeros(0, dtype=np.int64), (np.zeros(0, dtype=bool) if self.masked else None)
        return np.concatenate(tokens), (np.concatenate(masks) if self.masked else None)

    def window(self, start: int, end: int) -> Tuple[np.ndarray, np.ndarray]:
        """(tokens [start, end) of the stream as int64, offsets within it where a document begins)."""
        if not 0 <= start <= end <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {end}) are outside the corpus's {self.num_tokens} tokens.")
        tokens, starts, filled = [], [], 0
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            shard_tokens, shard_starts = self._shard(i)
            lo, hi = int(start - self.offsets[i]), int(min(end, self.offsets[i + 1]) - self.offsets[i])
            tokens.append(np.asarray(shard_tokens[lo:hi], dtype=np.int64))
            first, last = np.searchsorted(shard_starts, [lo, hi])
            starts.append(np.asarray(shard_starts[first:last], dtype=np.int64) - lo + filled)
            filled += hi - lo
            start = int(self.offsets[i]) + hi
            i += 1
        return np.concatenate(tokens), np.concatenate(starts)
