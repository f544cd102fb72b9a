"""Showing a Plan: a rich table for people, JSON for programs, a PNG bar chart of the breakdown.

The table has one row per configuration at the whole per-device batch, plus
-- where that does not fit -- the largest micro-batch split that does (or the
smallest one, to show how far off it is). Every row gives the predicted peak
of live tensors per device ("allocated"), what the caching allocator will
reserve for it, the breakdown, host memory per node, and the modelled step
time relative to the recommendation. The title says which number "fits" is
judged on.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List

from shardwise.memory import format_bytes
from shardwise.plan.core import CATEGORIES, Estimate, Plan
from shardwise.plan.recommend import format_seconds

_SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "temporary": "temp",
}


def rows_to_show(p: Plan, show_all: bool = False) -> List[Estimate]:
    if show_all:
        return list(p.estimates)
    out: List[Estimate] = []
    seen = []
    for e in p.estimates:
        key = e.candidate.config_key
        if key in seen:
            continue
        seen.append(key)
        rows = [x for x in p.estimates if x.candidate.config_key == key]
        out.append(rows[0])
        if len(rows) > 1 and rows[0].fits is False:
            fitting = [x for x in rows[1:] if x.fits]
            out.append(fitting[0] if fitting else rows[-1])
    return out


def short_bytes(n: float) -> str:
    """Compact binary units for table cells: 171.6G, 886M, 12K."""
    for unit, size in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{int(n)}B"


def _fits(e: Estimate) -> str:
    return "-" if e.fits is None else ("[green]yes[/green]" if e.fits else "[red]no[/red]")


def print_table(p: Plan, console: Any = None, show_all: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    if console is None:
        # Piped output would be cut to 80 columns; the table needs about 130.
        console = Console() if sys.stdout.isatty() else Console(width=160)
    dev = format_bytes(p.device_memory) if p.device_memory else "unknown"
    title = (
        f"{p.model}: {p.num_nodes} node(s) x {p.devices} device(s), {p.precision}, batch {p.batch_size} x "
        f"{p.seq_len} tokens per device, device memory {dev}"
    )
    table = Table(title=title, caption=f"fits = {p.fits_uses} <= device memory (and host memory per node, if given)")
    columns = [
        "configuration",
        "mb x acc",
        "allocated",
        "reserved",
        *(_SHORT[c] for c in CATEGORIES),
        "host/node",
        "step",
        "t/rec.",
        "fits",
    ]
    for col in columns:
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=col != "configuration")
    best = p.recommended.step_seconds if p.recommended else None
    for e in rows_to_show(p, show_all):
        style = "bold" if p.recommended is e else None
        rel = f"{e.step_seconds / best:.2f}x" if best else "-"
        table.add_row(
            e.candidate.config_label + (" *" if "fallback" in e.method else ""),
            f"{e.candidate.micro_batch}x{e.candidate.accumulation}",
            short_bytes(e.allocated),
            short_bytes(e.reserved),
            *(short_bytes(e.breakdown.get(c, 0.0)) for c in CATEGORIES),
            short_bytes(e.cpu_per_node),
            format_seconds(e.step_seconds),
            rel,
            _fits(e),
            style=style,
        )
    console.print(table)
    verdict = "Recommended: " if p.recommended else ""
    console.print(f"[bold]{verdict}{p.reason}[/bold]")
    if p.recommended:
        blocks = ", ".join(sorted(getattr(b, "__name__", str(b)) for b in p.block_classes)) or "Block"
        console.print(
            f"  Trainer(strategy={p.recommended.candidate.trainer_strategy_code(blocks)}, "
            f"accumulate_grad_batches={p.recommended.candidate.accumulation}) with DataLoader(batch_size="
            f"{p.recommended.candidate.micro_batch})"
        )
    for note in p.notes:
        console.print(f"  note: {note}")
    for item in p.assumptions:
        console.print(f"  assumes: {item}")
    if any("fallback" in e.method for e in p.estimates):
        console.print("  * analytic per-block estimate (the model could not be traced)")
    console.print(
        f"  planned in {p.elapsed_s:.1f}s; step times are modelled on {p.hardware['gpu']} with "
        f"{p.hardware['interconnect']} / {p.hardware['network']} (relative, not a promise)"
    )


def to_json(p: Plan) -> str:
    return json.dumps(p.to_dict(), indent=2, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def plot(p: Plan, path: str, show_all: bool = False) -> str:
    """A horizontal stacked bar per configuration (breakdown + allocator margin), device memory marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_to_show(p, show_all)
    gib = float(2**30)
    labels = [f"{e.candidate.config_label} ({e.candidate.micro_batch}x{e.candidate.accumulation})" for e in rows]
    colors = {
        "parameters": "#4c72b0",
        "gradients": "#dd8452",
        "optimizer": "#55a868",
        "activations": "#c44e52",
        "temporary": "#8172b3",
        "allocator margin": "#cccccc",
    }
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.8))
    left = [0.0] * len(rows)
    segments: Dict[str, List[float]] = {c: [e.breakdown.get(c, 0.0) / gib for e in rows] for c in CATEGORIES}
    segments["allocator margin"] = [(e.reserved - e.allocated) / gib for e in rows]
    for name, values in segments.items():
        ax.barh(labels, values, left=left, color=colors[name], label=name)
        left = [a + b for a, b in zip(left, values)]
    if p.device_memory:
        ax.axvline(p.device_memory / gib, color="black", linestyle="--", linewidth=1)
        ax.text(p.device_memory / gib, -0.9, f" device {format_bytes(p.device_memory)}", fontsize=8, va="bottom")
    ax.invert_yaxis()
    ax.set_xlabel("GiB per device")
    ax.set_title(
        f"{p.model}, {p.num_nodes}x{p.devices} devices, {p.precision}, batch {p.batch_size}x{p.seq_len}", fontsize=10
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
