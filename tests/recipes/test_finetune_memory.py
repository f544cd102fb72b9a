# The seed recipe's first problem, measured: loading a pretrained checkpoint
# on 2 processes must not cost every rank the whole model in host RAM. Only
# rank 0 reads the safetensors; rank 1 receives its slices in bounded pieces.
# Measured as each rank's peak RSS growth (VmHWM after /proc/self/clear_refs)
# from the moment its empty shards exist (on a GPU those live in device
# memory; see benchmarks/finetune_loading.py for the full table).
from __future__ import annotations

import pytest

from helpers.hf import build_model_folder, chat_records


def load_and_report(model_dir):
    import torch.distributed as dist

    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig, _build_strategy, build_module
    from shardwise.recipes.hf_model import inspect_model_folder

    cfg = FinetuneConfig(model_path=model_dir, precision="32-true", data=DataOptions(dataset="-"))
    folder = inspect_model_folder(model_dir)
    strategy = _build_strategy(cfg, folder)
    strategy.connect("cpu", "32-true")
    strategy.setup_environment()
    module = build_module(cfg, folder, 1)
    with strategy.module_init_context():
        module.configure_model()
    strategy.setup_module(module)
    report = module.load_report
    dist.barrier()
    return {"rank": dist.get_rank(), "growth": report.peak_growth, "read": report.bytes_read}


@pytest.mark.slow
def test_rank1_loading_ram_is_a_fraction_of_rank0s(tmp_path):
    import os

    from shardwise import launch

    model_dir = build_model_folder(
        str(tmp_path / "llama"),
        chat_records(20),
        hidden=512,
        layers=6,
        heads=8,
        kv_heads=8,
        intermediate=1408,
        vocab_pad=32000,
        max_positions=256,
    )
    size = os.path.getsize(os.path.join(model_dir, "model.safetensors"))
    assert size > 150 * 2**20
    rank0, rank1 = sorted(launch(load_and_report, model_dir, devices=2), key=lambda r: r["rank"])
    assert rank0["read"] > 0.99 * size and rank1["read"] == 0  # only rank 0 touched the file
    assert rank0["growth"] > 0.5 * size, rank0
    assert rank1["growth"] < 0.25 * rank0["growth"], (rank0, rank1)
