"""Every checkpoint format resumes under every strategy with every common optimizer, values exact.

Written by 2 processes for each optimizer (SGD, SGD + momentum, Adam): DDP
("full" file), FSDP with state_dict_type "sharded" (DCP) and "full" (one
file gathered to rank 0). Each is resumed with fit(ckpt_path=...) under DDP
and FSDP on 2 processes and on a single device in the test process, and the
model and optimizer state must equal what was saved. Plain SGD has no
per-parameter tensors, which used to break loading a full file under FSDP
("Expected device to be set"). A DeepSpeed checkpoint records checksums of
the engine's files, is refused by a non-DeepSpeed strategy with the command
that converts it, and an engine file that would run code is refused before
DeepSpeed unpickles it. Process launches are expensive, so each launch runs
many checks.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from shardwise import FSDPStrategy, Trainer

from helpers.checkpoints import Net, assert_same_state, full_state, loader

FORMATS = ("ddp.ckpt", "fsdp-sharded.ckpt", "fsdp-full.ckpt")
OPTIMIZERS = ("sgd", "momentum", "adam")
STEPS = 2


def _trainer(strategy, root, devices, max_steps=STEPS):
    strategy = {"fsdp": FSDPStrategy(), "fsdp_full": FSDPStrategy(state_dict_type="full")}.get(strategy, strategy)
    return Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )


def write_and_resume(root):
    """2 processes: per optimizer, save in every format, then resume each under DDP and FSDP."""
    saved, resumed = {}, {}
    for opt in OPTIMIZERS:
        shardwise.seed_everything(0)
        trainer = _trainer("ddp", root, 2)
        trainer.fit(Net(opt), loader())
        trainer.save_checkpoint(os.path.join(root, opt, "ddp.ckpt"))
        saved[(opt, "ddp.ckpt")] = full_state(trainer)
        shardwise.seed_everything(0)
        trainer = _trainer("fsdp", root, 2)
        trainer.fit(Net(opt), loader())
        trainer.save_checkpoint(os.path.join(root, opt, "fsdp-sharded.ckpt"))
        trainer.strategy.state_dict_type = "full"  # the same run, written the other way
        trainer.save_checkpoint(os.path.join(root, opt, "fsdp-full.ckpt"))
        saved[(opt, "fsdp-sharded.ckpt")] = saved[(opt, "fsdp-full.ckpt")] = full_state(trainer)
    resumed.update(resume(root, ["ddp", "fsdp", "fsdp_full"], 2))
    return saved, resumed


def resume(root, strategies, devices):
    out = {}
    for opt in OPTIMIZERS:
        for fmt in FORMATS:
            for strategy in strategies:
                if strategy == "fsdp_full" and fmt != "fsdp-full.ckpt":
                    continue  # loading does not depend on the strategy's own save format: one case suffices
                shardwise.seed_everything(123)  # nothing may come from the seed
                trainer = _trainer(strategy, root, devices)
                trainer.fit(Net(opt), loader(), ckpt_path=os.path.join(root, opt, fmt))
                out[(opt, fmt, f"{strategy} x{devices}")] = full_state(trainer)
                if devices == 1 and dist.is_initialized():
                    dist.destroy_process_group()
    return out


@pytest.fixture(autouse=True)
def _no_leftover_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def two_rank_parts(parts, root):
    """One launch of 2 ranks for the selected tests below (start-up, DeepSpeed's most of all, costs more than
    these runs): the formats first, DeepSpeed's engine last."""
    out = {}
    if "formats" in parts:
        out["formats"] = write_and_resume(os.path.join(root, "formats"))
    if "deepspeed" in parts:
        out["deepspeed"] = deepspeed_save(os.path.join(root, "deepspeed"))
    return out


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    by_test = {
        "test_every_format_resumes_under_every_strategy_and_optimizer": "formats",
        "test_deepspeed_checkpoint_checksums_refusals_and_conversion": "deepspeed",
    }
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    parts = sorted(part for test, part in by_test.items() if test in selected)
    root = tmp_path_factory.mktemp("formats-and-deepspeed")
    return root, shardwise.launch(two_rank_parts, parts, str(root), devices=2)[0]


def test_every_format_resumes_under_every_strategy_and_optimizer(two_ranks):
    root = str(two_ranks[0] / "formats")
    saved, resumed = two_ranks[1]["formats"]
    resumed.update(resume(root, ["single", "fsdp"], 1))  # this process: one device
    assert len(resumed) == 3 * (3 * 2 + 1) + 3 * 3 * 2  # 39 resumes
    for (opt, fmt, strategy), got in resumed.items():
        assert_same_state(saved[(opt, fmt)], got, (opt, fmt, strategy))
    assert saved[("momentum", "ddp.ckpt")]["optim"] and not saved[("sgd", "ddp.ckpt")]["optim"]


# ------------------------------------------------------------------ DeepSpeed
class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def deepspeed_save(root):
    from shardwise.strategies.deepspeed import DeepSpeedStrategy

    shardwise.seed_everything(0)
    trainer = _trainer(DeepSpeedStrategy(stage=2), root, 2)
    trainer.fit(Net("adam"), loader())
    trainer.save_checkpoint(os.path.join(root, "ds.ckpt"))
    return trainer.global_step


@pytest.mark.slow  # DeepSpeed's engine start-up on 2 processes: ~35 s on 2 cores
def test_deepspeed_checkpoint_checksums_refusals_and_conversion(two_ranks, capsys):
    from shardwise.checkpoint import layout
    from shardwise.checkpoint.errors import CheckpointFormatError, ChecksumMismatchError, UnsafeCheckpointError
    from shardwise.checkpoint.reader import open_checkpoint
    from shardwise.cli import main as cli_main

    root = str(two_ranks[0] / "deepspeed")
    assert two_ranks[1]["deepspeed"] == STEPS
    ckpt = os.path.join(root, "ds.ckpt")
    sums = layout.read_manifest(ckpt)["checksums"]
    engine = sorted(f for f in sums if f.startswith("engine/"))
    assert len(engine) >= 3 and "trainer_state.pt" in sums and "deepspeed.json" in sums
    # A non-DeepSpeed strategy's loader says how to convert instead of failing inside torch. (fit() itself
    # stops one step earlier, at the optimizer-name check in checkpoint/training.py.)
    from shardwise.checkpoint.formats import load_model_and_optimizers

    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointFormatError, match="shardwise convert"):
        load_model_and_optimizers(model, [torch.optim.Adam(model.parameters())], ckpt, "deepspeed")
    assert cli_main(["convert", ckpt, os.path.join(root, "w.safetensors")]) == 0
    # An engine file replaced by a pickle that runs a command: refused, checksum first, then by the scan.
    victim = os.path.join(ckpt, engine[0])
    marker = os.path.join(root, "PWNED")
    with open(victim, "wb") as fh:
        pickle.dump({"x": Evil(marker)}, fh)
    with pytest.raises(ChecksumMismatchError):
        open_checkpoint(ckpt).read(["net.0.weight"])
    os.environ["SHARDWISE_VERIFY_CHECKSUMS"] = "0"
    try:
        with pytest.raises(UnsafeCheckpointError, match="posix.system"):
            open_checkpoint(ckpt).read(["net.0.weight"])
        assert cli_main(["convert", ckpt, os.path.join(root, "w2.safetensors")]) == 1
    finally:
        del os.environ["SHARDWISE_VERIFY_CHECKSUMS"]
    assert not os.path.exists(marker)
