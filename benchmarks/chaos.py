"""Chaos resume benchmark: N seeded random kill / resume schedules, each against the uninterrupted run.

    python benchmarks/chaos.py --schedules 20 --seed 0 [--strategy ddp] [--sigkill-only] [--keep DIR]

Schedule i uses seed S+i (tests/distributed/chaos_script.py `generate`):
a strategy (single, ddp, fsdp FULL_SHARD / SHARD_GRAD_OP / NO_SHARD,
DeepSpeed ZeRO-1/2/3), 1-4 resumes at world size 1 or 2, and for each
interrupted leg a kill point (after a step, between micro-batches, inside a
save, during validation, at epoch end), a target (a rank or the launcher)
and SIGKILL or SIGTERM. Prints one line per schedule and then a table:
schedules run, passed, failed, with the seed and schedule of each failure.
Reproduce one with `--schedules 1 --seed <its seed>`. Reference runs are
cached by configuration in the work directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "distributed"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import chaos_script as chaos  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy", default=None, choices=chaos.STRATEGIES)
    parser.add_argument("--sigkill-only", action="store_true", help="no SIGTERM kills (before preemption support)")
    parser.add_argument("--keep", default=None, help="keep every schedule's files under this directory")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per leg before it counts as hung")
    args = parser.parse_args()

    base = args.keep or tempfile.mkdtemp(prefix="shardwise-chaos-")
    cache = os.path.join(base, "reference-cache")
    override = {}
    if args.strategy:
        override["strategy"] = args.strategy
    if args.sigkill_only:
        override["signals"] = ["SIGKILL"]
    print(f"PREEMPTED_EXIT_CODE: {chaos.preempted_exit_code()}; work directory {base}")
    results = []
    start = time.monotonic()
    for i in range(args.schedules):
        seed = args.seed + i
        spec = chaos.generate(seed, **override)
        print(f"[{i + 1}/{args.schedules}] {chaos.describe(spec)}", flush=True)
        result = chaos.run_schedule(
            spec, os.path.join(base, f"seed{seed}"), timeout=args.timeout, reference_cache=cache
        )
        results.append((seed, spec, result))
        status = "PASS" if result["ok"] else "FAIL"
        print(
            f"    {status} in {result['seconds']} s"
            + "".join(f"\n    - {f}" for f in result["failures"])
            + "".join(f"\n    ~ {w}" for w in result["warnings"]),
            flush=True,
        )
        if result["ok"] and not args.keep:
            import shutil

            shutil.rmtree(os.path.join(base, f"seed{seed}"), ignore_errors=True)

    failed = [(s, spec, r) for s, spec, r in results if not r["ok"]]
    sigterm_failed = [f for f in failed if f[2]["sigterm"] and all(x.startswith("[SIGTERM]") for x in f[2]["failures"])]
    print()
    print("| schedules | passed | failed | failed only on SIGTERM checks | wall time |")
    print("|---|---|---|---|---|")
    print(
        f"| {len(results)} | {len(results) - len(failed)} | {len(failed)} | {len(sigterm_failed)} | "
        f"{time.monotonic() - start:.0f} s |"
    )
    if failed:
        print()
        print("| seed | schedule | first failure |")
        print("|---|---|---|")
        for seed, spec, r in failed:
            first = r["failures"][0].replace("|", "/")
            print(f"| {seed} | {chaos.describe(spec)} | {first[:300]} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
