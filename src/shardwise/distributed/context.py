"""What a shardwise launcher tells the workers it starts: one typed, versioned LaunchContext.

The launching process (the Trainer's `python train.py` with devices=N,
`shardwise.launch(fn)`, `shardwise launch`) writes it once, as JSON in the
one environment variable SHARDWISE_LAUNCH_CONTEXT, just before the elastic
agent starts the workers (agent.run); each worker parses it once, on the
first `current()`, and keeps it. A process no shardwise launcher started
(torchrun, srun, plain python) gets the defaults. Everything else the
workers learn from the environment is either torch's (RANK, WORLD_SIZE,
MASTER_ADDR, ... read by env.py) or a switch the user sets (docs/launching.md,
"The environment").

The launching process adds what it knows before it starts the workers: this
process's own value is replaced with `update(**fields)` (seed_everything
records the seed so), or a launcher is given a whole context,
`launch_script(devices, context=current().replace(plan_choice={...}))`.
The launcher then fills in its own fields (run directory, grace period,
launched_by_shardwise) and exports the result.

Adding a field: give LaunchContext a typed field with a default that means
"not launched by shardwise" and a JSON value (str, int, float, bool, None,
lists and dicts of them), then bump VERSION: a worker reading a context of
another version (a launcher and workers from two installations) stops with
an error saying so instead of guessing at fields it does not know.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional

from shardwise._version import __version__

CONTEXT_ENV = "SHARDWISE_LAUNCH_CONTEXT"
VERSION = 1


class LaunchContextError(RuntimeError):
    """The launch context in the environment cannot be read by this version of shardwise."""


@dataclass(frozen=True)
class LaunchContext:
    """Everything a shardwise launcher passes to its workers; the defaults describe a process it did not start.

    - `launched_by_shardwise`: started by one of shardwise's launchers (not torchrun / srun / by hand).
    - `run_dir`: the launcher's run directory, where each worker keeps its progress and error records.
    - `seed`: the launching process's seed (seed_everything), so every rank agrees on it.
    - `preempt_grace_s`: how long the launcher waits, after forwarding a preemption signal, for the
      workers to save and exit (None: SHARDWISE_PREEMPT_GRACE_S, else 120 s; resolved by the launcher).
    - `plan_choice`: for strategy='auto', the planner's choice made in the launching process, so the
      workers apply it instead of planning again (a plain dict; the planner defines its keys).
    """

    version: int = VERSION
    launched_by_shardwise: bool = False
    run_dir: Optional[str] = None
    seed: Optional[int] = None
    preempt_grace_s: Optional[float] = None
    plan_choice: Optional[Dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"LaunchContext.seed must be an int, not {type(self.seed).__name__}.")
        if self.plan_choice is not None:
            if not isinstance(self.plan_choice, dict):
                raise TypeError(f"LaunchContext.plan_choice must be a dict, not {type(self.plan_choice).__name__}.")
            try:  # refused here, where it is set, rather than in the launcher that exports it
                json.dumps(self.plan_choice)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"LaunchContext.plan_choice must hold JSON values only: {exc}") from None

    def replace(self, **fields: Any) -> "LaunchContext":
        """A copy with `fields` changed (an unknown field name is a TypeError)."""
        return dataclasses.replace(self, **fields)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LaunchContext":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise LaunchContextError(f"{CONTEXT_ENV} is not valid JSON ({exc}): {text[:200]!r}") from None
        if not isinstance(data, dict):
            raise LaunchContextError(f"{CONTEXT_ENV} must hold a JSON object, got {text[:200]!r}.")
        version = data.get("version")
        if version != VERSION:
            raise LaunchContextError(
                f"{CONTEXT_ENV} was written by a launcher using launch-context version {version!r}, but this "
                f"worker's shardwise ({__version__}) reads version {VERSION}: the launcher and its workers come "
                "from different shardwise installations. Start both with the same Python environment."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LaunchContextError(
                f"{CONTEXT_ENV} has field(s) {', '.join(unknown)} that launch-context version {VERSION} does not "
                "define: the launcher and its workers come from different shardwise installations."
            )
        return cls(**data)


_current: Optional[LaunchContext] = None


def current() -> LaunchContext:
    """This process's launch context: read from the environment on the first call, then kept."""
    global _current
    if _current is None:
        text = os.environ.get(CONTEXT_ENV)
        _current = LaunchContext.from_json(text) if text else LaunchContext()
    return _current


def update(**fields: Any) -> LaunchContext:
    """Change fields of this process's context (not the environment); the launchers pass it on to
    the workers they start from now on. Returns the new context."""
    global _current
    _current = current().replace(**fields)
    return _current


@contextlib.contextmanager
def using(context: LaunchContext) -> Iterator[LaunchContext]:
    """This process's context is `context` inside the block (tests; code run as if launched)."""
    global _current
    before = _current
    _current = context
    try:
        yield context
    finally:
        _current = before


@contextlib.contextmanager
def exported(context: LaunchContext) -> Iterator[None]:
    """`context` in this process's environment inside the block, for the workers started in it.

    The launcher's own `current()` is read before and is unaffected: only processes started
    inside the block inherit the variable. The previous value is restored after.
    """
    current()  # keep this process's own context, whatever the block exports
    before = os.environ.get(CONTEXT_ENV)
    os.environ[CONTEXT_ENV] = context.to_json()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONTEXT_ENV, None)
        else:
            os.environ[CONTEXT_ENV] = before


__all__ = ["CONTEXT_ENV", "VERSION", "LaunchContext", "LaunchContextError", "current", "exported", "update", "using"]
