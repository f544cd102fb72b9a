"""torch.compile per repeated block, in torchtitan's order, and a watch on dynamo's recompilations.

`Trainer(compile=True)` (or `FSDPStrategy(compile=True)`, `ParallelPlan(compile="blocks")`) compiles each
repeated block of the model -- the FSDP units, else the classes the strategy checkpoints, else Hugging Face's
`_no_split_modules`, else the children of an `nn.ModuleList` that all share one class (the bundled GPT's
`blocks`, `nn.TransformerEncoder.layers`) -- after activation checkpointing wrapped it and before FSDP shards
it. Identical blocks share one compiled graph (dynamo treats a module's parameters as inputs), so compile
time does not grow with depth, and each block's FSDP hooks stay outside the compiled code: the block's own
`forward` is replaced by its compiled form, which also leaves parameter names, state dicts and checkpoints
exactly as in an eager run. `compile="model"` compiles each network the TrainModule holds as a whole
instead. The memory planner traces the eager model (nothing is compiled under fake tensors).

Recompilation is the known cost of compile (a guard fails -- a new shape, dtype or Python value -- and the
function is compiled again, seconds to minutes each; at `torch._dynamo.config.recompile_limit` dynamo gives up
and runs it eagerly). `RecompileWatch` counts them per function from dynamo's own compilation records, and
once one function recompiled more than `max_recompiles` times after the first optimizer step it warns, once,
with the guard dynamo reports as the cause and the usual fixes.
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

COMPILE_MODES = ("none", "blocks", "model")

CompileArg = Union[None, bool, str, Dict[str, Any], "CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """How to compile (`Trainer(compile=CompileOptions(...))`; `True` is `CompileOptions()`).

    mode: "blocks" (each repeated block on its own, torchtitan's per-block compile) or "model" (each network
        the TrainModule holds, as a whole).
    blocks: the block classes (or class names) to compile; None finds them (the module docstring's order).
    backend, fullgraph, dynamic, options: passed to `torch.compile` (options: the backend's, e.g. inductor's
        {"max_autotune": True}; dynamic None lets dynamo make a dimension dynamic once it changes).
    max_recompiles: recompilations of one function after the first optimizer step before the run warns.
    """

    mode: str = "blocks"
    blocks: Any = field(default=None, hash=False)
    backend: Union[str, Callable[..., Any]] = "inductor"
    fullgraph: bool = False
    dynamic: Optional[bool] = None
    options: Optional[Dict[str, Any]] = field(default=None, hash=False)
    max_recompiles: int = 4

    def __post_init__(self) -> None:
        mode = str(self.mode).lower()
        object.__setattr__(self, "mode", mode)
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"CompileOptions(mode={self.mode!r}): use 'blocks' (per repeated block) or 'model'.")
        limit = self.max_recompiles
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"CompileOptions(max_recompiles={limit!r}): use a whole number, 0 or more.")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"CompileOptions(dynamic={self.dynamic!r}): use None, True or False.")


def build_compile_options(value: CompileArg, what: str = "compile") -> Optional[CompileOptions]:
    """`compile=` as written -> CompileOptions, or None for no compile.

    Accepted: None / False / "none" (eager), True / "blocks", "model", a dict of CompileOptions' fields, or
    a CompileOptions.
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if isinstance(value, CompileOptions):
        return value
    if isinstance(value, str):
        key = value.lower().strip()
        if key == "none":
            return None
        if key in ("blocks", "model"):
            return CompileOptions(mode=key)
    elif isinstance(value, dict):
        try:
            return CompileOptions(**value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}={value!r}: {exc} (the keys are CompileOptions' fields).") from None
    raise ValueError(
        f"{what}={value!r}: use True (per-block torch.compile), 'model' (the whole network), False, "
        "or shardwise.strategies.compile.CompileOptions(...)."
    )


def compile_mode(options: Optional[CompileOptions]) -> str:
    """The ParallelPlan's field for these options: "none", "blocks" or "model"."""
    return "none" if options is None else options.mode


# ------------------------------------------------------------------------------------ which modules
def _inner(module: nn.Module) -> nn.Module:
    return module._checkpoint_wrapped_module if isinstance(module, CheckpointWrapper) else module


def _matcher(blocks: Any) -> Optional[Callable[[nn.Module], bool]]:
    """Block classes / names (or one of them) -> a test on a module's (unwrapped) class."""
    if blocks is None:
        return None
    items = [blocks] if isinstance(blocks, (type, str)) else list(blocks)
    classes = tuple(b for b in items if isinstance(b, type))
    names = {b for b in items if isinstance(b, str)}
    if not items or len(classes) + len(names) != len(items):
        raise ValueError(f"compile blocks={blocks!r}: use nn.Module classes or class names.")
    return lambda m: isinstance(_inner(m), classes) or type(_inner(m)).__name__ in names


def _select(module: nn.Module, test: Callable[[nn.Module], bool]) -> List[Tuple[str, nn.Module]]:
    """Outermost modules passing `test` (a checkpoint wrapper counts as the block it wraps), root excluded."""
    chosen: List[Tuple[str, nn.Module]] = []
    inside: Set[int] = set()
    for name, sub in module.named_modules():
        if sub is module or id(sub) in inside:
            continue
        if test(sub):
            chosen.append((name, sub))
            inside.update(id(m) for m in sub.modules())
    return chosen


def _no_split_names(module: nn.Module) -> Set[str]:
    names: Set[str] = set()
    for sub in module.modules():
        names.update(getattr(sub, "_no_split_modules", None) or ())
    return names


def _repeated_children(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The children of every nn.ModuleList (2 or more) whose members all share one class."""
    chosen: List[Tuple[str, nn.Module]] = []
    inside: Set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in inside or not isinstance(sub, nn.ModuleList) or len(sub) < 2:
            continue
        kinds = {type(_inner(child)) for child in sub}
        if len(kinds) == 1 and any(True for _ in sub.parameters()):
            for idx, child in sub.named_children():
                chosen.append((f"{name}.{idx}" if name else idx, child))
                inside.update(id(m) for m in child.modules())
    return chosen


def find_blocks(module: nn.Module, blocks: Any = None) -> List[Tuple[str, nn.Module]]:
    """The repeated blocks of `module` to compile, outermost first.

    `blocks` (classes or class names: the strategy's units, or CompileOptions.blocks) wins; else Hugging
    Face's `_no_split_modules`; else the repeated children of a ModuleList. An activation checkpointing
    wrapper is returned in place of the block it wraps, so recomputation is compiled with it.
    """
    test = _matcher(blocks)
    if test is None:
        names = _no_split_names(module)
        if names:
            found = _select(module, lambda m: type(_inner(m)).__name__ in names)
            if found:
                return found
        return _repeated_children(module)
    return _select(module, test)


def describe(module: nn.Module, limit: int = 8) -> str:
    counts = Counter(type(m).__name__ for m in module.modules() if not isinstance(m, CheckpointWrapper))
    return ", ".join(f"{name} ({n})" for name, n in counts.most_common(limit))


# ------------------------------------------------------------------------------------ compiling
def compile_forward(module: nn.Module, options: CompileOptions) -> None:
    """Replace `module.forward` by its compiled form, in place: hooks (FSDP's) run outside it, names stay.

    A call made while a Python dispatch mode is active (torch's FlopCounterMode counting a step's FLOPs,
    a memory tracker) runs the eager forward: dynamo would otherwise skip the function for good the
    first time it met one (measured: a block first called under FlopCounterMode never compiled after).
    """
    eager = module.forward
    compiled = torch.compile(
        eager,
        backend=options.backend,
        fullgraph=options.fullgraph,
        dynamic=options.dynamic,
        options=dict(options.options) if options.options else None,
    )

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch._C._len_torch_dispatch_stack():
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    forward.shardwise_compiled = compiled  # type: ignore[attr-defined]
    module.forward = forward  # type: ignore[method-assign]


def is_compiled(module: nn.Module) -> bool:
    """Whether compile_forward compiled this module (its instance holds a compiled forward)."""
    return hasattr(module.__dict__.get("forward"), "shardwise_compiled")


def apply_compile(module: nn.Module, options: Optional[CompileOptions], units: Any = None) -> List[str]:
    """Compile `module`'s blocks (or its networks, mode "model") in place; return the compiled names.

    Call it after activation checkpointing and before sharding or replication. `units`: the strategy's
    block classes (its FSDP wrap or checkpointing policy) when it has them; CompileOptions.blocks wins.
    A model with no block to find is refused, naming what it contains and the fixes.
    """
    if options is None:
        return []
    if options.mode == "model":
        targets = [(name, child) for name, child in module.named_children() if any(True for _ in child.parameters())]
        targets = targets or [("", module)]
    else:
        blocks = options.blocks if options.blocks is not None else units
        if blocks is not None and not isinstance(blocks, (type, str, set, frozenset, list, tuple)):
            blocks = None  # a callable wrap policy: not a list of block classes, so find the blocks instead
        targets = find_blocks(module, blocks)
        if not targets:
            raise ValueError(
                f"compile='blocks' found no repeated block in {type(module).__name__} (it contains: "
                f"{describe(module)}). Name the block class (CompileOptions(blocks={{YourBlock}}) or "
                "FSDPStrategy(auto_wrap_policy={YourBlock})), keep the blocks in an nn.ModuleList, or "
                "compile the whole network with compile='model'."
            )
    for _, target in targets:
        if not is_compiled(target):
            compile_forward(target, options)
    return [name for name, _ in targets]


# ------------------------------------------------------------------------------------ recompilations
def _compilation_records() -> List[Any]:
    """Dynamo's record of each frame compilation in this process (the newest 64), or [] if unavailable."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # pragma: no cover - torch without dynamo's records
        return []
    return get_compilation_metrics()


class RecompileWatch:
    """Counts dynamo's recompilations per function; warns once when one keeps recompiling.

    Call `step()` after each optimizer step. Compilations up to the first step that compiled anything and
    during the first `warmup_steps` steps (the first forward and backward; a first step run eagerly under
    a FLOP counter) are counted in `total` but never warned about; after that, `recompiles[fn]` counts
    them, and a function above `max_recompiles`, or one dynamo gave up on (`recompile_limit` reached),
    gets one warning with the guards dynamo names as the cause.
    """

    def __init__(self, max_recompiles: int = 4, warmup_steps: int = 1, rank: int = 0) -> None:
        self.max_recompiles = max_recompiles
        self.warmup_steps = warmup_steps
        self.rank = rank
        self.steps = 0
        self.total: Counter = Counter()  # recompilations per function since the watch started
        self.recompiles: Counter = Counter()  # ... after warm-up
        self.reasons: Dict[str, str] = {}  # the newest cause per function
        self.gave_up: Set[str] = set()
        self.names: Dict[str, str] = {}  # dynamo's frame id -> "fn (file:line)"
        self.compiled_at: Optional[int] = None  # the first step in which dynamo compiled something
        self.message: Optional[str] = None
        self.seen = {self._key(r) for r in _compilation_records()}  # earlier compilations are not this run's

    @staticmethod
    def _key(record: Any) -> Tuple[Any, Any]:
        return (str(getattr(record, "compile_id", "")), getattr(record, "start_time_us", None))

    def step(self) -> Optional[str]:
        """Read dynamo's new records; return (and warn) the message the first time the limit is passed."""
        self.steps += 1
        compiled_before = self.compiled_at is not None
        for record in _compilation_records():
            key = self._key(record)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.compiled_at = self.compiled_at or self.steps
            frame = key[0].split("/")[0]
            if getattr(record, "co_name", None):
                self.names[frame] = f"{record.co_name} ({record.co_filename}:{record.co_firstlineno})"
            reason = getattr(record, "recompile_reason", None)
            if not reason:
                continue
            fn = self.names.get(frame, f"frame {frame}")
            self.total[fn] += 1
            self.reasons[fn] = str(reason)
            if "recompile limit" in str(getattr(record, "fail_reason", "") or "").lower():
                self.gave_up.add(fn)
            if compiled_before and self.steps > self.warmup_steps:
                self.recompiles[fn] += 1
        if self.message is None:
            over = [fn for fn, n in self.recompiles.items() if n > self.max_recompiles] + sorted(self.gave_up)
            if over:
                self.message = self._describe(over[0])
                warnings.warn(self.message, stacklevel=2)
                return self.message
        return None

    def causes(self, fn: str, limit: int = 3) -> List[str]:
        """The newest distinct guard failures dynamo recorded for `fn` (one per cached version it tried)."""
        found: List[str] = []
        try:
            from torch._dynamo.utils import guard_failures
        except ImportError:  # pragma: no cover
            guard_failures = {}
        for code, reasons in list(guard_failures.items()):
            if fn.startswith(f"{getattr(code, 'co_name', '')} ({getattr(code, 'co_filename', '')}:"):
                for reason in reversed(reasons):
                    text = str(reason).split(": ", 1)[-1].split("\n")[0]
                    if text not in found:
                        found.append(text)
                    if len(found) == limit:
                        break
        return found or [self.reasons.get(fn, "unknown")]

    def _describe(self, fn: str) -> str:
        limit = getattr(torch._dynamo.config, "recompile_limit", None)
        state = (
            f"dynamo reached recompile_limit={limit} and now runs it eagerly"
            if fn in self.gave_up
            else f"each costs a new compilation; at torch._dynamo.config.recompile_limit={limit} dynamo stops "
            "compiling it and runs it eagerly"
        )
        warm = max(self.compiled_at or 0, self.warmup_steps)
        return (
            f"torch.compile keeps recompiling {fn} on rank {self.rank}: {self.recompiles[fn] or self.total[fn]} "
            f"time(s) after warm-up (optimizer step {warm}; {state}). The causes dynamo "
            f"reports (the guards that failed): {'; '.join(self.causes(fn))}. Usual fixes: batches of one "
            "shape (pad to a fixed length, drop_last=True), a dimension marked dynamic "
            "(CompileOptions(dynamic=None) lets dynamo do it; torch._dynamo.mark_dynamic), no Python value "
            "that changes every step read inside the compiled block; TORCH_LOGS=recompiles shows each one."
        )


__all__ = [
    "COMPILE_MODES",
    "CompileOptions",
    "build_compile_options",
    "compile_mode",
    "find_blocks",
    "apply_compile",
    "compile_forward",
    "is_compiled",
    "RecompileWatch",
]
