"""Token documents -> training arrays: packed into fixed-length blocks, or one truncated example each.

Packed documents share blocks without leaking into each other: each
document's first label is -100, and under mode "attention" position ids
restart per document (Hugging Face models turn that into a block-diagonal
mask); mode "loss" masks only the boundary labels. With per-token target
flags (assistant_only_loss) every token not flagged is -100 too. data.py
tokenises and caches (token_cache.py: the tokens, a mask byte per token and
the split's documents in order); the datasets below read that cache through
memory maps and derive the labels and position ids of an item when it is
read, by the rules pack_documents / truncate_documents apply to documents
held in memory (the reference the cache is tested against).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from shardwise.corpus.shards import TokenCorpus

PACKING_MODES = ("attention", "loss")


def pack_documents(
    docs: Sequence[Sequence[int]], block: int, mode: str, targets: Optional[Sequence[Sequence[bool]]] = None
) -> Dict[str, np.ndarray]:
    """Concatenate documents into [N, block] arrays; the last, partial block is dropped.

    Labels are -100 at every document's first token, and with `targets` (one
    flag per token, assistant_only_loss) at every token not flagged; position ids restart
    at each document (mode "attention") or count through the block ("loss").
    Position ids also restart at every block, so a document cut by a block
    boundary never exceeds `block` positions.
    """
    if mode not in PACKING_MODES:
        raise ValueError(f"packing_mode={mode!r}: use one of {PACKING_MODES}.")
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    total = int(lengths.sum())
    n = total // block
    if n == 0:
        raise ValueError(
            f"the dataset has {total} tokens, fewer than one block of max_seq_len={block}; "
            "lower max_seq_len or add data."
        )
    flat = np.fromiter((t for d in docs for t in d), dtype=np.int32, count=total)[: n * block]
    starts = np.zeros(total, dtype=bool)
    starts[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = True
    starts = starts[: n * block]
    masked = starts
    if targets is not None:
        flagged = np.fromiter((t for d in targets for t in d), dtype=bool, count=total)[: n * block]
        masked = starts | ~flagged
    labels = np.where(masked, -100, flat).astype(np.int32)
    if mode == "attention":
        # position = distance to the most recent document start, restarted at each block
        idx = np.arange(n * block)
        last_start = np.maximum.accumulate(np.where(starts | (idx % block == 0), idx, 0))
        positions = (idx - last_start).astype(np.int32)
    else:
        positions = np.tile(np.arange(block, dtype=np.int32), n)
    return {
        "input_ids": flat.reshape(n, block),
        "labels": labels.reshape(n, block),
        "position_ids": positions.reshape(n, block),
    }


def truncate_documents(
    docs: Sequence[Sequence[int]], block: int, targets: Optional[Sequence[Sequence[bool]]] = None
) -> Dict[str, np.ndarray]:
    """Unpacked: one example per document, cut at `block` tokens, stored flat with offsets (and with
    `targets`, assistant_only_loss, one flag per token: only flagged tokens are labels)."""
    keep = [i for i, d in enumerate(docs) if len(d) > 1]
    cut = [list(docs[i][:block]) for i in keep]
    lengths = np.array([len(d) for d in cut], dtype=np.int64)
    count = int(lengths.sum())
    flat = np.fromiter((t for d in cut for t in d), dtype=np.int32, count=count)
    out = {"tokens": flat, "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
    if targets is not None:
        out["targets"] = np.fromiter((t for i in keep for t in targets[i][:block]), dtype=bool, count=count)
    return out


def target_tokens(arrays: Dict[str, np.ndarray], packing: bool) -> int:
    """Tokens the loss is taken on (loss_weight's count: a row's first label predicts nothing)."""
    if packing:
        return int((arrays["labels"][:, 1:] != -100).sum())
    firsts = arrays["offsets"][:-1]
    return int(arrays["targets"].sum() - arrays["targets"][firsts].sum()) if len(firsts) else 0


class _Documents(Dataset):
    """A cache entry's documents (token_cache.py): the token stream and its masks through memory maps
    (corpus.TokenCorpus), each document's first token (`docs.npy`, one more for the stream's end) and the
    split's documents in training order (`<split>.docs.npy`). Nothing is read until an item is asked for."""

    def __init__(self, folder: str, split: str) -> None:
        self.corpus = TokenCorpus(folder)
        self.starts = np.load(os.path.join(folder, "docs.npy"), mmap_mode="r")
        self.order = np.load(os.path.join(folder, f"{split}.docs.npy"), mmap_mode="r")
        with open(os.path.join(folder, "summary.json")) as fh:
            self.block = int(json.load(fh)["spec"]["max_seq_len"])

    def _read(self, doc: int, lo: int, hi: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        first = int(self.starts[doc])
        return self.corpus.read(first + lo, first + hi)


class PackedBlocks(_Documents):
    """Fixed-length blocks of the split's documents back to back (the last, partial block dropped); every item
    is a dict of int64 tensors of length max_seq_len, labels and position ids derived as pack_documents does."""

    def __init__(self, folder: str, split: str, attention_boundaries: bool) -> None:
        super().__init__(folder, split)
        self.cum = np.load(os.path.join(folder, f"{split}.cum.npy"), mmap_mode="r")  # tokens before each document
        self.attention_boundaries = attention_boundaries

    def __len__(self) -> int:
        return int(self.cum[-1]) // self.block

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        a, b = i * self.block, (i + 1) * self.block
        k = int(np.searchsorted(self.cum, a, side="right")) - 1
        tokens, masks = [], []
        is_start = np.zeros(self.block, dtype=bool)
        while k < len(self.order) and self.cum[k] < b:
            begin, end = int(self.cum[k]), int(self.cum[k + 1])
            if begin >= a:
                is_start[begin - a] = True
            ids, mask = self._read(int(self.order[k]), max(a, begin) - begin, min(b, end) - begin)
            tokens.append(ids)
            masks.append(mask)
            k += 1
        ids = np.concatenate(tokens)
        drop = is_start if masks[0] is None else is_start | ~np.concatenate(masks)
        item = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(np.where(drop, -100, ids))}
        if self.attention_boundaries:  # else plain causal attention across the block
            idx = np.arange(self.block)
            item["position_ids"] = torch.from_numpy(
                idx - np.maximum.accumulate(np.where(is_start | (idx == 0), idx, 0))
            )
        return item


class Examples(_Documents):
    """One document per item, cut at max_seq_len; `PadCollate` pads a batch. An item is its token ids, or with
    assistant_only_loss a dict of input_ids and labels (-100 where the token is not a target)."""

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> Any:
        doc = int(self.order[i])
        ids, keep = self._read(doc, 0, min(int(self.starts[doc + 1] - self.starts[doc]), self.block))
        ids = torch.from_numpy(ids)
        if keep is None:
            return ids
        return {"input_ids": ids, "labels": ids.masked_fill(~torch.from_numpy(keep), -100)}


class PadCollate:
    """Right-pad to the longest sequence in the batch; padding gets label -100 and attention 0."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: List[Any]) -> Dict[str, torch.Tensor]:
        items = [x if isinstance(x, dict) else {"input_ids": x, "labels": x} for x in batch]
        longest = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), longest), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for row, x in enumerate(items):
            n = len(x["input_ids"])
            ids[row, :n], labels[row, :n], mask[row, :n] = x["input_ids"], x["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
