"""Collectives run on the backend's device: CPU tensors and numbers are moved there and back (issue 15).

NCCL moves only CUDA tensors; `self.log(..., sync_dist=True)` values,
epoch accumulators and the recipe's loss reductions are CPU tensors or
Python numbers. On 2 gloo processes, tests/helpers/strict_device.py makes the
collectives behave like NCCL's (anything not on "cuda:0" is refused; the
fake CUDA tensors hold CPU data), and the real code paths run under it:
the Trainer's metric reduction (step and epoch, mean / max / sum, tensors
and numbers, training and validation) and `shardwise finetune`'s per-step
and evaluation losses. Before the fix, ops.reduce passed its CPU tensor
straight to dist.all_reduce, which the strict check refuses.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.distributed import ops

from helpers.strict_device import strict_cuda_collectives


class Logs(TrainModule):
    """Logs rank-dependent values in every way sync_dist reduces them."""

    def configure_model(self):
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch):
        rank = ops.rank()
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("rank_mean", float(rank + 1), sync_dist=True, on_step=True, on_epoch=True)  # a Python number
        self.log("rank_max", torch.tensor(rank + 1.0), sync_dist=True, reduce_fx="max", on_epoch=True)
        self.log("rank_sum", torch.tensor(rank + 1.0), sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_rank", float(ops.rank() + 1), sync_dist=True, batch_size=1 + ops.rank())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_metrics():
    data = TensorDataset(torch.randn(8, 4))
    with strict_cuda_collectives() as calls:
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(),
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
        )
        trainer.fit(Logs(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))
        direct = {
            "number": float(ops.reduce(ops.rank() + 1, "sum")),
            "int_mean": float(ops.reduce(torch.tensor(ops.rank()), "mean")),
            "device": str(ops.reduce(torch.ones(2), "max").device),
        }
    return dict(trainer.callback_metrics), dict(calls), direct


def run_finetune(model_dir, data, out):
    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(
        model_path=model_dir,
        max_steps=2,
        eval_steps=1,
        precision="32-true",
        gradient_accumulation_steps=2,
        devices=2,
        strategy="fsdp",
        output_dir=out,
        logging_steps=1,
        seed=3,
        data=DataOptions(
            dataset=data, max_seq_len=32, packing=True, eval_split_ratio=0.2, per_device_train_batch_size=2
        ),
    )
    with strict_cuda_collectives() as calls:
        result = finetune(cfg)
    return result.losses, result.eval_losses, dict(calls)


def run_both(finetune_args):
    """One worker: the Trainer's metrics, then (when its test is selected) the recipe in the same processes."""
    return run_metrics(), run_finetune(*finetune_args) if finetune_args else None


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """Both tests' runs in one launch of 2 ranks (start-up costs more than these runs); the recipe's only when
    its test is selected."""
    finetune_args = None
    if any(
        item.originalname == "test_finetune_loss_reductions_run_on_the_collective_device"
        for item in request.session.items
        if item.module is request.module
    ):
        from helpers.hf import build_model_folder, chat_records, write_jsonl

        root = tmp_path_factory.mktemp("finetune")
        records = chat_records(64)
        model_dir = build_model_folder(str(root / "tiny-llama"), records)
        finetune_args = (model_dir, write_jsonl(str(root / "chat.jsonl"), records), str(root / "out"))
    return shardwise.launch(run_both, finetune_args, devices=2)


def test_sync_dist_metrics_reduce_on_the_collective_device(two_ranks):
    (logged, calls, direct), other = [metrics for metrics, _ in two_ranks]
    assert calls.get("all_reduce", 0) >= 4, calls  # step and epoch reductions all went through the check
    assert logged["rank_mean"] == pytest.approx(1.5) and other[0]["rank_mean"] == pytest.approx(1.5)
    assert logged["rank_max"] == pytest.approx(2.0)
    assert logged["rank_sum"] == pytest.approx(3.0 * 2)  # 2 batches per rank, summed over both ranks
    assert logged["val_rank"] == pytest.approx((1 * 1 + 2 * 2) / 3)  # weighted by batch_size across ranks
    assert direct == {"number": 3.0, "int_mean": 0.5, "device": "cpu"}  # results come back where they started


@pytest.mark.slow
def test_finetune_loss_reductions_run_on_the_collective_device(two_ranks):
    ranks = [finetune for _, finetune in two_ranks]
    losses, eval_losses, calls = ranks[0]
    assert len(losses) == 2 and len(eval_losses) == 2, (losses, eval_losses)
    assert ranks[1][0] == losses  # every rank reports the same global mean
    assert calls.get("all_reduce", 0) >= 4, calls
