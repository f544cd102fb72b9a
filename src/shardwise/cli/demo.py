"""`shardwise demo`: a Transformer language model trained with FSDP on this machine, then compared.

Trains the Transformer of Lightning's FSDP guide (smaller by default) on the
bundled text, or a local WikiText-2 folder, with FSDP across local processes;
then runs a few steps under each strategy of the guide's comparison table --
DDP, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, FULL_SHARD with activation
checkpointing -- and prints each one's peak tracked tensor memory per rank and
speed beside the guide's A100 figures. Memory is measured over the first steps
(the optimizer state appears at the first step, so the peak is there), speed on
the untracked steps after them.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

# Lightning's FSDP guide, A100 40GB, Lightning 2.1 / PyTorch 2.1, its 1B Transformer: MB per GPU, it/s.
GUIDE_TABLE = {
    "ddp": (23125, 4.31),
    "fsdp_no_shard": (19296, 3.04),
    "fsdp_shard_grad_op": (11772, 3.61),
    "fsdp": (9627, 3.19),
}
LABELS = {
    "ddp": "DDP",
    "fsdp_no_shard": "FSDP NO_SHARD",
    "fsdp_shard_grad_op": "FSDP SHARD_GRAD_OP",
    "fsdp": "FSDP FULL_SHARD",
    "fsdp_ac": "FULL_SHARD + act. ckpt",
}
TRACKED_STEPS = 2


class _Probe:
    """Callback: tracked memory over the first steps, then wall-clock speed on the rest."""

    def __init__(self) -> None:
        self.peak: Dict[str, int] = {}
        self.peak_total = 0
        self.t0: Optional[float] = None
        self.timed_steps = 0
        self.last_loss = float("nan")

    def on_train_start(self, trainer, module) -> None:
        from shardwise.memory import start_tracking

        start_tracking(trainer.strategy.module, trainer.strategy.optimizers)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        from shardwise.memory import stop_tracking

        if not trainer.is_last_microbatch:
            return
        # detached: float() of a tensor that requires grad warns (once per rank) in torch
        self.last_loss = float(outputs.detach() if hasattr(outputs, "detach") else outputs)
        if trainer.global_step == TRACKED_STEPS:
            tracker = stop_tracking()
            self.peak, self.peak_total = tracker.peak_breakdown, tracker.peak_bytes
            self.t0 = time.perf_counter()
        elif trainer.global_step > TRACKED_STEPS:
            self.timed_steps += 1

    def on_train_end(self, trainer, module) -> None:
        from shardwise.memory import stop_tracking

        stop_tracking()
        self.elapsed = time.perf_counter() - (self.t0 or time.perf_counter())


def _strategy(name: str):
    """A strategy-table name, FSDP wrapping (and `_ac` checkpointing) the Transformer's layers."""
    from torch import nn

    from shardwise.strategies import build_strategy

    return build_strategy(name, blocks={nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})


def _worker(cfg: Dict[str, Any]) -> List[Dict[str, Any]]:
    from torch.utils.data import DataLoader

    import shardwise
    from shardwise.demos import LanguageModel, load_text_dataset

    dataset = load_text_dataset(cfg["data_dir"], block_size=cfg["block_size"])
    rows = []
    for index, name in enumerate(cfg["strategies"]):
        main_run = index == 0
        shardwise.seed_everything(42)
        probe = _Probe()
        trainer = shardwise.Trainer(
            accelerator=cfg["accelerator"],
            devices=cfg["devices"],
            strategy=_strategy(name),
            precision=cfg["precision"],
            max_steps=cfg["steps"] if main_run else cfg["compare_steps"],
            callbacks=[probe],
            enable_progress_bar=main_run,
            logger=main_run,
            enable_checkpointing=False,
            log_every_n_steps=5,
            default_root_dir=cfg["root_dir"],
        )
        if main_run:
            trainer.print(
                f"Training a Transformer ({cfg['nlayers']} layers, ninp {cfg['ninp']}, nhid "
                f"{cfg['nhid']}) on {type(dataset).__name__} ({len(dataset)} blocks of "
                f"{cfg['block_size']} tokens, vocab {dataset.vocab_size}) with {LABELS[name]} on "
                f"{cfg['devices']} processes..."
            )
        model = LanguageModel(
            dataset.vocab_size,
            nlayers=cfg["nlayers"],
            nhid=cfg["nhid"],
            ninp=cfg["ninp"],
            nhead=cfg["nhead"],
            lr=cfg["lr"],
        )
        trainer.fit(model, DataLoader(dataset, batch_size=cfg["batch_size"], shuffle=True))
        n_params = sum(p.numel() for p in model.parameters())  # FSDP2's DTensors report their global size
        if main_run:
            trainer.print(  # the progress bar's own "done:" line has just given the steps and time
                f"{LABELS[name]}: final loss {probe.last_loss:.3f}, {n_params / 1e6:.1f}M parameters. "
                f"Comparing strategies ({cfg['compare_steps']} steps each)..."
            )
        speed = probe.timed_steps / probe.elapsed if probe.elapsed > 0 and probe.timed_steps else float("nan")
        rows.append(
            dict(
                name=name,
                peak=probe.peak_total,
                breakdown=probe.peak,
                its=speed,
                loss=probe.last_loss,
                params=n_params,
                device=trainer.strategy.root_device.type,
            )
        )
    return rows


def _table(rows: List[Dict[str, Any]], devices: int) -> None:
    device = rows[0].get("device", "cpu") if rows else "cpu"
    where = f"{devices} GPU(s)" if device == "cuda" else f"{devices} CPU processes"
    from rich.console import Console
    from rich.table import Table

    from shardwise.memory import format_bytes

    ddp = next((r for r in rows if r["name"] == "ddp"), None)
    table = Table(
        title=f"Peak tracked tensor memory per rank and speed, {where} "
        "(guide: Lightning's FSDP guide, A100 40GB, 1B model)"
    )
    for col in (
        "strategy",
        "peak/rank",
        "vs DDP",
        "params",
        "grads",
        "optim",
        "activ.",
        "it/s",
        "guide MB",
        "guide vs DDP",
        "guide it/s",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        b = r["breakdown"]
        guide = GUIDE_TABLE.get(r["name"])
        table.add_row(
            LABELS[r["name"]],
            format_bytes(r["peak"]),
            f"{r['peak'] / ddp['peak']:.2f}x" if ddp and ddp["peak"] else "-",
            format_bytes(b.get("parameters", 0)),
            format_bytes(b.get("gradients", 0)),
            format_bytes(b.get("optimizer", 0)),
            format_bytes(b.get("activations", 0) + b.get("other", 0)),
            f"{r['its']:.2f}",
            f"{guide[0]:,}" if guide else "-",
            f"{guide[0] / GUIDE_TABLE['ddp'][0]:.2f}x" if guide else "-",
            f"{guide[1]:.2f}" if guide else "-",
        )
    console = Console()
    if not console.is_terminal:  # CI logs and pipes: keep the table on one line per row
        console = Console(width=170)
    console.print(table)


def demo(
    devices: int = 2,
    steps: int = 40,
    compare_steps: int = 6,
    nlayers: int = 8,
    nhid: int = 1024,
    ninp: int = 128,
    nhead: int = 4,
    batch_size: int = 4,
    block_size: int = 32,
    lr: float = 1e-3,
    precision: str = "32-true",
    data_dir: Optional[str] = None,
    root_dir: str = "shardwise_demo",
    strategies: Optional[List[str]] = None,
    accelerator: str = "auto",
) -> List[Dict[str, Any]]:
    """Train a Transformer language model with FSDP on `devices` local processes, then compare strategies.

    Args:
        devices: local processes (CPU) or GPUs.
        steps: optimizer steps of the main FSDP run.
        compare_steps: steps of each comparison run (the first 2 are measured for memory).
        nlayers: Transformer layers (the guide's 1B model: 32).
        nhid: feed-forward width (1B: 4096).
        ninp: embedding width (1B: 1024).
        nhead: attention heads (1B: 64).
        batch_size: sequences per process per step.
        block_size: tokens per sequence.
        lr: learning rate.
        precision: 32-true, bf16-mixed, ...
        root_dir: where the main run writes its logs.
        data_dir: a local WikiText-2 folder; default: text that ships with Python.
        strategies: which of fsdp, ddp, fsdp_no_shard, fsdp_shard_grad_op, fsdp_ac to run (first = main run).
        accelerator: auto (CUDA when visible, else CPU processes with gloo), cuda or cpu.
    """
    import shardwise

    strategies = strategies or ["fsdp", "ddp", "fsdp_no_shard", "fsdp_shard_grad_op", "fsdp_ac"]
    unknown = [s for s in strategies if s not in LABELS]
    if unknown:
        raise ValueError(f"Unknown demo strategies {unknown}; choose from {', '.join(LABELS)}.")
    from shardwise.distributed.env import resolve_accelerator

    resolve_accelerator(accelerator)  # an unknown name, or cuda without a GPU, fails before any process starts
    if compare_steps <= TRACKED_STEPS:
        raise ValueError(f"compare_steps must be above {TRACKED_STEPS} (the tracked warm-up steps).")
    cfg = dict(
        devices=devices,
        steps=steps,
        compare_steps=compare_steps,
        nlayers=nlayers,
        nhid=nhid,
        ninp=ninp,
        nhead=nhead,
        batch_size=batch_size,
        block_size=block_size,
        lr=lr,
        precision=precision,
        data_dir=data_dir,
        root_dir=root_dir,
        strategies=strategies,
        accelerator=accelerator,
    )
    rows = shardwise.launch(_worker, cfg, devices=devices)[0]
    order = {"ddp": 0, "fsdp_no_shard": 1, "fsdp_shard_grad_op": 2, "fsdp": 3, "fsdp_ac": 4}
    rows.sort(key=lambda r: order[r["name"]])
    _table(rows, devices)
    return rows


def parser() -> Any:
    from jsonargparse import ArgumentParser

    p = ArgumentParser(description=demo.__doc__.split("\n")[0])
    p.add_function_arguments(demo, as_group=False)
    return p


def run(cfg: Any) -> int:
    demo(**cfg.as_dict())
    return 0
