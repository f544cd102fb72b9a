"""The pictures of docs/charts.md: the demo's memory per strategy and the planner's `--plot` chart.

    python benchmarks/charts.py                  # both charts into docs/img/ (runs the demo: minutes on 2 cores)
    python benchmarks/charts.py --only plan      # the planner's chart alone (about 10 s)
    python benchmarks/charts.py --demo-json docs/img/demo_memory.json   # redraw the demo chart, no re-run

The demo chart shows the figures `shardwise demo` prints in its memory table: peak tracked tensor memory per
rank (parameters, gradients, optimizer state, activations) over the first steps of each strategy's run, on
CPU processes, with the default demo model. It runs `demo()` itself with a short main run: memory is
measured over the first two optimizer steps of every run, so the main run's length does not change it.
The figures are saved beside the PNG (demo_memory.json) so the chart can be redrawn without the demo.
The planner chart is exactly `shardwise plan ... --plot PATH` for the named model and GPU.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Optional, Sequence

MIB = float(2**20)
# The demo's own labels and the Lightning FSDP guide's figures it prints beside its own.
DEMO_LABELS = {
    "ddp": "DDP",
    "fsdp_no_shard": "NO_SHARD",
    "fsdp_shard_grad_op": "SHARD_GRAD_OP",
    "fsdp": "FULL_SHARD",
    "fsdp_ac": "FULL_SHARD\n+ act. ckpt",
}
SEGMENTS = (  # (label, colour, breakdown keys): the demo table's columns, in its order
    ("parameters", "#4c72b0", ("parameters",)),
    ("gradients", "#dd8452", ("gradients",)),
    ("optimizer", "#55a868", ("optimizer",)),
    ("activations", "#c44e52", ("activations", "other")),
    ("buffers", "#8172b3", ("buffers",)),
)
PLAN_DEFAULT = dict(model="llama-2-7b", devices=8, device_memory="80GiB", gpu="a100")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or a server
    import matplotlib.pyplot as plt

    return plt


def demo_memory_chart(rows: Sequence[Dict[str, Any]], path: str, where: str = "2 CPU processes") -> str:
    """A stacked bar per strategy of the demo's peak tracked memory per rank, MiB, and each one's ratio to DDP
    beside the ratio in Lightning's FSDP guide (A100, 1B model). `rows` are what `demo()` returns (name,
    peak bytes, breakdown bytes per category); writes the PNG to `path` and returns it."""
    from shardwise.cli.demo import GUIDE_TABLE

    if not rows:
        raise ValueError("demo_memory_chart: no rows (run the demo, or pass its saved demo_memory.json).")
    unknown = [r["name"] for r in rows if r["name"] not in DEMO_LABELS]
    if unknown:
        raise ValueError(f"demo_memory_chart: unknown strategies {unknown}; the demo's are {', '.join(DEMO_LABELS)}.")
    plt = _pyplot()
    labels = [DEMO_LABELS[r["name"]] for r in rows]
    fig, (ax, ratio_ax) = plt.subplots(1, 2, figsize=(11, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(rows)
    for label, colour, keys in SEGMENTS:
        values = [sum(r["breakdown"].get(k, 0) for k in keys) / MIB for r in rows]
        if any(values):
            ax.bar(labels, values, bottom=bottom, color=colour, label=label, width=0.65)
            bottom = [a + b for a, b in zip(bottom, values)]
    ddp = next((r["peak"] for r in rows if r["name"] == "ddp"), None)
    for i, r in enumerate(rows):
        text = f"{r['peak'] / MIB:.1f} MiB" + (f"\n{r['peak'] / ddp:.2f}x DDP" if ddp else "")
        ax.text(i, max(bottom[i], r["peak"] / MIB), text, ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak tracked tensor memory per rank (MiB)")
    ax.set_ylim(0, max(max(bottom), max(r["peak"] for r in rows) / MIB) * 1.22)
    ax.set_title(f"shardwise demo: memory per rank, {where}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.tick_params(axis="x", labelsize=8)

    # Ratios to DDP: ours (tracked, CPU) against the guide's (CUDA, A100 40GB), where the guide has the row.
    if ddp:
        names = [r["name"] for r in rows]
        xs = list(range(len(rows)))
        ours = [r["peak"] / ddp for r in rows]
        guide = [GUIDE_TABLE[n][0] / GUIDE_TABLE["ddp"][0] if n in GUIDE_TABLE else 0.0 for n in names]
        ratio_ax.bar([x - 0.2 for x in xs], ours, width=0.4, color="#4c72b0", label="shardwise demo")
        ratio_ax.bar([x + 0.2 for x in xs], guide, width=0.4, color="#bbbbbb", label="Lightning guide, A100")
        ratio_ax.set_xticks(xs, [label.replace("\n", " ") for label in labels], fontsize=7, rotation=25, ha="right")
        ratio_ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ratio_ax.set_ylabel("peak memory / DDP's")
        ratio_ax.set_title("vs DDP (guide: no act. ckpt row)", fontsize=10)
        ratio_ax.legend(fontsize=8)
    else:
        ratio_ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_demo(devices: int = 2, steps: int = 6) -> List[Dict[str, Any]]:
    """`shardwise demo`'s rows with its default model and strategies; `steps` shortens only the main run."""
    import tempfile

    from shardwise.cli.demo import demo

    with tempfile.TemporaryDirectory() as root:
        rows = demo(devices=devices, steps=steps, root_dir=root)
    return [
        dict(name=r["name"], peak=int(r["peak"]), breakdown={k: int(v) for k, v in r["breakdown"].items()})
        for r in rows
    ]


def plan_chart(path: str, model: str, devices: int, device_memory: str, gpu: str) -> str:
    """The planner's own `--plot` chart: `shardwise plan --model M --devices N --device-memory X --gpu G --plot`."""
    from shardwise.cli import main

    code = main(
        ["plan", "--model", model, "--devices", str(devices), "--device-memory", device_memory, "--gpu", gpu]
        + ["--plot", path]
    )
    if code != 0 or not os.path.exists(path):
        raise RuntimeError(f"shardwise plan exited {code} without writing {path}")
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/img", help="folder of the PNGs (default docs/img)")
    p.add_argument("--only", choices=["demo", "plan"], help="draw one chart only")
    p.add_argument("--demo-json", help="redraw the demo chart from these saved figures instead of running the demo")
    p.add_argument("--devices", type=int, default=2, help="demo processes (default 2, the demo's)")
    p.add_argument("--plan-model", default=PLAN_DEFAULT["model"])
    p.add_argument("--plan-devices", type=int, default=PLAN_DEFAULT["devices"])
    p.add_argument("--plan-device-memory", default=PLAN_DEFAULT["device_memory"])
    p.add_argument("--plan-gpu", default=PLAN_DEFAULT["gpu"])
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.only in (None, "demo"):
        if args.demo_json:
            with open(args.demo_json) as fh:
                saved = json.load(fh)
        else:
            saved = dict(devices=args.devices, rows=run_demo(args.devices))
            with open(os.path.join(args.out, "demo_memory.json"), "w") as fh:
                json.dump(saved, fh, indent=1)
        where = f"{saved['devices']} CPU processes"
        print("wrote", demo_memory_chart(saved["rows"], os.path.join(args.out, "demo_memory.png"), where))
    if args.only in (None, "plan"):
        name = f"plan_{args.plan_model}_{args.plan_devices}x{args.plan_gpu}.png"
        # the planner prints its table and "wrote PATH" itself
        plan_chart(
            os.path.join(args.out, name), args.plan_model, args.plan_devices, args.plan_device_memory, args.plan_gpu
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
