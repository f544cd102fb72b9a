"""What Lightning, Accelerate and torch's FSDP1 call FSDP's settings, turned into FSDPStrategy's.

Users arrive with `FSDPStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
cpu_offload=CPUOffload(offload_params=True), use_orig_params=True, ...)` or an
Accelerate config (`fsdp_sharding_strategy: 1`). Each spelling is mapped here
to the one FSDPStrategy understands; a setting FSDP2 has no use for is
accepted and explained once per process (`note_once`), never silently dropped
and never a TypeError. The table of every name lives in shardwise/compat.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any, Iterator, List, Optional, Set, Tuple

import torch
from torch import nn

from shardwise.strategies.parallel import SHARDINGS

# torch's ShardingStrategy enum values, which Accelerate also writes as numbers in its yaml.
_BY_NUMBER = {1: "FULL_SHARD", 2: "SHARD_GRAD_OP", 3: "NO_SHARD", 4: "HYBRID_SHARD", 5: "_HYBRID_SHARD_ZERO2"}

# Settings FSDP2 has nothing to do for, and why (said once per process when passed).
NOTHING_TO_DO = {
    "use_orig_params": "FSDP2 always keeps the original parameters (each one is a DTensor holding its own "
    "shard; there is no flat parameter), which is what use_orig_params=True asked FSDP1 for",
    "sync_module_states": "shardwise builds the model on the meta device and every rank materialises its own "
    "shard with the same seed-determined init (or loads it from the checkpoint / weights "
    "files), so there is nothing to broadcast from rank 0",
    "backward_prefetch": "FSDP2 always issues the next unit's all-gather before the current unit's backward "
    "(BACKWARD_PRE's behaviour); there is nothing to choose",
    "forward_prefetch": "FSDP2 overlaps each unit's all-gather with the previous unit's compute on its own; "
    "shardwise does not configure explicit forward prefetching",
    "limit_all_gathers": "FSDP2 always rate-limits its all-gathers by design, which is what "
    "limit_all_gathers=True asked FSDP1 for",
    "cpu_ram_efficient_loading": "shardwise never loads a full copy per rank: the model is built on the meta "
    "device and each rank materialises or loads only its own shard",
}

_noted: Set[str] = set()


def note_once(key: str, message: str, stacklevel: int = 3) -> None:
    """Warn once per process: the same strategy is often built on every rank and again at each fit."""
    if key in _noted:
        return
    _noted.add(key)
    warnings.warn(message, UserWarning, stacklevel=stacklevel)


def note_accepted(name: str, value: Any) -> None:
    # stacklevel: the warning points at the user's FSDPStrategy(...) line.
    note_once(
        name, f"FSDPStrategy({name}={value!r}) is accepted and has nothing to do: {NOTHING_TO_DO[name]}.", stacklevel=4
    )


def sharding_strategy_name(value: Any) -> Tuple[str, Optional[bool]]:
    """(one of parallel.SHARDINGS, reshard_after_forward it implies or None).

    Accepts our strings in any case, torch's ShardingStrategy enum, and
    Accelerate's numbers (1-5, also as strings). _HYBRID_SHARD_ZERO2 is
    HYBRID_SHARD keeping parameters gathered between forward and backward.
    """
    name = getattr(value, "name", value)  # torch.distributed.fsdp.ShardingStrategy.X -> "X"
    if isinstance(name, str) and name.strip().isdigit():
        name = int(name.strip())
    if isinstance(name, int) and not isinstance(name, bool):
        name = _BY_NUMBER.get(name, str(name))
    name = str(name).strip().upper()
    if name == "_HYBRID_SHARD_ZERO2":
        return "HYBRID_SHARD", False
    if name not in SHARDINGS:
        raise ValueError(
            f"Unknown sharding_strategy {value!r}. Valid: {', '.join(SHARDINGS)} (as strings, "
            "torch.distributed.fsdp.ShardingStrategy members or Accelerate's numbers 1-5)."
        )
    return name, None


def offload_flag(value: Any) -> bool:
    """cpu_offload as a bool: True/False, torch's CPUOffload(offload_params=...), or a CPUOffloadPolicy."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if hasattr(value, "offload_params"):  # torch.distributed.fsdp.CPUOffload (FSDP1)
        return bool(value.offload_params)
    if type(value).__name__ == "CPUOffloadPolicy":  # FSDP2's own policy object
        if not getattr(value, "pin_memory", True):
            note_once(
                "cpu_offload.pin_memory",
                "FSDPStrategy(cpu_offload=CPUOffloadPolicy(pin_memory=False)): "
                "shardwise offloads with pinned host memory; pin_memory=False is not honoured.",
            )
        return True
    if isinstance(value, (int, str)) and str(value).lower() in ("0", "1", "true", "false"):
        return str(value).lower() in ("1", "true")
    raise TypeError(f"cpu_offload={value!r}: pass True/False or torch.distributed.fsdp.CPUOffload(offload_params=...).")


def state_dict_type_name(value: Any) -> str:
    """ "sharded" / "full" from Lightning's strings, Accelerate's names or torch's StateDictType enum."""
    name = str(getattr(value, "name", value)).strip().lower()
    name = {"sharded_state_dict": "sharded", "full_state_dict": "full"}.get(name, name)
    if name in ("sharded", "full"):
        return name
    if name == "local_state_dict":
        raise ValueError(
            "state_dict_type=LOCAL_STATE_DICT is FSDP1's flat-parameter format, which FSDP2 does not "
            "have. Use 'sharded' (torch.distributed.checkpoint, resumable at any world size) or 'full'."
        )
    raise ValueError(
        f"Unknown state_dict_type {value!r}. Valid: 'sharded' (SHARDED_STATE_DICT) or 'full' (FULL_STATE_DICT)."
    )


_PRECISION_BY_DTYPE = {
    torch.bfloat16: "bf16-mixed",
    torch.float16: "16-mixed",
    torch.float32: "32-true",
    None: "32-true",
}


def precision_from_mixed_precision(mp: Any) -> str:
    """The precision name for FSDP1's MixedPrecision or FSDP2's MixedPrecisionPolicy.

    Parameters stay fp32 (the optimizer updates them), compute runs in
    param_dtype and gradients are reduced in fp32 -- what "bf16-mixed" means
    for FSDPStrategy. A different reduce_dtype / buffer_dtype is named.
    """
    if isinstance(mp, str):
        return mp  # a precision name ("bf16-mixed"), as Lightning's Fabric also takes
    if not hasattr(mp, "param_dtype"):
        raise TypeError(
            f"mixed_precision={mp!r}: pass torch.distributed.fsdp.MixedPrecision(param_dtype=...), "
            "MixedPrecisionPolicy(...), or a precision name such as 'bf16-mixed'."
        )
    if mp.param_dtype not in _PRECISION_BY_DTYPE:
        raise ValueError(f"mixed_precision param_dtype={mp.param_dtype} is not supported; use bfloat16 or float16.")
    name = _PRECISION_BY_DTYPE[mp.param_dtype]
    ignored = [
        f"{field}={getattr(mp, field)}"
        for field in ("reduce_dtype", "buffer_dtype")
        if getattr(mp, field, None) not in (None, torch.float32)
    ]
    if ignored:
        note_once(
            "mixed_precision.dtypes",
            f"FSDPStrategy(mixed_precision=...) maps to precision={name!r}, which "
            f"reduces gradients in fp32 and keeps buffers in fp32; {', '.join(ignored)} is not honoured.",
        )
    return name


@functools.lru_cache(maxsize=1)
def fsdp_keeps_integer_params() -> bool:
    """Whether this torch's fully_shard can shard a frozen integer parameter (QLoRA's uint8 4-bit codes).

    torch 2.11's FSDP2 wraps each shard as `nn.Parameter(shard)`, whose default requires_grad=True is
    refused for integer dtypes ("only Tensors of floating point dtype can require gradients", seen on
    an H200 with torch 2.11+cu130); later releases pass the original parameter's requires_grad. Read from
    the installed source, since the fix has no flag of its own; unreadable source counts as the old code.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        source = inspect.getsource(FSDPParam._init_sharded_param)
    except (ImportError, AttributeError, OSError, TypeError):
        return False
    return "requires_grad=param.requires_grad" in source.replace(" ", "")


def integer_params_to_ignore(module: nn.Module, shard_degree: int) -> Set[nn.Parameter]:
    """Frozen integer parameters fully_shard must leave alone on a torch that cannot shard them.

    Empty where torch shards them (the normal case). On one shard nothing is lost by leaving them
    unsharded: each stays a plain tensor on its device. Across several shards they would be held whole
    on every rank, which silently multiplies the 4-bit base's memory, so that is refused with the fix.
    """
    integer = {p for p in module.parameters() if not p.dtype.is_floating_point and not p.dtype.is_complex}
    if not integer or fsdp_keeps_integer_params():
        return set()
    if shard_degree > 1:
        raise RuntimeError(
            f"This torch ({torch.__version__}) cannot shard integer parameters with FSDP2: its fully_shard "
            f"asks each shard for gradients, which integer tensors refuse, and {len(integer)} such parameter(s) "
            "are here (QLoRA's packed 4-bit codes). Sharding them over "
            f"{shard_degree} ranks needs a torch whose fully_shard keeps their requires_grad=False (2.13 does, "
            "2.11 does not). Upgrade torch, or train on one process (devices=1), where they are kept unsharded "
            "at no cost."
        )
    return integer


def manual_units(module: nn.Module, auto_wrap_policy: Any) -> list:
    """Lightning's `strategy="fsdp"` (no wrap policy) for a manual-optimization module: each child network
    holding parameters a unit of its own, so each forward gathers its current shards, including one after
    an optimizer step inside training_step (a GAN's generator and discriminator). Without a policy the
    root unit alone would hold them, gathered once per training_step, which FSDPStrategy.manual_model
    refuses. Automatic optimization, or a policy given, selects nothing here."""
    if auto_wrap_policy is not None or getattr(module, "automatic_optimization", True):
        return []
    return [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]


def plain_class(module: nn.Module) -> type:
    """The user's class of a module fully_shard has made a unit (FSDP2 gives it a class FSDP<name> of its own)."""
    from torch.distributed.fsdp import FSDPModule

    return next(k for k in type(module).__mro__ if not issubclass(k, FSDPModule))


def _param_groups(unit: nn.Module) -> List[Any]:
    """The FSDPParamGroups of one fully_shard unit (torch 2.13 keeps a list; earlier ones a single group)."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


# Sent by rank 0 when its hook has returned (or raised): the other ranks stop serving its forwards.
_DONE = -1
# Set while a rank-0-only block runs, so a marked hook that calls another one adds no second protocol.
_serving = False


def _send(index: int) -> None:
    """Rank 0 tells every other rank which unit its forward gathers next (or _DONE): one int64 broadcast."""
    from shardwise.distributed import ops

    torch.distributed.broadcast(torch.tensor([index], device=ops.collective_device()), src=0)


def _receive() -> int:
    from shardwise.distributed import ops

    box = torch.empty(1, dtype=torch.int64, device=ops.collective_device())
    torch.distributed.broadcast(box, src=0)
    return int(box.item())


@contextlib.contextmanager
def gather_for_rank_zero(model: nn.Module) -> Iterator[None]:
    """Entered by every rank around code that runs on rank 0 alone (a @rank_zero_only hook), so that a
    forward it makes through FSDP units gathers their shards with the other ranks' help, one unit at a time.

    Rank 0 runs the block with a forward pre-hook on each unit, ahead of FSDP2's own: before a unit whose
    parameters are sharded gathers them, rank 0 broadcasts the unit's index; the other ranks wait in
    `_serve`, join that all-gather (`unshard()`) and drop the result (`reshard()`). When the block ends,
    normally or by an exception, rank 0 broadcasts _DONE. A block that runs no forward costs that one
    broadcast and gathers nothing.

    Inside the block every unit rank 0 gathers is resharded after its forward (a local free), so a second
    forward gathers again through the same protocol (the root too, which FSDP2 otherwise keeps whole after
    forward), and a unit still unsharded at the end (a forward that raised) is resharded locally: each rank
    leaves with the units in the state it entered with. Units already unsharded on entry are whole on
    every rank alike and stay so. FSDP2's records of forward order (backward prefetching) are put back,
    and explicit forward prefetching (`set_modules_to_forward_prefetch`), which would gather units rank 0
    does not announce, is switched off for the block."""
    global _serving
    from torch.distributed.fsdp import FSDPModule

    from shardwise.distributed import ops

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units or _serving or not ops.is_initialized() or ops.world_size() == 1:
        yield
        return
    _serving = True
    try:
        if ops.rank() == 0:
            with _announcing(units):
                yield
        else:
            _serve(units)
            yield
    finally:
        _serving = False


def _serve(units: List[nn.Module]) -> None:
    """The other ranks' side: gather what rank 0 announces, free it at once, until _DONE."""
    while True:
        index = _receive()
        if index == _DONE:
            return
        groups = _param_groups(units[index])
        sharded = [group for group in groups if not group.is_unsharded]
        units[index].unshard()  # the all-gather FSDP2's pre-forward issues on rank 0
        for group in sharded:
            group.reshard()


@contextlib.contextmanager
def _announcing(units: List[nn.Module]) -> Iterator[None]:
    """Rank 0's side: announce each unit before FSDP2's pre-forward gathers it."""
    groups = [group for unit in units for group in _param_groups(unit)]
    states = {id(state): state for state in (unit._get_fsdp_state() for unit in units)}.values()
    sharded_on_entry = [group for group in groups if not group.is_unsharded]
    resharding = {id(group) for group in sharded_on_entry}
    saved = [(group, group.post_forward_mesh_info, list(group._post_forward_indices)) for group in groups]
    orders = {id(group.comm_ctx): (group.comm_ctx, list(group.comm_ctx.post_forward_order)) for group in groups}
    prefetch = [(state, list(state._states_to_forward_prefetch)) for state in states]
    for group in groups:
        # Reshard after forward (to the whole shard group, not to a smaller post-forward mesh, whose later
        # gather the other ranks could not match) where the unit is sharded now; keep the others whole.
        group.post_forward_mesh_info = group.mesh_info if id(group) in resharding else None
    for state, _ in prefetch:
        state._states_to_forward_prefetch = []

    def announce(index: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if any(not group.is_unsharded for group in _param_groups(module)):
                _send(index)

        return hook

    handles = [unit.register_forward_pre_hook(announce(index), prepend=True) for index, unit in enumerate(units)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        try:
            _send(_DONE)
        finally:
            for group in sharded_on_entry:
                if group.is_unsharded:  # a forward that raised before its post-forward
                    group.reshard()
            for group, mesh_info, indices in saved:
                group.post_forward_mesh_info = mesh_info
                group._post_forward_indices[:] = indices
            for ctx, order in orders.values():
                ctx.post_forward_order[:] = order
            for state, targets in prefetch:
                state._states_to_forward_prefetch = targets
