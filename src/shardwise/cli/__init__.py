"""The `shardwise` command line: one module per command in this package, all declared alike.

Each command module has `parser()`, a jsonargparse ArgumentParser (typed options,
`--config` YAML files where it makes sense), and `run(cfg) -> int`. This module
dispatches and owns what every command shares:

- options may be written with dashes or underscores (`--device-memory`,
  `--device_memory`); a boolean option given without a value means true;
- exit status 0 on success, 2 for a usage mistake (an unknown command or
  option, a value that is not valid), 1 for a run that failed, 75 when the
  workers were preempted and saved;
- a mistake the user can fix is printed as one line on stderr, without a
  traceback (SHARDWISE_TRACEBACK=1 shows it); in a worker of a shardwise
  launcher it is recorded instead, and the launcher's verdict prints it once
  for every rank (one line per failing rank), as it does for `launch(fn)`'s
  workers (WorkerFailedError's summary).

Command modules import torch and the Trainer inside `run()`, so that
`shardwise --help` and a usage error answer without loading them.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, List, Optional

COMMANDS = {
    "demo": "train a Transformer with FSDP on 2 local processes and compare strategies",
    "fit": "train a TrainModule class from a YAML config and flags",
    "plan": "predict per-device memory and pick the fastest configuration that fits",
    "finetune": "fine-tune a local Hugging Face causal LM",
    "launch": "start this node's workers (one launcher per node)",
    "convert": "turn a checkpoint into consolidated safetensors or a torch file",
    "inspect": "list what a checkpoint holds",
    "check": "prove a TrainModule trains the same on N ranks as on one process (CPU, before renting GPUs)",
    "prepare": "tokenise corpora with all cores into memory-mapped token shards (resumable)",
    "pretrain": "pre-train a Hugging Face causal LM from scratch on prepared corpora",
}

# Exceptions whose message is the whole story for a user: (class name in the MRO, exit status).
# Matched by name so that this module imports none of them (and so no torch).
_USER_ERRORS = (
    ("CheckpointError", 1),  # before ValueError / FileNotFoundError: a missing checkpoint is a failed resume
    ("ValueError", 2),
    ("FileNotFoundError", 2),
    ("WorkerFailedError", 1),
    ("FloatingPointError", 1),  # NonFiniteError
    ("UninitializedParameterError", 1),
    ("DiscardedInitError", 1),
    ("OSError", 1),
)


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: shardwise <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "`shardwise <command> --help` lists a command's options."]
    return "\n".join(lines)


def normalise(argv: List[str], flags: set, passthrough: bool = False) -> List[str]:
    """`--a-b` -> `--a_b`; a boolean option (`flags`) without a value gets `true`.

    With `passthrough`, everything from the first positional on (a program and its own
    arguments, for `shardwise launch`) is left exactly as given.
    """
    out: List[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if not arg.startswith("--"):
            previous = out[-1] if out else ""
            takes_value = previous.startswith("--") and "=" not in previous and previous not in flags
            if passthrough and not takes_value:
                return out + argv[i:]
            out.append(arg)
            continue
        name, eq, value = arg.partition("=")
        name = "--" + name[2:].replace("-", "_")
        out.append(name + eq + value)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if name in flags and not eq and (following is None or following.lower() not in ("true", "false")):
            out.append("true")
    return out


def _flags(parser: Any) -> set:
    return {"--" + key for key, value in parser.get_defaults().items() if isinstance(value, bool)}


def _user_error(exc: BaseException) -> Optional[int]:
    names = {cls.__name__ for cls in type(exc).__mro__}
    for name, status in _USER_ERRORS:
        if name in names:
            return int(getattr(exc, "exitcode", None) or status) if name == "WorkerFailedError" else status
    return None


def _message(exc: BaseException) -> str:
    """The one-line story: a failed worker's verdict without its traceback when its own error is one of ours."""
    types = set(getattr(exc, "error_types", ()))
    if types & {name for name, _ in _USER_ERRORS}:
        return exc.summary.strip()  # type: ignore[attr-defined]
    return str(exc).strip() or type(exc).__name__


def _recorded_for_launcher(exc: BaseException, status: int) -> bool:
    """In a worker of a shardwise launcher: record the error for its verdict (brief) with the `status` this
    worker exits with, true if the launcher has it."""
    from shardwise.distributed.context import current  # no torch: a usage mistake answers fast

    if not current().launched_by_shardwise:
        return False
    from shardwise.distributed import faults

    faults.record_exception(exc, brief=True, exitcode=status)
    return faults.shown_by_launcher()


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(version("shardwise"))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"shardwise: unknown command {name!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    command = importlib.import_module(f"shardwise.cli.{name}")
    try:
        parser = command.parser()
        parser.prog = f"shardwise {name}"
        args = normalise(rest, _flags(parser), getattr(command, "PASSTHROUGH", False))
        if hasattr(command, "translate"):  # other tools' spellings of the same options
            args = command.translate(args)
        try:
            cfg = parser.parse_args(args)
        except SystemExit as exc:  # --help (0), or a usage error jsonargparse has printed (2)
            return 2 if exc.code not in (0, None) else 0
        return int(command.run(cfg) or 0)
    except Exception as exc:
        status = _user_error(exc)
        if status is None or os.environ.get("SHARDWISE_TRACEBACK"):
            raise
        if _recorded_for_launcher(exc, status):
            return status  # the verdict shows it, once for all the ranks that fail alike
        print(f"shardwise {name}: error: {_message(exc)}", file=sys.stderr)
        return status


# Lightning's `lightning.pytorch.cli` names, loaded on first use: they import torch and the Trainer.
_LIGHTNING_CLI = (
    "LightningArgumentParser",
    "LightningCLI",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
)


def __getattr__(name: str) -> Any:
    if name in _LIGHTNING_CLI:
        return getattr(importlib.import_module("shardwise.cli.lightning_cli"), name)
    raise AttributeError(f"module 'shardwise.cli' has no attribute {name!r}")


__all__ = ["COMMANDS", "main", "normalise", *_LIGHTNING_CLI]
