"""`shardwise launch`: start this node's workers under torchrun's elastic agent.

Multi-node jobs need one launcher per node. Each one is told the same
`--nnodes`, `--master-addr` and `--master-port` and its own `--node-rank`;
the agents meet at the master address (torchrun's "static" rendezvous, the
behaviour of `torchrun --node-rank`), start `--nproc-per-node` workers each
with RANK / LOCAL_RANK / WORLD_SIZE / GROUP_RANK set, and tear every worker
on every node down when one fails. We use PyTorch's agent
(`torch.distributed.launcher.api.elastic_launch`) rather than our own
supervisor for this because it already solves the cross-node part:
rendezvous, a shared store the workers reuse, restarts, and failure
propagation. What shardwise adds is the command line: the thing to run can
be a script (`train.py args`), a module (`-m pkg.mod args`), or a command
(`shardwise finetune --config run.yaml`, which then runs in this same
interpreter), and a mismatch between `--nproc-per-node` and the devices on
this node is reported before any rendezvous. Under SLURM, run one
`shardwise launch` per node with `srun` (examples/slurm/).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import uuid
from typing import List, Optional, Sequence, Tuple


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise launch",
        description="Start this node's workers (torchrun's elastic agent). Run once per node.",
        epilog="examples:\n"
               "  shardwise launch --nproc-per-node 8 train.py --lr 1e-4\n"
               "  shardwise launch --nnodes 2 --node-rank $NODE_RANK --master-addr node0 --master-port 29500 \\\n"
               "      --nproc-per-node 8 shardwise finetune --config llama70b.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (launchers) in the job")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=None,
                        help="this node's index in [0, nnodes); default $NODE_RANK / $SLURM_NODEID / 0")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="address of node 0 (default $MASTER_ADDR or 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="free TCP port on node 0 (default $MASTER_PORT, or a free port for one node)")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default="auto",
                        help="workers on this node: a number, or 'auto' (one per GPU, else 1)")
    parser.add_argument("--rdzv-backend", default="static", choices=("static", "c10d"),
                        help="static (fixed node ranks, like torchrun --node-rank) or c10d (elastic)")
    parser.add_argument("--run-id", default=None, help="rendezvous id for c10d (default: $SLURM_JOB_ID or random)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restart the workers this many times on failure")
    parser.add_argument("--log-dir", default=None, help="keep each worker's stdout/stderr in this folder")
    parser.add_argument("-m", dest="module", action="store_true", help="run the program as a module (python -m)")
    parser.add_argument("program", help="script.py, module name (with -m), or a command such as `shardwise`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the program")
    return parser


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from shardwise.distributed.env import find_free_port

    if ns.nnodes < 1:
        parser.error(f"--nnodes={ns.nnodes}: use 1 or more.")
    node_rank = ns.node_rank if ns.node_rank is not None else (_env_int("NODE_RANK", "SLURM_NODEID") or 0)
    if not 0 <= node_rank < ns.nnodes:
        parser.error(f"--node-rank={node_rank} is outside [0, {ns.nnodes}).")
    addr = ns.master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = ns.master_port or _env_int("MASTER_PORT")
    if port is None:
        if ns.nnodes > 1:
            parser.error("--master-port is required with --nnodes > 1 (every node must name the same port).")
        port = find_free_port()
    try:
        nproc = resolve_nproc(ns.nproc_per_node)
        entrypoint, args = resolve_command(ns.program, ns.args, ns.module)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    rdzv_configs = {"rank": node_rank} if ns.rdzv_backend == "static" else {}
    run_id = ns.run_id or os.environ.get("SLURM_JOB_ID") or ("shardwise" if ns.rdzv_backend == "static"
                                                               else uuid.uuid4().hex[:8])
    logs_specs = None
    if ns.log_dir:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        logs_specs = DefaultLogsSpecs(log_dir=ns.log_dir, redirects=Std.ALL, tee=Std.ALL)
    config = LaunchConfig(min_nodes=ns.nnodes, max_nodes=ns.nnodes, nproc_per_node=nproc,
                          rdzv_backend=ns.rdzv_backend, rdzv_endpoint=f"{addr}:{port}", rdzv_configs=rdzv_configs,
                          run_id=run_id, max_restarts=ns.max_restarts, monitor_interval=0.1,
                          logs_specs=logs_specs, start_method="spawn",
                          local_addr=addr if ns.nnodes == 1 else None)
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        print(f"[shardwise launch] node {node_rank}: {exc.format_msg() if hasattr(exc, 'format_msg') else exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
