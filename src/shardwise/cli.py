"""`shardwise <command>`: one entry point, each command implemented beside its feature.

    shardwise demo                      the seed Transformer with FSDP on 2 local processes
    shardwise fit --config run.yaml     train a TrainModule from a config
    shardwise plan --model llama-2-70b  memory plan before renting GPUs
    shardwise convert CKPT OUT          consolidate a checkpoint into safetensors
    shardwise inspect CKPT              what a checkpoint holds
    shardwise finetune --config x.yaml  fine-tune a Hugging Face causal LM
    shardwise launch ...                start workers on this node (multi-node)
    shardwise bench                     run the benchmarks behind BENCHMARKS.md

Each command's module exposes `main(argv) -> int`; this file only
dispatches, so importing it stays cheap (`shardwise --help` loads no torch).
"""
from __future__ import annotations

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "demo": ("shardwise.demo_cli", "train the seed Transformer with FSDP on 2 local processes"),
    "fit": ("shardwise.fit_cli", "train a TrainModule class from a YAML config / flags"),
    "plan": ("shardwise.plan.cli", "predict per-device memory and pick the fastest configuration that fits"),
    "convert": ("shardwise.checkpoint.convert", "turn a checkpoint into consolidated safetensors / torch file"),
    "inspect": ("shardwise.checkpoint.inspect", "list what a checkpoint holds"),
    "finetune": ("shardwise.recipes.finetune", "fine-tune a local Hugging Face causal LM"),
    "launch": ("shardwise.distributed.launch_cli", "start this node's workers (multi-node, torchrun's agent)"),
    "bench": ("shardwise.bench_cli", "run the benchmarks that produce BENCHMARKS.md"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: shardwise <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`shardwise <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from shardwise import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"shardwise: unknown command {command!r}.\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except Exception as exc:
        # A worker's failure: the launcher's verdict already holds the first failing
        # rank's own traceback; this process's stack would only bury it.
        if type(exc).__name__ != "WorkerFailedError":
            raise
        print(f"shardwise {command}: {exc}", file=sys.stderr)
        return int(getattr(exc, "exitcode", 1) or 1)


if __name__ == "__main__":
    sys.exit(main())
