"""Seed 002, "Accessible Multi-Billion Parameter Model Training with PyTorch Lightning + DeepSpeed".

Its Trainer lines (Lightning 1.x spellings) and its minGPT benchmark command line as printed,
with gpus=8 -> 2 CPU processes, precision 16 -> bf16-mixed (fp16 is CUDA-only) and the model
scaled from billions of parameters to a few thousand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_seed_002_trainer_lines():
    import shardwise as pl
    from shardwise import DeepSpeedPlugin  # pytorch_lightning.plugins.DeepSpeedPlugin

    with pytest.warns(UserWarning, match="accelerator='ddp'"):
        trainer = pl.Trainer(devices=2, accelerator="ddp")  # gpus=8
    assert trainer.strategy.name == "ddp" and trainer.devices == 2
    trainer = pl.Trainer(
        devices=2,
        accelerator="cpu",  # gpus=8
        plugins=DeepSpeedPlugin(stage=3, cpu_offload=True, partition_activations=True),
    )
    assert trainer.strategy.stage == 3 and trainer.strategy.offload_optimizer
    trainer = pl.Trainer(devices=2, accelerator="cpu", strategy="deepspeed_stage_3_offload", precision="bf16-mixed")
    assert trainer.strategy.stage == 3 and trainer.strategy.offload_optimizer


@pytest.mark.slow
def test_seed_002_benchmark_command_line(tmp_path):
    # "DeepSpeed ZeRO Stage 3": python benchmark.py --n_layer 16 --n_head 16 --n_embd 8192 --gpus 8 --precision 16
    command = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "mingpt.py"),
        "--n_layer",
        "2",
        "--n_head",
        "2",
        "--n_embd",
        "32",
        "--gpus",
        "2",
        "--precision",
        "bf16-mixed",
        # sizes: a short run of a small vocabulary
        "--limit_train_batches",
        "2",
        "--batch_size",
        "1",
        "--max_epochs",
        "2",
        "--vocab_size",
        "256",
        "--block_size",
        "32",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] Average Epoch time: \d+\.\d+ seconds", done.stdout), done.stdout
        assert re.search(rf"\[rank {rank}\] Average Peak memory \d+\.\d+MiB", done.stdout), done.stdout
    assert "strategy deepspeed_stage_3, 2 process(es)" in done.stdout
