"""The GPU smoke test: `python -m shardwise.smoke [--dry] [--json OUT]`, the riskiest GPU paths first, in minutes.

shardwise is developed on CPUs (gloo); a GPU is rented for minutes at a time. This runs, in order of risk,
the paths that only a GPU exercises, each in its own subprocess with its own time limit (a hang or a
poisoned CUDA context costs that check, not the run), and prints one PASS / FAIL / SKIP line per check
with its seconds, then writes a JSON summary (`--json`): per check its status, seconds, a one-line detail
and the figures it measured; a failing check's output tail too. The checks are defined in `ranks.py`
(environment, launches, the health check) and `gpu.py` (QLoRA, DeepSpeed offload, compile + MFU,
SDPA kernels, 16-mixed, profiling, determinism, then a subset of tests/gpu). `--dry` runs on a CPU: the
checks that can (the environment report, the fork-server launch of 2 gloo ranks with FSDP bf16 and a
planted NaN) and reports the CUDA ones as SKIP; the test suite runs it. The whole GPU run keeps to
`--budget` seconds (default 450: under 8 minutes on one H100 with Python's start-up); a check that
would start past it is skipped, the pytest subset gets what is left. docs/launching.md ("GPU smoke
test") has the device command, with the wheels tools/gpu_wheels.sh builds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence

from shardwise.smoke import gpu, ranks
from shardwise.smoke.common import Skip

# (name, function, time limit in seconds on an H100, runs in --dry). Ordered by risk: what most likely
# breaks on a first GPU run comes first, so a run cut short has already answered it.
CHECKS: List[tuple] = [
    ("environment", ranks.check_environment, 60, True),
    ("launch_two_ranks_one_gpu", ranks.check_launch_two_ranks, 90, False),
    ("nccl_two_ranks_one_gpu", ranks.check_nccl_same_gpu, 60, False),
    ("fsdp_bf16_planted_nan", ranks.check_fsdp_bf16_nan, 120, True),
    ("qlora_cuda_codes", gpu.check_qlora, 150, False),
    ("deepspeed_offload", gpu.check_deepspeed_offload, 240, False),
    ("compile_mfu_tf32", gpu.check_compile_mfu_tf32, 150, False),
    ("sdpa_kernels", gpu.check_sdpa_kernels, 60, False),
    ("fp16_mixed", gpu.check_fp16_mixed, 60, False),
    ("profile_dump", gpu.check_profile_dump, 90, False),
    ("deterministic", gpu.check_deterministic, 90, False),
    ("pytest_tests_gpu", gpu.check_pytest_gpu, 600, False),
]
NAMES = [c[0] for c in CHECKS]
# A subprocess's own start (Python, torch, shardwise) and teardown, on top of its check's limit.
_START_S = 20.0


def _find(name: str) -> tuple:
    for check in CHECKS:
        if check[0] == name:
            return check
    raise ValueError(f"unknown check {name!r}: choose from {', '.join(NAMES)}")


def run_one(name: str, dry: bool, limit_s: float) -> Dict[str, Any]:
    """Run one check in this process: {"status", "seconds", "detail", "data"}; never raises."""
    _, fn, _, cpu_ok = _find(name)
    start = time.perf_counter()
    try:
        if dry and not cpu_ok:
            raise Skip("needs CUDA (--dry)")
        data = fn(dry=dry, limit_s=limit_s) or {}
        status, detail = "PASS", str(data.pop("detail", ""))
    except Skip as exc:
        status, detail, data = "SKIP", str(exc), {}
    except BaseException as exc:  # noqa: BLE001 -- a check's failure, whatever it is, is its FAIL line
        if isinstance(exc, KeyboardInterrupt):
            raise
        status, detail = "FAIL", f"{type(exc).__name__}: {exc}".strip()
        data = {**getattr(exc, "data", {}), "traceback": traceback.format_exc()[-4000:]}
    return {"status": status, "seconds": round(time.perf_counter() - start, 2), "detail": detail, "data": data}


def _child_env(dry: bool) -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not dry and env.get("DS_ACCELERATOR") == "cpu":
        # A CPU suite's DS_ACCELERATOR=cpu with a model on CUDA is refused (strategies/deepspeed_env.py).
        del env["DS_ACCELERATOR"]
    return env


def run_isolated(name: str, dry: bool, limit_s: float, workdir: str) -> Dict[str, Any]:
    """One check in a subprocess of its own session, killed with everything it started at `limit_s`."""
    result_path = os.path.join(workdir, f"{name}.json")
    log_path = os.path.join(workdir, f"{name}.log")
    command = [sys.executable, "-m", "shardwise.smoke", "--one", name, "--result", result_path, "--limit", str(limit_s)]
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command + (["--dry"] if dry else []),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_child_env(dry),
            start_new_session=True,
        )
        try:
            proc.wait(timeout=limit_s + _START_S)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the check's launched workers too: they share its session
            proc.wait()
    seconds = round(time.perf_counter() - start, 2)
    with open(log_path, "rb") as log:
        tail = log.read()[-3000:].decode("utf-8", "replace")
    if timed_out:
        return {
            "status": "FAIL",
            "seconds": seconds,
            "detail": f"timed out after {limit_s:.0f} s",
            "data": {},
            "output_tail": tail,
        }
    try:
        with open(result_path) as fh:
            result = json.load(fh)
    except (OSError, ValueError):
        return {
            "status": "FAIL",
            "seconds": seconds,
            "detail": f"the check's process exited with {proc.returncode} before writing its result",
            "data": {},
            "output_tail": tail,
        }
    result["seconds"] = seconds  # with the process's start: what the run's budget pays
    if result["status"] == "FAIL":
        result["output_tail"] = tail
    return result


def run_checks(
    names: Sequence[str],
    dry: bool = False,
    budget_s: float = 450.0,
    isolate: bool = True,
    echo: Callable[[str], None] = print,
) -> Dict[str, Any]:
    """Run `names` in order within `budget_s`; returns the summary that --json writes."""
    started = time.perf_counter()
    results: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shardwise-smoke-") as workdir:
        for name in names:
            _, _, limit, cpu_ok = _find(name)
            left = budget_s - (time.perf_counter() - started)
            if dry and not cpu_ok:
                result = {"status": "SKIP", "seconds": 0.0, "detail": "needs CUDA (--dry)", "data": {}}
            elif left < 15:
                result = {
                    "status": "SKIP",
                    "seconds": 0.0,
                    "detail": f"out of time (--budget {budget_s:.0f} s)",
                    "data": {},
                }
            else:
                limit_s = min(limit, left - (_START_S if isolate else 0))
                result = run_isolated(name, dry, limit_s, workdir) if isolate else run_one(name, dry, limit_s)
            results[name] = result
            echo(f"{result['status']:4s} {name:28s} {result['seconds']:7.1f} s  {result['detail']}")
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("PASS", "FAIL", "SKIP")}
    total = round(time.perf_counter() - started, 1)
    echo(f"smoke: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in {total} s")
    return {
        "mode": "dry" if dry else "gpu",
        "seconds": total,
        "budget_s": budget_s,
        "counts": counts,
        "ok": counts["FAIL"] == 0,
        "checks": results,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.smoke", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="on a CPU: run what can run, report the CUDA checks as SKIP")
    parser.add_argument("--json", metavar="OUT", help="write the summary (per check: status, seconds, detail, data)")
    parser.add_argument("--only", nargs="+", metavar="CHECK", choices=NAMES, help="run these checks (in this order)")
    parser.add_argument("--skip", nargs="+", metavar="CHECK", choices=NAMES, default=[], help="leave these out")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    parser.add_argument("--in-process", action="store_true", help="no subprocess per check (faster, less robust)")
    parser.add_argument("--one", choices=NAMES, help=argparse.SUPPRESS)  # a check's own subprocess
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        result = run_one(args.one, args.dry, args.limit)
        with open(args.result, "w") as fh:
            json.dump(result, fh, default=str)
        return 0
    names = [n for n in (args.only or NAMES) if n not in args.skip]
    summary = run_checks(names, dry=args.dry, budget_s=args.budget, isolate=not args.in_process)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1, default=str)
    return 0 if summary["ok"] else 1
