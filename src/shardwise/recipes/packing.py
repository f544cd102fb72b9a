"""Token documents -> training arrays: packed into fixed-length blocks, or one truncated example each.

Packed documents share blocks without leaking into each other: each
document's first label is -100, and under mode "attention" position ids
restart per document (Hugging Face models turn that into a block-diagonal
mask); mode "loss" masks only the boundary labels. With per-token target
flags (assistant_only_loss) every token not flagged is -100 too. data.py
tokenises and caches; these functions arrange the arrays, and the datasets
below hand the cached arrays to the loaders.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

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
    if targets is not None:
        flagged = np.fromiter((t for d in targets for t in d), dtype=bool, count=total)[: n * block]
        starts = starts | ~flagged
    labels = np.where(starts, -100, flat).astype(np.int32)
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


class PackedBlocks(Dataset):
    """Fixed-length blocks; every item is a dict of int64 tensors of length max_seq_len."""

    def __init__(self, folder: str, split: str, attention_boundaries: bool) -> None:
        self.arrays = {
            k: np.load(os.path.join(folder, f"{split}.{k}.npy"), mmap_mode="r")
            for k in ("input_ids", "labels", "position_ids")
        }
        self.attention_boundaries = attention_boundaries

    def __len__(self) -> int:
        return int(self.arrays["input_ids"].shape[0])

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        item = {k: torch.from_numpy(np.asarray(v[i], dtype=np.int64)) for k, v in self.arrays.items()}
        if not self.attention_boundaries:
            item.pop("position_ids")  # plain causal attention across the block
        return item


class Examples(Dataset):
    """One (truncated) document per item; `PadCollate` pads a batch. An item is its token ids, or with
    assistant_only_loss a dict of input_ids and labels (-100 where the token is not a target)."""

    def __init__(self, folder: str, split: str) -> None:
        self.tokens = np.load(os.path.join(folder, f"{split}.tokens.npy"), mmap_mode="r")
        self.offsets = np.load(os.path.join(folder, f"{split}.offsets.npy"))
        targets = os.path.join(folder, f"{split}.targets.npy")
        self.targets = np.load(targets, mmap_mode="r") if os.path.exists(targets) else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Any:
        where = slice(self.offsets[i], self.offsets[i + 1])
        ids = torch.from_numpy(np.asarray(self.tokens[where], dtype=np.int64))
        if self.targets is None:
            return ids
        keep = torch.from_numpy(np.array(self.targets[where], dtype=bool))  # a copy: the map is read-only
        return {"input_ids": ids, "labels": ids.masked_fill(~keep, -100)}


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
