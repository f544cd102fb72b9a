"""Checkpoint benchmark: sharded vs full on 2 processes, and convert's peak memory.

    python benchmarks/checkpoint_bench.py [--layers 24 --hidden 2048] [--out BENCHMARKS.md]

An MLP of `layers` Linear(hidden, hidden) + LayerNorm blocks is trained one
step with AdamW under FSDP on 2 CPU processes (gloo), then saved and loaded
in both formats. Per rank we report wall time and the process's peak
resident memory above what it held just before (VmHWM after writing 5 to
/proc/self/clear_refs, minus VmRSS at that point): a full checkpoint
gathers the whole model and optimizer state into rank 0's memory, a sharded
one never gathers anything. Loading a full file maps it on every rank, so
its pages count as resident there. Load times are the median of --repeats
further loads, alternating the formats, with the CPU seconds of the busiest
rank beside them (steadier than wall time on a shared machine); both
formats verify their checksums, as a real resume does
(SHARDWISE_VERIFY_CHECKSUMS=0 measures without). Then `shardwise convert` runs in a fresh
process on each checkpoint, and its peak (measured the same way, from just
before the conversion) is compared with the model's size and its largest
tensor. Prints a markdown table; with --out, replaces the section
"### Checkpoints: save and load speed" of that file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import shardwise
from shardwise.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss

SECTION = "### Checkpoints: save and load speed"
MB = 1e6


def _model(layers: int, hidden: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.LayerNorm(hidden)]
    return nn.Sequential(*blocks)


def _measure(fn):
    import torch.distributed as dist

    dist.barrier()
    reset_peak_rss()
    base = current_rss_bytes()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start, max(0, peak_rss_bytes() - base)


def _timed(fn):
    """Wall and this process's CPU seconds of a collective `fn` (CPU time is steadier on a shared machine)."""
    import torch.distributed as dist

    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu
    dist.barrier()
    return time.perf_counter() - wall, cpu


def _median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def run_rank(root: str, layers: int, hidden: int, repeats: int = 3) -> dict:
    """On each of 2 ranks: build, step once, save + load in both formats, then `repeats` more loads
    alternating sharded / full (medians reported: one load on a shared machine says little)."""
    from shardwise.checkpoint.layout import build_manifest

    shardwise.seed_everything(0)
    strategy = shardwise.FSDPStrategy()
    strategy.connect("cpu", "32-true")
    strategy.setup_environment()
    with strategy.module_init_context():
        model = _model(layers, hidden)
    model = strategy.setup_module(model)
    opt = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    model(torch.randn(8, hidden)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    results = {}
    for fmt in ("sharded", "full"):
        strategy.state_dict_type = fmt
        path = os.path.join(root, f"{fmt}.ckpt")
        state = {"shardwise": build_manifest(fmt, "fsdp", strategy.world_size, {})}
        save_s, save_peak = _measure(lambda: strategy.save_checkpoint(path, state))
        load_s, load_peak = _measure(lambda: strategy.load_checkpoint(path, fmt))
        results[fmt] = {
            "save_s": save_s,
            "save_peak": save_peak,
            "load_s": load_s,
            "load_peak": load_peak,
            "loads": [],
            "load_cpu": [],
        }
    for _ in range(repeats):
        for fmt in ("sharded", "full"):
            wall, cpu = _timed(lambda: strategy.load_checkpoint(os.path.join(root, f"{fmt}.ckpt"), fmt))
            results[fmt]["loads"].append(wall)
            results[fmt]["load_cpu"].append(cpu)
    for fmt in results:
        results[fmt]["first_load_s"] = results[fmt]["load_s"]  # the process's first load of that format
        if repeats:
            results[fmt]["load_s"] = _median(results[fmt]["loads"])
    return results


def convert_child(ckpt: str, out: str) -> None:
    """In a fresh process: peak memory of convert above the state just before it."""
    from shardwise.checkpoint.reader import open_checkpoint
    from shardwise.recipes.convert import convert

    reader = open_checkpoint(ckpt)  # warm imports / metadata outside the measurement
    infos = reader.tensors()
    reset_peak_rss()
    base = current_rss_bytes()
    start = time.perf_counter()
    convert(ckpt, out, quiet=True)
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "peak": max(0, peak_rss_bytes() - base),
                "seconds": seconds,
                "model": sum(i.nbytes for i in infos),
                "largest": max(i.nbytes for i in infos),
            }
        )
    )


def _size(path: str) -> int:
    """Bytes on disk (a directory: all its files)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _cpu(ranks, fmt) -> float:
    per_load = zip(*(r[fmt]["load_cpu"] for r in ranks))
    values = [max(v) for v in per_load]
    return _median(values) if values else 0.0


def render(ranks, sizes, converts, layers, hidden) -> str:
    params = layers * (hidden * hidden + 3 * hidden)
    s, f = ranks[0]["sharded"], ranks[0]["full"]
    s1, f1 = ranks[1]["sharded"], ranks[1]["full"]

    def ratio(a, b):
        return f"{a / b:.2f}x" if b else "n/a"

    lines = [
        f"Model: {layers} x (Linear({hidden}, {hidden}) + LayerNorm), {params / 1e6:.1f}M parameters fp32 "
        f"({params * 4 / MB:.0f} MB) + AdamW state; FSDP on 2 CPU processes (gloo). Peak = VmHWM above the RSS "
        "just before the operation.",
        "",
        "| | sharded (DCP) | full (rank-0 gather) | full / sharded |",
        "|---|---|---|---|",
        f"| checkpoint on disk | {sizes['sharded'] / MB:.0f} MB | {sizes['full'] / MB:.0f} MB | "
        f"{ratio(sizes['full'], sizes['sharded'])} |",
        f"| save time | {s['save_s']:.2f} s | {f['save_s']:.2f} s | {ratio(f['save_s'], s['save_s'])} |",
        f"| load time (median of {len(s['loads']) or 1}) | {s['load_s']:.2f} s | {f['load_s']:.2f} s | "
        f"{ratio(f['load_s'], s['load_s'])} |",
        f"| first load in the process | {s['first_load_s']:.2f} s | {f['first_load_s']:.2f} s | "
        f"{ratio(f['first_load_s'], s['first_load_s'])} |",
        f"| load CPU time, busiest rank (median) | {_cpu(ranks, 'sharded'):.2f} s | {_cpu(ranks, 'full'):.2f} s | "
        f"{ratio(_cpu(ranks, 'full'), _cpu(ranks, 'sharded'))} |",
        f"| save peak, rank 0 | {s['save_peak'] / MB:.0f} MB | {f['save_peak'] / MB:.0f} MB | "
        f"{ratio(f['save_peak'], s['save_peak'])} |",
        f"| save peak, rank 1 | {s1['save_peak'] / MB:.0f} MB | {f1['save_peak'] / MB:.0f} MB | "
        f"{ratio(f1['save_peak'], s1['save_peak'])} |",
        f"| load peak, rank 0 | {s['load_peak'] / MB:.0f} MB | {f['load_peak'] / MB:.0f} MB | "
        f"{ratio(f['load_peak'], s['load_peak'])} |",
        f"| load peak, rank 1 | {s1['load_peak'] / MB:.0f} MB | {f1['load_peak'] / MB:.0f} MB | "
        f"{ratio(f1['load_peak'], s1['load_peak'])} |",
        "",
        "| `shardwise convert` from | model size | largest tensor | convert peak | peak / model size | time |",
        "|---|---|---|---|---|---|",
    ]
    for fmt, c in converts.items():
        lines.append(
            f"| {fmt} | {c['model'] / MB:.0f} MB | {c['largest'] / MB:.1f} MB | {c['peak'] / MB:.1f} MB | "
            f"{c['peak'] / c['model']:.3f} | {c['seconds']:.2f} s |"
        )
    return "\n".join(lines)


def write_section(path: str, body: str, command: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    date = datetime.date.today().isoformat()
    section = (
        f"{SECTION}\n\nCommand: `{command}` ({date}, {os.cpu_count()} CPU cores, torch "
        f"{torch.__version__}; timings on a shared machine vary, ratios are what to read).\n\n{body}\n"
    )
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^#{2, 3} |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as fh:
        fh.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description="sharded vs full checkpoints; convert's peak memory")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--out", default=None, help="markdown file whose checkpoint section to replace")
    parser.add_argument("--repeats", type=int, default=3, help="extra loads per format, alternating (medians)")
    parser.add_argument("--convert-child", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert_child:
        convert_child(*args.convert_child)
        return
    with tempfile.TemporaryDirectory(prefix="shardwise-ckpt-bench-") as root:
        ranks = shardwise.launch(run_rank, root, args.layers, args.hidden, args.repeats, devices=2)
        sizes = {fmt: _size(os.path.join(root, f"{fmt}.ckpt")) for fmt in ("sharded", "full")}
        converts = {}
        for fmt in ("sharded", "full"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--convert-child",
                    os.path.join(root, f"{fmt}.ckpt"),
                    os.path.join(root, f"out-{fmt}"),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            converts[fmt] = json.loads(out.stdout.strip().splitlines()[-1])
    body = render(ranks, sizes, converts, args.layers, args.hidden)
    print(body)
    if args.out:
        command = "python benchmarks/checkpoint_bench.py" + (
            "" if (args.layers, args.hidden) == (24, 2048) else f" --layers {args.layers} --hidden {args.hidden}"
        )
        write_section(args.out, body, command + f" --out {os.path.basename(args.out)}")


if __name__ == "__main__":
    main()
