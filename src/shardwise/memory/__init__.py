# Tracked tensor memory: the measurement every memory claim in shardwise rests on.
# CPUs have no allocator statistics like torch.cuda.max_memory_allocated, and RSS
# mixes in the Python heap, freed-but-resident pages and library buffers, so it
# cannot support exact assertions such as "FSDP's peak is at most 0.6x DDP's". A
# MemoryTracker counts the bytes of live tensor storages instead: a TorchDispatchMode
# sees each op's outputs and records every new storage once (keyed by its C++
# StorageImpl); a weakref on the storage subtracts it when it is freed. Storages are
# split into roles (parameters, gradients, optimizer, activations, buffers, other)
# learned from registered modules/optimizers, module/optimizer hooks and the
# collectives a storage takes part in; a storage is re-categorised, inside the
# recorded peak too, when its role becomes known. Module-level functions mirror
# torch.cuda (max_memory_allocated, memory_allocated, reset_peak_memory_stats); the
# RSS helpers give the whole-process peak on Linux; format_bytes/parse_bytes are
# shared with the memory planner.
#
# This module is the tracker (the dispatch mode, what registered objects and ops say
# about a storage's role) and the process-wide API; memory/ledger.py keeps the books
# (bytes per role, the peak, the transient window) and memory/phases.py knows which
# phase of a step is running and which collectives name their buffers.
#
# Why not torch.distributed._tools.mem_tracker.MemTracker: it deep-copies per-module
# snapshots on every op and refuses a second forward of the root module inside one
# context, so it cannot watch a training run, and it does not see DDP buckets. We
# keep its two key ideas (storage weakrefs; patching UntypedStorage.resize_, which
# FSDP2 uses to free and re-allocate unsharded parameters without dispatch).
#
# Counted: storages produced by ops dispatched on the tracking thread (autograd's
# threads inherit the mode), storages reachable from registered modules/optimizers,
# and storage resizes. Not counted: scratch memory kernels allocate internally, gloo
# and NCCL internal buffers, other threads (DataLoader workers, pin-memory), code
# compiled by inductor (only its outputs are seen), non-tensor memory. Memory that
# predates tracking counts from when it is found: at once for registered objects
# (and in the peak, since it existed all along), else from the first op touching
# it. DDP's reducer buckets are allocated in C++ at wrap time; with
# gradient_as_bucket_view=True the .grads are views of them, and in both modes the
# reducer copies gradients into them and all-reduces them, so they are counted (as
# gradients) from the first backward on. gloo's CPU reduce-scatter copies its input
# into a buffer allocated below the dispatcher: it is counted (as other) from its
# first dispatched use until freed. Sizes are storage nbytes, not allocator blocks.
# start/stop must nest properly with other dispatch modes, on one thread.
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from shardwise.memory.ledger import CATEGORIES, StorageLedger, tensor_storages
from shardwise.memory.phases import PhaseWatcher, op_info

__all__ = [
    "CATEGORIES",
    "MemoryTracker",
    "active_tracker",
    "current_rss_bytes",
    "format_bytes",
    "last_tracker",
    "max_memory_allocated",
    "memory_allocated",
    "parse_bytes",
    "peak_rss_bytes",
    "reset_peak_memory_stats",
    "reset_peak_rss",
    "start_tracking",
    "stop_tracking",
    "track_memory",
]

_ACTIVE: MemoryTracker | None = None  # the one tracker currently running in this process
_LAST: MemoryTracker | None = None  # kept after stop so its peak stays readable until reset
_WARNED_OFF = False


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: MemoryTracker):
        super().__init__()
        self.tracker = tracker
        self.is_wrapper: dict[type, bool] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let wrapper subclasses desugar first: their local ops come back through
        # this mode with plain tensors, whose storages are the real memory.
        for t in types:
            w = self.is_wrapper.get(t)
            if w is None:
                w = self.is_wrapper[t] = is_traceable_wrapper_subclass_type(t)
            if w:
                return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.tracker._after_op(func, args, kwargs, out)
        return out


class MemoryTracker:
    """Counts live tensor storage bytes by category, and their peak.

    Use as a context manager (``with MemoryTracker() as t: ...``) or with
    ``start()``/``stop()``. At most one tracker runs per process; it watches the
    thread that started it (plus autograd's threads). Call ``register(module,
    optimizers)`` so memory that existed before tracking started is counted and
    categorised. After ``stop()`` the peak numbers stay readable; current numbers
    freeze at their value when tracking stopped.

    For callers that need more than one peak (the memory planner records an
    envelope per training phase) there are four more public pieces:

    - ``on_change(counts)``: called after every op the tracker sees and every
      storage resize, whether or not the counts changed, with the live bytes per
      category as a read-only mapping (copy it to keep it). It runs on the
      tracking thread, outside the tracker's lock.
    - ``ignore_op()``: asked before each op is counted; True means the op's
      outputs are not memory (the planner: DTensor's sharding propagation, which
      runs ops on global-shape fake tensors to learn output metadata). Neither
      counted nor reported to on_change.
    - ``begin_transient_window()`` / ``largest_transient_bytes``: the largest
      single storage that is born after the call and then freed, or that
      shrinks (FSDP2 frees unsharded parameters by resizing their storage to 0).
    - ``relabel(category, from_categories)``: re-label live storages whose role
      the caller knows better than the tracker.
    """

    def __init__(
        self,
        count_fake: bool | None = None,
        on_change: Callable[[Mapping[str, int]], None] | None = None,
        ignore_op: Callable[[], bool] | None = None,
    ):
        # count_fake: count FakeTensor (meta) storages, for the memory planner;
        # None = decide at start() from whether a FakeTensorMode is active then.
        self._count_fake_arg, self._count_meta, self._fake_mode = count_fake, False, None
        self._on_change, self._ignore_op = on_change, ignore_op
        self._lock = threading.RLock()  # guards the ledger (memory/ledger.py)
        self._ledger = StorageLedger()
        self._modules: list[weakref.ref] = []
        self._optimizers: list[weakref.ref] = []
        self._grad_hooked = WeakIdKeyDictionary()  # param -> hook handle
        self._op_cache: dict[Any, tuple[str | None, bool]] = {}
        self._mode: _Mode | None = None
        self._orig_resize = None
        self._phases = PhaseWatcher()
        self._owner_stack: list[bool] = []
        self._adoptable = False

    # ------------------------------------------------------------------ public API
    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def current_bytes(self) -> int:
        with self._lock:
            self._ledger.drain()
            return self._ledger.total

    @property
    def current_breakdown(self) -> dict[str, int]:
        with self._lock:
            self._refresh()
            return dict(self._ledger.cur)

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            self._ledger.drain()
            return self._ledger.peak_total

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per category at the moment the total peaked (roles re-checked now)."""
        with self._lock:
            self._refresh()
            return dict(self._ledger.peak_snap)

    def reset_peak(self) -> None:
        with self._lock:
            self._ledger.drain()
            self._ledger.new_peak()

    def begin_transient_window(self) -> None:
        """Start measuring ``largest_transient_bytes`` from now (restarts it at 0)."""
        with self._lock:
            self._ledger.begin_transient_window()

    @property
    def largest_transient_bytes(self) -> int:
        """Since begin_transient_window(): the largest storage born and then freed, or shrunk.

        A shrink counts the size before it whenever the storage was born: FSDP2
        keeps one storage per unsharded parameter and resizes it to full size
        and back to 0 around each use. 0 if the window was never started.
        """
        return self._ledger.largest_transient

    def relabel(self, category: str, from_categories: Iterable[str] = ("activations", "other")) -> int:
        """Count every live storage now in one of `from_categories` as `category`; return the bytes moved.

        For roles the caller knows and no hook can see: after a micro-batch's
        backward without gradient sync, FSDP2 keeps each unit's unsharded
        gradient on its unsharded parameter, and what is still alive then is
        accumulated gradient, not activations. The peak's breakdown follows
        (as for any re-labelling) when those storages were alive at the peak.
        """
        if category not in CATEGORIES:
            raise ValueError(f"Unknown category {category!r}; use one of {', '.join(CATEGORIES)}.")
        with self._lock:
            self._ledger.drain()
            return self._ledger.relabel(category, frozenset(from_categories))

    def register(self, module: torch.nn.Module | None = None, optimizers: Any = ()) -> MemoryTracker:
        """Attach a model and optimizers so their tensors are counted and categorised."""
        if isinstance(optimizers, torch.optim.Optimizer) or hasattr(optimizers, "param_groups"):
            optimizers = (optimizers,)
        with self._lock:
            if module is not None and not any(r() is module for r in self._modules):
                self._modules.append(weakref.ref(module))
            for opt in optimizers or ():
                if not any(r() is opt for r in self._optimizers):
                    self._optimizers.append(weakref.ref(opt))
            if self.active:
                self._ledger.drain()
                self._scan_registered()
                self._ledger.maybe_peak()
        return self

    def start(self) -> MemoryTracker:
        global _ACTIVE, _LAST
        if self.active:
            return self
        if _ACTIVE is not None:
            raise RuntimeError(
                "Another MemoryTracker is already running in this process; reuse it "
                "via shardwise.memory.active_tracker() or stop it first (stop_tracking())."
            )
        self._fake_mode = active_fake_mode()
        self._count_meta = (self._fake_mode is not None) if self._count_fake_arg is None else self._count_fake_arg
        self._phases.reset()
        self._install_hooks()
        self._mode = _Mode(self)
        self._mode.__enter__()
        _ACTIVE = _LAST = self
        with self._lock:
            # Current accounting restarts from what is reachable now; a previous run's
            # peak is kept (those bytes are already in it, hence retro=False).
            self._ledger.set_counts(dict.fromkeys(CATEGORIES, 0), 0)
            self._scan_registered(retro=False)
            self._ledger.maybe_peak()
        return self

    def stop(self) -> MemoryTracker:
        global _ACTIVE
        if not self.active:
            return self
        with self._lock:
            self._refresh()
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self._remove_hooks()
        # Dropping the weakrefs disarms their callbacks: nothing costs anything once off.
        self._ledger.forget()
        self._adoptable = False
        if _ACTIVE is self:
            _ACTIVE = None
        return self

    def __enter__(self) -> MemoryTracker:
        # A tracker started by track_memory() is "adopted" by the first `with`, so
        # `with track_memory(): ...` stops it at the end; otherwise a `with` only
        # stops what it started itself.
        owns = not self.active or self._adoptable
        self._adoptable = False
        self.start()
        self._owner_stack.append(owns)
        return self

    def __exit__(self, *exc) -> None:
        if self._owner_stack.pop():
            self.stop()

    def summary(self) -> str:
        peak = self.peak_breakdown
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in peak.items() if v)
        return f"peak tracked tensor memory {format_bytes(self.peak_bytes)} ({parts or 'nothing tracked'})"

    def __repr__(self) -> str:
        state = "active" if self.active else "stopped"
        return (
            f"MemoryTracker({state}, current={format_bytes(self.current_bytes)}, peak={format_bytes(self.peak_bytes)})"
        )

    def _see(self, t: torch.Tensor, cat: str) -> None:
        """An op produced t: count its storage if new, follow size changes if known."""
        self._claim(t, cat, retro=False, role=False)

    def _claim(self, t, cat: str, retro: bool = True, weak: bool = False, role: bool = True) -> None:
        """t holds `cat`: count it if unseen; if role, re-label it (weak: only
        activations/other are re-labelled); always follow a size change."""
        if t is None:
            return
        ledger = self._ledger
        for st in tensor_storages(t):
            e = ledger.entries.get(st._cdata)
            if e is None:
                if self._count_meta or st.device.type != "meta":
                    ledger.add(st, cat, retro)
                continue
            if st.nbytes() != e.nbytes:
                ledger.resize(e, st.nbytes())
            if role and (not weak or e.cat in ("activations", "other")):
                ledger.recat(e, cat)

    def _after_op(self, func, args, kwargs, out) -> None:
        if self._ignore_op is not None and self._ignore_op():
            return
        if self._fake_mode is not None and active_fake_mode() is not self._fake_mode:
            if self._on_change is not None:
                self._on_change(self._ledger.cur_view)
            return  # a nested fake mode (DTensor sharding propagation): not real memory
        info = self._op_cache.get(func)
        if info is None:
            info = self._op_cache[func] = op_info(func)
        role, aliasing = info
        cat = self._phases.category()
        if aliasing and cat != "optimizer":
            # An in-place/out=/view op returns memory that already existed; if we have
            # never seen it, it predates tracking and is not this phase's allocation.
            cat = "other"
        ledger = self._ledger
        with self._lock:
            if ledger.pending:
                ledger.drain()
            entries = ledger.entries
            for t in (out,) if type(out) is torch.Tensor else tree_leaves(out) if out is not None else ():
                if type(t) is not torch.Tensor:
                    if isinstance(t, torch.Tensor):
                        self._see(t, cat)
                    continue
                # Inlined _see for plain tensors: this runs after every op.
                st = t.untyped_storage()
                e = entries.get(st._cdata)
                if e is None:
                    if self._count_meta or not t.is_meta:
                        ledger.add(st, cat, retro=False)
                elif st.nbytes() != e.nbytes:
                    ledger.resize(e, st.nbytes())
            if role is not None:
                self._apply_role(role, args, kwargs, out)
            ledger.maybe_peak()
        if self._on_change is not None:
            self._on_change(ledger.cur_view)

    def _apply_role(self, role: str, args, kwargs, out) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        phases = self._phases
        if phases.in_opt or (role == "bw-gradients" and not in_backward):
            return
        if role == "parameters" and not (phases.fwd_depth or phases.awaiting_backward or in_backward):
            return  # an all-gather outside forward/backward (e.g. gather_object) is not FSDP
        role = "gradients" if role == "bw-gradients" else role
        for leaf in tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor):
                self._claim(leaf, role, retro=False, weak=True)

    def _on_resize(self, st) -> None:
        # FSDP2 frees/re-allocates unsharded parameters with storage.resize_, which
        # never reaches the dispatcher.
        ledger = self._ledger
        with self._lock:
            ledger.drain()
            e = ledger.entries.get(st._cdata)
            if e is None:
                if st.nbytes() and (self._count_meta or st.device.type != "meta"):
                    ledger.add(st, self._phases.category(), retro=False)
            elif st.nbytes() != e.nbytes:
                ledger.resize(e, st.nbytes())
            ledger.maybe_peak()
        if self._on_change is not None:
            self._on_change(ledger.cur_view)

    # --------------------------------------------------------- roles from objects
    def _scan_registered(self, retro: bool = True) -> None:
        for module in filter(None, (r() for r in self._modules)):
            for p in module.parameters():
                self._claim(p, "parameters", retro)
                self._claim(p.grad, "gradients", retro)
                self._hook_grad(p)
            for b in module.buffers():
                self._claim(b, "buffers", retro)
        for opt in filter(None, (r() for r in self._optimizers)):
            self._scan_optimizer(opt, state=True, retro=retro)

    def _scan_optimizer(self, opt, state: bool, retro: bool = True, params: bool = True) -> None:
        for group in opt.param_groups:
            for p in group["params"]:
                if params:
                    self._claim(p, "parameters", retro)
                self._claim(p.grad, "gradients", retro)
        if state:
            for per_param in opt.state.values():
                for v in per_param.values() if isinstance(per_param, dict) else ():
                    if isinstance(v, torch.Tensor):
                        self._claim(v, "optimizer", retro)

    def _refresh(self) -> None:
        self._ledger.drain()
        if self.active:
            self._scan_registered()

    def _hook_grad(self, p: torch.Tensor) -> None:
        # A gradient is born as an anonymous backward output; the hook fires right
        # after it lands in .grad so it is re-labelled before it can skew the split.
        # Fake parameters (a FakeTensor, not an nn.Parameter, once built under a
        # FakeTensorMode) are hooked too when fake storages count; DTensor
        # parameters are not (FSDP2 assigns their sharded .grad itself).
        if not p.requires_grad or p in self._grad_hooked:
            return
        if type(p) is not torch.nn.Parameter and not (self._count_meta and _is_fake(p)):
            return

        def hook(param: torch.Tensor) -> None:
            with self._lock:
                self._claim(param.grad, "gradients")

        self._grad_hooked[p] = p.register_post_accumulate_grad_hook(hook)

    # ------------------------------------------------------------- global hooks
    def _install_hooks(self) -> None:
        # Parameters and existing state only need finding once per optimizer (new
        # state is allocated inside step(), where it is labelled as it is born);
        # gradients are re-checked every step, cheaply, as they come and go.
        seen = WeakIdKeyDictionary()  # optimizer -> number of state entries last scanned

        def before_step(opt):
            with self._lock:
                self._ledger.drain()
                self._scan_optimizer(opt, state=False, params=opt not in seen)

        def after_step(opt):
            if seen.get(opt) != len(opt.state):
                with self._lock:
                    self._ledger.drain()
                    self._scan_optimizer(opt, state=True, params=False)
                seen[opt] = len(opt.state)

        self._phases.install(before_step, after_step)
        orig = self._orig_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = orig(storage, size)
            self._on_resize(storage)
            return result

        torch.UntypedStorage.resize_ = resize_

    def _remove_hooks(self) -> None:
        self._phases.remove()
        for h in list(self._grad_hooked.values()):
            h.remove()
        self._grad_hooked = WeakIdKeyDictionary()
        if self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize
            self._orig_resize = None


# ---------------------------------------------------------------- process-wide API
def active_tracker() -> MemoryTracker | None:
    """The tracker running in this process, if any."""
    return _ACTIVE


def last_tracker() -> MemoryTracker | None:
    """The running tracker, else the last stopped one (until reset_peak_memory_stats())."""
    return _ACTIVE or _LAST


def start_tracking(module: torch.nn.Module | None = None, optimizers: Any = ()) -> MemoryTracker:
    """Start (or reuse) the process-wide tracker and register module/optimizers with it."""
    tracker = _ACTIVE or MemoryTracker()
    tracker.register(module, optimizers)
    return tracker.start()


def stop_tracking() -> MemoryTracker | None:
    """Stop the process-wide tracker; its peak stays readable via max_memory_allocated()."""
    tracker = _ACTIVE
    if tracker is not None:
        tracker.stop()
    return tracker


def track_memory(module: torch.nn.Module | None = None, optimizers: Any = ()) -> MemoryTracker:
    """Start tracking now; also usable as ``with track_memory(model, opt) as t:``.

    If a tracker is already running (e.g. a DeviceStatsMonitor's), the model and
    optimizers are registered with it and leaving a ``with`` block does not stop it.
    """
    fresh = _ACTIVE is None
    tracker = start_tracking(module, optimizers)
    if fresh:
        tracker._adoptable = True
    return tracker


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    if isinstance(device, int):
        return "cuda"
    return torch.device(device).type


def _tracker_or_warn() -> MemoryTracker | None:
    global _WARNED_OFF
    tracker = _ACTIVE or _LAST
    if tracker is None and not _WARNED_OFF:
        _WARNED_OFF = True
        warnings.warn(
            "shardwise.memory: tensor memory tracking is off, so CPU memory reads as 0. "
            "Turn it on with `with shardwise.track_memory(model, optimizer): ...` (or "
            "shardwise.memory.start_tracking()), or add "
            "shardwise.callbacks.DeviceStatsMonitor() to the Trainer's callbacks.",
            stacklevel=3,
        )
    return tracker


def max_memory_allocated(device=None) -> int:
    """Peak tensor bytes: torch.cuda's on CUDA, the tracked peak elsewhere (0 if off)."""
    if _device_type(device) == "cuda":
        return torch.cuda.max_memory_allocated(device)
    tracker = _tracker_or_warn()
    return tracker.peak_bytes if tracker is not None else 0


def memory_allocated(device=None) -> int:
    """Live tensor bytes: torch.cuda's on CUDA, the tracked current bytes elsewhere."""
    if _device_type(device) == "cuda":
        return torch.cuda.memory_allocated(device)
    tracker = _tracker_or_warn()
    return tracker.current_bytes if tracker is not None else 0


def reset_peak_memory_stats(device=None) -> None:
    """Reset the peak: torch.cuda's on CUDA; on CPU the running tracker's, or forget
    the last stopped tracker's peak."""
    global _LAST
    if _device_type(device) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _ACTIVE is not None:
        _ACTIVE.reset_peak()
    else:
        _LAST = None


# Whole-process RSS and byte strings live in sysmem.py; re-exported here so
# `shardwise.memory` stays the one place users look.
from shardwise.sysmem import (  # noqa: E402
    current_rss_bytes,
    format_bytes,
    parse_bytes,
    peak_rss_bytes,
    reset_peak_rss,
)
