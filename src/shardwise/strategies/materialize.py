"""Meta-device models -> real, initialised weights, the same under every strategy.

`configure_model` runs on the meta device, so a 70B model costs nothing until
it is sharded. Afterwards each strategy calls `materialize_module`: allocate
(only the local shards, for FSDP), fill with a sentinel, initialise, and
check that every tensor was written. Uninitialised memory never reaches
training: a parameter or buffer nobody wrote is an error naming the module.

Initialisation is sharding-invariant. Each module's `reset_parameters()` runs
under an RNG seeded from (global seed, the module's name), on full-size
temporary copies of its own parameters, and each rank keeps its slice. So the
same seed gives bitwise the same weights on one device, under DDP, and under
FSDP at any world size -- the property that makes loss curves comparable
across strategies (and the parity tests possible). It is device-invariant
too: the temporaries are CPU tensors even when the model lives on a GPU,
because CUDA's generator (Philox) draws other numbers than the CPU's from the
same seed, so a GPU run would otherwise start from other weights under
`cpu_offload` (initialised on the host) than without, and than a CPU run. Modules are visited
children-first, matching eager construction, where a parent's own init code
(e.g. nn.MultiheadAttention zeroing out_proj.bias) runs after its children's.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor, Replicate, Shard  # DTensor: what FSDP2 parameters are
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp dimension over tp

from shardwise.adapters.quantize import reset_4bit_fn
from shardwise.seed import module_seed, rng_devices
from shardwise.strategies.init_replay import (
    InitRecord,
    Ref,
    forget_recorded,
    record_init,
    recorded_tensors,
    view_of,
)


class UninitializedParameterError(RuntimeError):
    """A parameter or buffer was left uninitialised after meta-device materialisation."""


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    for t in module.parameters():
        yield t
    for t in module.buffers():
        yield t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def find_reset_fn(module: nn.Module) -> Optional[Callable[[], None]]:
    """The module's own initialisation (reset_parameters), or None when it has none."""
    fourbit = reset_4bit_fn(module)  # packed NF4 codes: nn.Linear's init cannot write them
    if fourbit is not None:
        return fourbit
    fn = getattr(module, "reset_parameters", None)
    if callable(fn):
        return fn
    # nn.MultiheadAttention (and nn.Transformer) keep their init private; it is
    # the classic meta-init trap: in_proj_weight stays garbage otherwise.
    if isinstance(module, nn.MultiheadAttention):
        return module._reset_parameters
    return None


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


def mesh_coordinate(mesh: Any, rank: int) -> Optional[List[int]]:
    """Where global `rank` sits in `mesh` (None when it is not a member)."""
    hits = (mesh.mesh == rank).nonzero()
    return hits[0].tolist() if len(hits) else None


def shard_slices(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[Any]
) -> Tuple[slice, ...]:
    """The slice of the full tensor that mesh coordinate `coord` holds (Shard / Replicate placements).

    Shard(d) splits like torch.chunk: ceil(n / k) rows per rank, the last ones shorter or empty --
    what DTensor and FSDP2 do. FSDP2 over tensor-parallel parameters (2-D, dp x tp) marks the dp
    dimension _StridedShard: that split happened after the tp split to its right, so it is applied
    last (a rank's rows are then still one contiguous block). Other strided layouts are refused.
    """
    strided = [d for d, p in enumerate(placements) if isinstance(p, _StridedShard)]
    order = [d for d, p in enumerate(placements) if d not in strided] + strided
    bounds = [[0, n] for n in global_shape]
    for mesh_dim in order:
        placement = placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):  # Partial holds no slice of anything
            raise NotImplementedError(f"slicing supports Shard/Replicate placements, got {placement}")
        if mesh_dim in strided:
            later = [e for e in range(mesh_dim + 1, len(placements)) if _shards(placements[e], placement.dim)]
            if placement.split_factor != math.prod(mesh_shape[e] for e in later) or any(e in strided for e in later):
                raise NotImplementedError(f"slicing supports FSDP2's dp x tp layout, got placements {placements}")
        start, stop = bounds[placement.dim]
        length = stop - start
        chunk = -(-length // mesh_shape[mesh_dim]) if length else 0
        lo = min(start + coord[mesh_dim] * chunk, stop)
        bounds[placement.dim] = [lo, min(lo + chunk, stop)]
    return tuple(slice(a, b) for a, b in bounds)


def _shards(placement: Any, dim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim == dim


def _slice_for(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
    mesh = dt.device_mesh
    return full[shard_slices(dt.shape, mesh.shape, mesh.get_coordinate(), dt.placements)]


def reset_own(module: nn.Module, fn: Callable[[], None]) -> None:
    """Run a module's init on full-size CPU copies of its own tensors, keep our part.

    DTensors (FSDP shards) and tensors on another device (a GPU) are swapped
    for CPU temporaries; plain CPU tensors are initialised in place. The cost
    on a GPU is one host allocation and one host-to-device copy per tensor,
    and the init's arithmetic at CPU speed (see BENCHMARKS.md's issue-15 note).
    """
    swapped: List[Tuple[Dict, str, torch.Tensor]] = []
    for store in (module._parameters, module._buffers):
        for name, t in store.items():
            if t is None or (not isinstance(t, DTensor) and _local(t).device.type == "cpu"):
                continue
            full = torch.empty(tuple(t.shape), dtype=t.dtype)
            temp = nn.Parameter(full, requires_grad=t.requires_grad) if store is module._parameters else full
            swapped.append((store, name, t))
            store[name] = temp
    try:
        fn()
    finally:
        for store, name, original in swapped:
            value = store[name].detach()  # the init may have assigned a new tensor
            store[name] = original
            _local(original).copy_(_slice_for(value, original) if isinstance(original, DTensor) else value)


@torch.no_grad()
def materialize_module(
    module: nn.Module, device: torch.device, seed: int, init_weights: Optional[Callable[[], None]] = None
) -> int:
    """Allocate meta tensors on `device` and initialise them; return how many were materialised.

    `init_weights`: the user's TrainModule.init_weights hook, which replaces
    the per-module reset_parameters pass when defined.
    """

    def named_tensors() -> List[Tuple[str, torch.Tensor]]:
        out = []
        for prefix, mod in module.named_modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(mod, kind).items():
                    if t is not None:
                        out.append((f"{prefix}.{name}" if prefix else name, t))
        return out

    before = named_tensors()
    meta_names = {name for name, t in before if t.is_meta}
    if not meta_names:
        return 0
    # Tensors that already hold real values (layers built in __init__) survive
    # to_empty: keep references to their old storage and copy them back.
    real = {name: _local(t) for name, t in before if not t.is_meta}
    module.to_empty(device=device)
    targets = named_tensors()
    for _, t in targets:
        _fill_sentinel(_local(t))
    # A DTensor written through its own ops bumps only the wrapper's version
    # counter, one written through its local shard only the shard's: watch both.
    versions = {id(t): (t._version, _local(t)._version) for _, t in targets}

    if init_weights is not None:
        forget_recorded(module)
        init_weights()
    else:
        replays = recorded_targets(module, meta_names)
        replayed = {id(t) for _, by_sid in replays for ts in by_sid.values() for t, _ in ts}
        reset_each_module(module, seed, skip=replayed, device=device)
        for record, by_sid in replays:
            record.replay(set(by_sid), lambda sid, storage, by_sid=by_sid: _write_replayed(storage, by_sid[sid]))
    for name, t in targets:
        if name in real:
            _local(t).copy_(real[name])
    targets = [(name, t) for name, t in targets if name in meta_names]
    check_initialized(targets, versions, user_hook=init_weights is not None)
    return len(meta_names)


@torch.no_grad()
def reset_each_module(
    module: nn.Module, seed: int, skip: Optional[set] = None, device: Optional[torch.device] = None
) -> None:
    """Each module's own reset_parameters() under its per-module seed, children first (the module docstring).

    The initialisation for tensors no recorded construction wrote; also usable from an init_weights() hook
    to get the same weights under every engine, ZeRO-3's zero.Init included (`skip`: ids of tensors the
    replay writes, whose modules are left alone).
    """
    for fqn, mod in reversed(list(module.named_modules())):  # children first, as eager construction
        fn = find_reset_fn(mod)
        own = [t for t in list(mod._parameters.values()) + list(mod._buffers.values()) if t is not None]
        if fn is None or (skip and own and all(id(t) in skip for t in own)):
            continue  # the replayed construction writes this module's tensors
        with torch.random.fork_rng(devices=rng_devices(device)):
            torch.manual_seed(module_seed(seed, fqn))
            reset_own(mod, fn)


def recorded_targets(
    module: nn.Module, meta_names: set
) -> List[Tuple[InitRecord, Dict[int, List[Tuple[torch.Tensor, Ref]]]]]:
    """The tensors a recorded construction (init_replay.py) gives values, grouped by construction and storage.

    Only tensors that were on the meta device and that some recorded op wrote count: a tensor the
    construction only allocated is left to the module's reset_parameters() and the sentinel check.
    """
    by_record: Dict[int, Tuple[InitRecord, Dict[int, List[Tuple[torch.Tensor, Ref]]]]] = {}
    for prefix, mod in module.named_modules():
        entry = recorded_tensors(mod)
        if entry is None:
            continue
        record, refs = entry
        _, targets = by_record.setdefault(id(record), (record, {}))
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                fqn = f"{prefix}.{name}" if prefix else name
                if t is not None and name in refs and fqn in meta_names:
                    targets.setdefault(refs[name].sid, []).append((t, refs[name]))
    out = []
    for record, targets in by_record.values():
        written = record.written(set(targets))
        out.append((record, {sid: ts for sid, ts in targets.items() if sid in written}))
    return out


def _write_replayed(storage: torch.UntypedStorage, targets: List[Tuple[torch.Tensor, Ref]]) -> None:
    for t, ref in targets:
        full = view_of(storage, ref)
        _local(t).copy_(_slice_for(full, t) if isinstance(t, DTensor) else full)


def check_initialized(
    targets: List[Tuple[str, torch.Tensor]], versions: Dict[int, int], user_hook: bool = False
) -> None:
    bad = []
    for name, t in targets:
        local = _local(t)
        untouched = (t._version, local._version) == versions[id(t)]
        # Packed 4-bit codes (adapters/quantize.py) stored as floats may read as NaN: written is enough.
        floats = local.is_floating_point() and not getattr(t, "packed_codes", False)
        has_nan = floats and local.numel() > 0 and bool(torch.isnan(local).any())
        if untouched or has_nan:
            bad.append((name, "never written" if untouched else "contains the uninitialised sentinel (NaN)"))
    if not bad:
        return
    listing = "\n".join(f"  - {name}: {why}" for name, why in bad[:20])
    more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
    owners = sorted({name.rsplit(".", 1)[0] if "." in name else "<root>" for name, _ in bad})
    fix = (
        "your TrainModule.init_weights() must initialise every parameter and buffer"
        if user_hook
        else "give the owning module(s) a reset_parameters() method that initialises their own "
        "parameters and buffers (including computed buffers such as positional tables), or "
        "define TrainModule.init_weights() to initialise the whole model"
    )
    raise UninitializedParameterError(
        f"{len(bad)} tensor(s) were not initialised after building the model on the meta device:\n"
        f"{listing}{more}\nModules: {', '.join(owners[:10])}.\nFix: {fix}. "
        "(Or build those layers in __init__ instead of configure_model so they are created with real values.)"
    )


# ------------------------------------------------------ writes lost on meta
# In-place by name but writing no values: flags and storage placement.
_NOT_WRITES = {"requires_grad_", "share_memory_", "detach_", "rename_", "refine_names_", "retain_grad"}
_INIT_FRAMES = {
    "__init__",
    "reset_parameters",
    "_reset_parameters",
    "_init_weights",
    "post_init",
    "init_weights",
    "_initialize_weights",
}


class DiscardedInitError(RuntimeError):
    """configure_model() wrote values into meta tensors, where nothing is stored."""


class watch_meta_writes(torch.overrides.TorchFunctionMode):
    """While configure_model runs: note in-place writes to meta parameters/buffers made outside construction.

    A module's own __init__ / reset_parameters writes are redone by the
    materialisation above; anything else (a custom nn.init call, a
    load_state_dict) is lost on the meta device, so it is reported instead of
    silently replaced by the default initialisation.
    """

    def __init__(self) -> None:
        super().__init__()
        self.writes: Dict[int, str] = {}  # one entry per parameter written
        self.recorder: Optional[record_init] = None

    def __enter__(self) -> "watch_meta_writes":
        # Under the planner's fake tensors nothing is allocated, so there is nothing to replay.
        if active_fake_mode() is None:
            self.recorder = record_init()
            self.recorder.__enter__()
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.recorder is not None:
            self.recorder.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        if (
            name.endswith("_")
            and not name.startswith("_")
            and name not in _NOT_WRITES
            and isinstance(target, torch.Tensor)
            and target.is_meta
            and isinstance(target, nn.Parameter)
            and not self._in_construction()
        ):
            self.writes.setdefault(id(target), f"{name} at {self._user_frame()}")
        return func(*args, **kwargs)

    @staticmethod
    def _in_construction() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name in _INIT_FRAMES and isinstance(frame.f_locals.get("self"), nn.Module):
                return True
            frame = frame.f_back
        return False

    @staticmethod
    def _user_frame() -> str:
        frame = sys._getframe(2)
        torch_dir = os.path.dirname(torch.__file__)
        here = os.path.dirname(os.path.dirname(__file__))
        while frame is not None:
            path = frame.f_code.co_filename
            if not path.startswith(torch_dir) and not path.startswith(here):
                return f"{os.path.basename(path)}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"

    def check(self) -> None:
        if not self.writes:
            return
        shown = "; ".join(dict.fromkeys(list(self.writes.values())[:5]))
        raise DiscardedInitError(
            f"configure_model() writes values into {len(self.writes)} parameter(s) while the model is on the meta "
            f"device, where nothing is stored ({shown}), so they would silently get the default initialisation "
            "instead. Move that code into TrainModule.init_weights(), which runs on the materialised weights under "
            "every strategy (it replaces the default initialisation: initialise every tensor there, e.g. call each "
            "module's reset_parameters() first). To load pretrained weights, use fit(ckpt_path=...) or load them "
            "in init_weights()."
        )
