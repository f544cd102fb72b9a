"""`shardwise launch`: start this node's workers under torch's elastic agent; run once per node.

Every node's launcher is told the same `--nnodes`, `--master-addr` and
`--master-port` and its own `--node-rank` (torchrun's "static" rendezvous).
What to run can be a script (`train.py args`), a module (`-m pkg.mod args`)
or a command (`shardwise finetune --config run.yaml`, run by this same
interpreter). Starting, stopping, the verdict and preemption are agent.py's,
shared with the local launches. Under SLURM: one `shardwise launch` per node
with `srun` (examples/slurm/).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from typing import Any, List, Optional, Sequence, Tuple

from jsonargparse import ArgumentParser

from shardwise.distributed import agent
from shardwise.distributed.env import find_free_port

PASSTHROUGH = True  # the program's own arguments are passed on as given


def parser() -> ArgumentParser:
    p = ArgumentParser(
        description="Start this node's workers (torchrun's elastic agent). Run once per node.",
        epilog="examples:\n"
        "  shardwise launch --nproc-per-node 8 train.py --lr 1e-4\n"
        "  shardwise launch --nnodes 2 --node-rank $NODE_RANK --master-addr node0 --master-port 29500 \\\n"
        "      --nproc-per-node 8 shardwise finetune --config llama70b.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (launchers) in the job")
    p.add_argument(
        "--node_rank",
        type=Optional[int],
        default=None,
        help="this node's index in [0, nnodes); default $NODE_RANK / $SLURM_NODEID / 0",
    )
    p.add_argument(
        "--master_addr", type=Optional[str], default=None, help="address of node 0 (default $MASTER_ADDR or 127.0.0.1)"
    )
    p.add_argument(
        "--master_port",
        type=Optional[int],
        default=None,
        help="free TCP port on node 0 (default $MASTER_PORT, or a free port for one node)",
    )
    p.add_argument(
        "--nproc_per_node",
        type=str,
        default="auto",
        help="workers on this node: a number, or 'auto' (one per GPU, else 1)",
    )
    p.add_argument(
        "--rdzv_backend",
        type=str,
        default="static",
        choices=("static", "c10d"),
        help="static (fixed node ranks, like torchrun --node-rank) or c10d (elastic)",
    )
    p.add_argument(
        "--run_id", type=Optional[str], default=None, help="rendezvous id for c10d (default: $SLURM_JOB_ID or random)"
    )
    p.add_argument("--max_restarts", type=int, default=0, help="restart the workers this many times on failure")
    p.add_argument(
        "--log_dir", type=Optional[str], default=None, help="keep each worker's stdout/stderr in this folder"
    )
    p.add_argument("-m", dest="module", action="store_true", help="run the program as a module (python -m)")
    p.add_argument("program", help="script.py, module name (with -m), or a command such as `shardwise`")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the program")
    return p


def resolve_nproc(value: str) -> int:
    import torch

    if str(value) == "auto":
        return torch.cuda.device_count() if torch.cuda.is_available() else 1
    if not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"--nproc-per-node={value!r}: use a positive number or 'auto'.")
    n = int(value)
    if torch.cuda.is_available() and n > torch.cuda.device_count():
        raise ValueError(f"--nproc-per-node={n} but this node has {torch.cuda.device_count()} GPU(s).")
    return n


def resolve_command(program: str, args: Sequence[str], as_module: bool) -> Tuple[str, List[str]]:
    """(executable, arguments) for each worker."""
    if as_module:
        return sys.executable, ["-u", "-m", program, *args]
    if program.endswith(".py") or (os.path.isfile(program) and not os.access(program, os.X_OK)):
        if not os.path.exists(program):
            raise FileNotFoundError(f"script {program!r} does not exist.")
        return sys.executable, ["-u", program, *args]
    if program == "shardwise":
        # Our own CLI runs in this interpreter: no dependence on PATH or on
        # which environment the `shardwise` console script belongs to.
        return sys.executable, ["-u", "-m", "shardwise.cli", *args]
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"{program!r} is neither a script nor a command on PATH.")
    return found, list(args)


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def run(ns: Any) -> int:
    if ns.nnodes < 1:
        raise ValueError(f"--nnodes={ns.nnodes}: use 1 or more.")
    node_rank = ns.node_rank if ns.node_rank is not None else (_env_int("NODE_RANK", "SLURM_NODEID") or 0)
    if not 0 <= node_rank < ns.nnodes:
        raise ValueError(f"--node-rank={node_rank} is outside [0, {ns.nnodes}).")
    addr = ns.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = ns.master_port or _env_int("MASTER_PORT")
    if port is None:
        if ns.nnodes > 1:
            raise ValueError("--master-port is required with --nnodes > 1 (every node must name the same port).")
        port = find_free_port()
    nproc = resolve_nproc(ns.nproc_per_node)
    entrypoint, args = resolve_command(ns.program, ns.args, ns.module)
    run_id = (
        ns.run_id
        or os.environ.get("SLURM_JOB_ID")
        or ("shardwise" if ns.rdzv_backend == "static" else uuid.uuid4().hex[:8])
    )
    who = f"[shardwise launch] node {node_rank}:"
    result = agent.run(
        entrypoint,
        args,
        nproc,
        nnodes=ns.nnodes,
        node_rank=node_rank,
        addr=addr,
        port=port,
        rdzv_backend=ns.rdzv_backend,
        run_id=run_id,
        max_restarts=ns.max_restarts,
        log_dir=ns.log_dir,
        who=who,
    )
    if result.exitcode == 0:
        return 0
    if not result.verdict:  # preempted: saved and left (75), or killed after the grace period
        print(result.message, file=sys.stderr)
        return result.exitcode
    print(f"{who}\n{result.message}", file=sys.stderr)
    return 1
