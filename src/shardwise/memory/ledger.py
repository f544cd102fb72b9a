# The bookkeeping under shardwise.memory's MemoryTracker: live tensor storages, the
# bytes each holds per role, and the peak. The tracker (memory/__init__.py) decides
# what to count and in which role (a dispatch mode, module/optimizer hooks,
# collectives); this module only keeps the books, so its rules read in one place:
# - one entry per storage, keyed by its C++ StorageImpl and held by a weakref whose
#   callback is the free; callbacks may fire on any thread, even mid-update, so they
#   only queue the entry and the next drain() subtracts it;
# - the peak is a snapshot of the bytes per role at the moment the total peaked; a
#   storage alive then that later changes role (or size) moves the snapshot with it,
#   so the peak's breakdown stays right when roles are learned late;
# - a "transient window" records the largest storage born and then freed (or
#   shrunk) since it began, which is how the planner sizes FSDP2's unsharded units.
# The caller (the tracker) holds its own lock around every call except the weakref
# callback; nothing here locks.
from __future__ import annotations

import collections
import types
import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers", "other")


def tensor_storages(t: torch.Tensor) -> list:
    """The storages holding t's bytes: its own, or its inner tensors' for a wrapper subclass."""
    # Wrapper subclasses (DTensor, FSDP's extensions) own no memory themselves; the
    # bytes live in the inner tensors they flatten to.
    if type(t) is not torch.Tensor and is_traceable_wrapper_subclass(t):
        out = []
        for attr in t.__tensor_flatten__()[0]:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                out.extend(tensor_storages(inner))
        return out
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError, TypeError):
        return []  # sparse / mkldnn / nested layouts: no single dense storage to count


class Entry(weakref.ref):
    """A weak reference to one storage plus its accounting; the callback is the free."""

    __slots__ = ("key", "nbytes", "cat", "born", "peak_mark", "peak_nbytes")


class StorageLedger:
    """Live storage bytes per category, their total, and the peak moment's breakdown."""

    def __init__(self):
        self.entries: dict[int, Entry] = {}  # StorageImpl address -> entry
        self.pending: collections.deque = collections.deque()  # freed, not yet subtracted
        self.set_counts(dict.fromkeys(CATEGORIES, 0), 0)
        self.peak_snap, self.peak_total = dict.fromkeys(CATEGORIES, 0), 0
        self.peak_id = 0  # bumps whenever a new peak moment is recorded
        self.peak_limit = 0  # entries with born <= this were alive at the peak moment
        self.seq = 0  # birth counter
        self.transient_from = -1  # birth counter at begin_transient_window(); -1: not measuring
        self.largest_transient = 0

    def set_counts(self, cur: dict, total: int) -> None:
        self.cur, self.total = cur, total
        self.cur_view = types.MappingProxyType(cur)  # what on_change callbacks see

    def forget(self) -> None:
        """Drop every entry: their weakrefs go with them, so a stopped tracker costs nothing."""
        self.entries = {}
        self.pending.clear()

    def begin_transient_window(self) -> None:
        self.transient_from, self.largest_transient = self.seq, 0

    def on_free(self, entry: Entry) -> None:
        if self.transient_from >= 0 and entry.born > self.transient_from and entry.nbytes > self.largest_transient:
            self.largest_transient = entry.nbytes
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        self.pending.append(entry)

    def drain(self) -> None:
        while self.pending:
            e = self.pending.popleft()
            self.cur[e.cat] -= e.nbytes
            self.total -= e.nbytes

    def maybe_peak(self) -> None:
        if self.total > self.peak_total:
            self.new_peak()

    def new_peak(self) -> None:
        self.peak_total, self.peak_snap = self.total, dict(self.cur)
        self.peak_id += 1
        self.peak_limit = self.seq

    def add(self, st, cat: str, retro: bool) -> None:
        # retro: the storage existed before tracking saw it (found via a registered
        # object), so it was also part of every earlier moment, including the peak.
        n = st.nbytes()
        self.seq += 1
        e = Entry(st, self.on_free)
        e.key, e.nbytes, e.cat, e.peak_mark, e.peak_nbytes = st._cdata, n, cat, -1, 0
        e.born = -1 if retro else self.seq
        self.entries[e.key] = e
        self.cur[cat] += n
        self.total += n
        if retro:
            self.peak_total += n
            self.peak_snap[cat] += n

    def recat(self, e: Entry, cat: str) -> None:
        old = e.cat
        if old == cat:
            return
        self.cur[old] -= e.nbytes
        self.cur[cat] += e.nbytes
        if e.born <= self.peak_limit:  # alive now and born before the peak: it was in the peak
            n = e.peak_nbytes if e.peak_mark == self.peak_id else e.nbytes
            self.peak_snap[old] -= n
            self.peak_snap[cat] += n
        e.cat = cat

    def resize(self, e: Entry, n: int) -> None:
        if self.transient_from >= 0 and e.nbytes > n and e.nbytes > self.largest_transient:
            self.largest_transient = e.nbytes  # shrunk away: FSDP2 frees unsharded parameters this way
        if e.born <= self.peak_limit and e.peak_mark != self.peak_id:
            e.peak_mark, e.peak_nbytes = self.peak_id, e.nbytes  # remember its size at the peak
        delta, e.nbytes = n - e.nbytes, n
        self.cur[e.cat] += delta
        self.total += delta

    def relabel(self, category: str, sources: frozenset) -> int:
        """Move every live storage in one of `sources` to `category`; return the bytes moved."""
        moved = 0
        for e in list(self.entries.values()):
            if e.cat in sources and e.cat != category:
                moved += e.nbytes
                self.recat(e, category)
        return moved
