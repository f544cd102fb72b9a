"""Record what a model's construction does on the meta device, and replay it on real tensors.

A model built in `configure_model` lives on the meta device, where nothing is
stored: nn.Linear's own init, nn.Transformer's xavier pass, nanoGPT's
`self.apply(self._init_weights)`, a Hugging Face `post_init` all run and write
nothing. `record_init()` watches that construction at the ATen level (a
TorchDispatchMode) and keeps every op that touches a meta tensor -- creations,
in-place writes, arithmetic -- with the CPU generator's state when it began.
`InitRecord.replay` later runs those ops again on CPU tensors, in the same
order, from the same generator state, so the random draws are the ones eager
construction makes: the weights are bitwise those of building the model
eagerly with the same seed, and the generator is left where eager
construction leaves it (dropout then draws the same masks). Each rank replays
the whole stream and keeps its own slice (strategies/materialize.py), so the
result does not depend on how the model is sharded.

Memory stays near one tensor at a time in the usual pattern (a layer's own
init, later overwritten by a parent's init pass): a write that a later full
overwrite makes dead is run on a throwaway tensor only when it draws random
numbers (to keep the stream), and a tensor is handed to the caller and freed
right after the last op that matters for it. What cannot be replayed (an op
with its own torch.Generator) is refused by name.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# Writers whose result does not depend on the target's previous values: a full write by one of
# them makes every earlier write to that tensor dead (its random draws still happen, on a temporary).
_OVERWRITES = {
    "uniform_",
    "normal_",
    "fill_",
    "zero_",
    "random_",
    "exponential_",
    "log_normal_",
    "cauchy_",
    "geometric_",
    "bernoulli_",
    "copy_",
}
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
_NOT_RECORDED = {"set_", "resize_", "_local_scalar_dense"}  # storage plumbing / scalar reads


# module -> (the construction that built it, name -> Ref of its own parameters and buffers)
_BOUND: "weakref.WeakKeyDictionary[nn.Module, Tuple[InitRecord, Dict[str, Ref]]]" = weakref.WeakKeyDictionary()


def recorded_tensors(module: nn.Module) -> Optional[Tuple["InitRecord", Dict[str, "Ref"]]]:
    """The not yet replayed construction that built `module`'s own tensors, and which tensor is which."""
    entry = _BOUND.get(module)
    return entry if entry is not None and not entry[0].replayed else None


def forget_recorded(module: nn.Module) -> None:
    """Drop the recordings of `module`'s tree (an init_weights() hook replaced the replay): their ops and
    constants need not live as long as the model."""
    for sub in module.modules():
        _BOUND.pop(sub, None)


class InitReplayError(RuntimeError):
    """The model's construction did something on the meta device that cannot be redone on real tensors."""


@dataclass(frozen=True)
class Ref:
    """A tensor as a view of a recorded storage: enough to rebuild it on the replayed storage."""

    sid: int
    dtype: torch.dtype
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int

    def covers(self, nbytes: int) -> bool:
        numel = 1
        for n in self.size:
            numel *= n
        contiguous = self.stride == tuple(torch.empty(self.size, device="meta").stride())
        return self.offset == 0 and contiguous and numel * self.dtype.itemsize == nbytes


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: Any
    outs: List[Ref]
    reads: Set[int]
    writes: Set[int]
    kills: Set[int]
    rng: bool
    live: bool = False


@dataclass
class InitRecord:
    """The ops of one construction, the generator state it started from, and which tensor is which."""

    start_state: torch.Tensor
    ops: List[_Op] = field(default_factory=list)
    nbytes: Dict[int, int] = field(default_factory=dict)
    replayed: bool = False

    def written(self, sids: Set[int]) -> Set[int]:
        """Which of `sids` some recorded op gives a value (a tensor only allocated stays uninitialised)."""
        return {s for op in self.ops for s in op.writes if s in sids}

    def replay(self, wanted: Set[int], emit: Callable[[int, torch.Tensor], None]) -> None:
        """Run the ops again on CPU from the recorded generator state; `emit(sid, storage)` each wanted one.

        The CPU generator is left in the state eager construction leaves it in.
        """
        if self.replayed:
            raise InitReplayError(
                "this model's recorded construction was already replayed once (a second setup of the same "
                "meta-built model); build it again in configure_model, or define init_weights()."
            )
        self.replayed = True
        _mark_live(self.ops, wanted, self.nbytes)
        last: Dict[int, int] = {}
        for i, op in enumerate(self.ops):
            if op.live:
                for sid in op.reads | op.writes:
                    last[sid] = i
        real: Dict[int, torch.UntypedStorage] = {}
        torch.random.set_rng_state(self.start_state)
        with torch.no_grad():
            for i, op in enumerate(self.ops):
                if not op.live and not op.rng:
                    continue
                _run(op, real if op.live else {}, self.nbytes)
                if not op.live:
                    continue
                for sid in op.reads | op.writes:
                    if last.get(sid) == i:
                        storage = real.pop(sid, None)
                        if sid in wanted and storage is not None:
                            emit(sid, storage)
        self.ops = []  # the constants and the plan are not needed again


def view_of(storage: torch.UntypedStorage, ref: Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)


def _mark_live(ops: List[_Op], wanted: Set[int], nbytes: Dict[int, int]) -> None:
    needed = set(wanted)
    for op in reversed(ops):
        op.live = bool(op.writes & needed)
        if op.live:
            needed -= op.kills
            needed |= op.reads


def _run(op: _Op, real: Dict[int, torch.UntypedStorage], nbytes: Dict[int, int]) -> None:
    created = {ref.sid for ref in op.outs} - op.reads - (op.writes - op.kills)

    def value(x: Any) -> Any:
        if isinstance(x, Ref):
            if x.sid not in real:
                # All-ones bits: NaN in every float dtype, so a value read before anything wrote it
                # (an allocation the construction never initialised) fails materialize.py's check.
                real[x.sid] = torch.UntypedStorage(nbytes[x.sid]).fill_(255)
            return view_of(real[x.sid], x)
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        return x

    out = op.func(*tree_map(value, op.args), **tree_map(value, op.kwargs))
    flat, _ = tree_flatten(out)
    for ref, t in zip(op.outs, [t for t in flat if isinstance(t, torch.Tensor)]):
        if ref.sid in created and ref.sid not in real:
            if (tuple(t.shape), tuple(t.stride()), t.storage_offset()) != (ref.size, ref.stride, ref.offset):
                raise InitReplayError(f"replaying {op.func} gave another layout than on the meta device")
            real[ref.sid] = t.untyped_storage()


class record_init(TorchDispatchMode):
    """While a model is built on the meta device: keep what it does, to redo it on real tensors later."""

    def __init__(self) -> None:
        super().__init__()
        self.record = InitRecord(start_state=torch.random.get_rng_state())
        self._keep: List[torch.Tensor] = []  # the meta tensors seen: their storage ids must stay unique
        self._modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._handles: List[Any] = []

    def __enter__(self) -> "record_init":
        self.record.start_state = torch.random.get_rng_state()

        def registered(module: nn.Module, name: str, value: Any) -> None:
            self._modules.add(module)
            if isinstance(value, nn.Module):  # a deep copy (nn.TransformerEncoder's layers) registers no tensors
                self._modules.add(value)

        hooks = torch.nn.modules.module
        self._handles = [
            hooks.register_module_parameter_registration_hook(registered),
            hooks.register_module_buffer_registration_hook(registered),
            hooks.register_module_module_registration_hook(registered),
        ]
        self._handles.append(_hf_init_on_meta())
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        modules = {id(m): m for seen in list(self._modules) for m in seen.modules()}
        for module in modules.values():
            bound = {}
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if isinstance(t, torch.Tensor) and t.is_meta and _sid(t) in self.record.nbytes:
                        bound[name] = self._ref(t)
            if bound:
                _BOUND[module] = (self.record, bound)
        self._keep = []

    def _ref(self, t: torch.Tensor) -> Ref:
        sid = _sid(t)
        if sid not in self.record.nbytes:
            self.record.nbytes[sid] = t.untyped_storage().nbytes()
            self._keep.append(t)
        return Ref(sid, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        flat_out, _ = tree_flatten(out)
        metas = [t for t in flat_in + flat_out if isinstance(t, torch.Tensor) and t.is_meta]
        name = func.overloadpacket.__name__
        if not metas or func.is_view or name in _NOT_RECORDED or name in ("detach", "alias", "lift_fresh"):
            return out
        if kwargs.get("generator") is not None:
            raise InitReplayError(
                f"the model's construction calls {name} with its own torch.Generator on the meta device, "
                "which cannot be replayed when the weights are allocated. Draw from the default generator "
                "(seed it with seed_everything), or build that layer in __init__ with real tensors."
            )
        known = set(self.record.nbytes)
        writes: Set[int] = set()
        for arg, value in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                writes.add(_sid(value))
        for arg in func._schema.arguments:
            value = kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                writes.add(_sid(value))

        def convert(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return self._ref(x) if x.is_meta else x.detach().clone()
            return x

        rec_args, rec_kwargs = tree_map(convert, args), tree_map(convert, kwargs)
        outs = [self._ref(t) for t in flat_out if isinstance(t, torch.Tensor) and t.is_meta]
        created = {r.sid for r in outs} - known
        if name in _ALLOCATIONS:  # storage without values: an initialiser must still write it
            writes, created = set(), set()
        reads = {r.sid for r in tree_flatten((rec_args, rec_kwargs))[0] if isinstance(r, Ref)}
        kills = set(created)
        target = rec_args[0] if rec_args else None
        if name in _OVERWRITES and isinstance(target, Ref) and target.covers(self.record.nbytes[target.sid]):
            if name != "copy_" or not (isinstance(rec_args[1], Ref) and rec_args[1].sid == target.sid):
                kills.add(target.sid)
                reads.discard(target.sid)
        self.record.ops.append(
            _Op(
                func,
                rec_args,
                rec_kwargs,
                outs,
                reads=reads,
                writes=writes | created,
                kills=kills,
                rng=torch.Tag.nondeterministic_seeded in func.tags,
            )
        )
        return out


class _Restore:
    def __init__(self, undo: Callable[[], None]) -> None:
        self.remove = undo


def _hf_init_on_meta() -> _Restore:
    """Make a Hugging Face model's post_init run its weight init on the meta device too, so it is recorded.

    transformers skips `initialize_weights()` when the default device is meta ("there is no point");
    here there is: the recording replays it, as `from_config` on a real device would have run it.
    """
    mu = sys.modules.get("transformers.modeling_utils")
    if mu is None:
        return _patch_on_import()
    model = getattr(mu, "PreTrainedModel", None)
    if model is None or not hasattr(mu, "get_torch_context_manager_or_global_device"):
        return _Restore(lambda: None)
    original = model.init_weights

    def init_weights(self: Any) -> Any:
        device_of = mu.get_torch_context_manager_or_global_device
        mu.get_torch_context_manager_or_global_device = lambda: torch.device("cpu")
        try:
            return original(self)
        finally:
            mu.get_torch_context_manager_or_global_device = device_of

    model.init_weights = init_weights

    def undo() -> None:
        model.init_weights = original

    return _Restore(undo)


def _patch_on_import() -> _Restore:
    """transformers imported for the first time inside the construction: patch it as soon as it loads
    (a later patch would run post_init's draws after the head's own, not between them as eagerly)."""
    state: Dict[str, Any] = {"restore": None}

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            if name != "transformers.modeling_utils":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                load(module)
                state["restore"] = _hf_init_on_meta()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    finder = Finder()
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        if state["restore"] is not None:
            state["restore"].remove()

    return _Restore(undo)


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
