"""`shardwise plan` from the command line, and the planner inside Trainer.fit.

The CLI tests run `shardwise.cli.main` in-process on the tiny presets with
`--workers 1`; the Trainer tests fit a tiny model for one step on CPU with a
device memory that is (or is not) enough.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from shardwise import FSDPStrategy, Trainer, TrainModule
from shardwise.cli import main as shardwise_main
from shardwise.models import GPT, Block, gpt_config


def test_cli_table_json_and_plot(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code = shardwise_main(
        [
            "plan",
            "--model",
            "gpt-tiny",
            "--devices",
            "2",
            "--device-memory",
            "2GiB",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--only",
            "ddp,fsdp_ac,deepspeed_stage_3",
            "--workers",
            "1",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "FSDP FULL_SHARD + AC" in out and "ZeRO-3" in out and "Recommended" in out
    assert "reserved = allocated + largest transient block" in out and "assumes: optimizer: adamw (foreach)" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"

    assert (
        shardwise_main(
            [
                "plan",
                "--model",
                "gpt-tiny",
                "--devices",
                "2",
                "--device_memory=2GiB",
                "--json",
                "--only",
                "ddp",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    row = data["estimates"][0]
    assert data["fits_uses"].startswith("reserved") and row["fits"] is True
    assert set(row["breakdown"]) == {"parameters", "gradients", "optimizer", "activations", "temporary"}
    assert data["recommended"]["candidate"]["name"] == "ddp"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama-9"], "Unknown model preset 'llama-9'. Presets: "),
        (["--model", "gpt-tiny", "--device-memory", "lots"], "is not a memory size"),
        (["--model", "gpt-tiny", "--devices", "8", "--only", "fsdp_hybrid_shard"], "HYBRID_SHARD"),
        (
            ["--model", "gpt-tiny", "--only", "fsdp_quarter_shard"],
            "Unknown strategy 'fsdp_quarter_shard'. Valid names: single, ddp",
        ),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert shardwise_main(["plan", *argv, "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_rejects_a_config_json_that_is_not_a_causal_lm(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}))
    assert shardwise_main(["plan", "--model", str(cfg)]) == 2
    assert "not a causal language model" in capsys.readouterr().err


class TinyLM(TrainModule):
    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):
        if self.model is None:
            self.model = GPT(gpt_config("gpt-tiny"))

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader():
    return DataLoader(TensorDataset(torch.randint(0, 256, (16, 33))), batch_size=4)


def _fit(**kwargs):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(TinyLM(), _loader())
    return trainer


def _fit_warning(record) -> str:
    return next(str(w.message) for w in record if "will not fit" in str(w.message))


def test_trainer_warns_before_the_first_step_with_the_smallest_change_that_fits():
    # Planned on CPU: FULL_SHARD needs 2.9 MiB at micro-batch 4, 2.8 at 2x2, 2.5 at 1x4 (DDP 1x4: 2.2). In 3 MiB
    # (2.7 usable with the default 10% headroom) the nearest configuration that fits keeps the user's strategy
    # and only re-batches (found on the user's own strategy object's trace: no other strategy is planned).
    with pytest.warns(UserWarning, match="will not fit") as record:
        trainer = _fit(strategy=FSDPStrategy(auto_wrap_policy={Block}), device_memory="3MiB")
    assert (
        "Smallest change that fits: the same strategy with DataLoader(batch_size=1) and accumulate_grad_batches=4."
    ) in _fit_warning(record)
    assert trainer.global_step == 1  # a warning, not an error: the user may know better


def test_trainer_warns_that_nothing_fits_with_the_smallest_configuration():
    with pytest.warns(UserWarning, match="will not fit") as record:
        _fit(strategy=FSDPStrategy(auto_wrap_policy={Block}), device_memory="2MiB")
    message = _fit_warning(record)
    assert "Nothing fits on the device: the smallest is DDP, mb 1x4 at 2.2 MiB reserved per device" in message
    assert "usable: 1.8 MiB (90% of 2.0 MiB)" in message
    assert "Smallest change" not in message


def _count_fit_warnings_on_two_ranks() -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = Trainer(
            accelerator="cpu",
            devices=2,
            strategy=FSDPStrategy(auto_wrap_policy={Block}),
            device_memory="2MiB",
            max_steps=1,
            enable_progress_bar=False,
            logger=False,
            enable_checkpointing=False,
        )
        trainer.fit(TinyLM(), _loader())
    return sum("will not fit" in str(w.message) for w in caught)


def test_the_fit_warning_is_planned_and_said_once_across_ranks():
    import shardwise

    assert shardwise.launch(_count_fit_warnings_on_two_ranks, devices=2) == [1, 0]


def test_trainer_is_silent_when_the_run_fits_or_memory_is_unknown():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _fit(strategy=FSDPStrategy(auto_wrap_policy={Block}), device_memory="4GiB")
        _fit(strategy=FSDPStrategy(auto_wrap_policy={Block}))


def test_auto_strategy_consults_the_planner_and_says_why(capsys):
    trainer = _fit(strategy="auto", device_memory="4GiB")
    out = capsys.readouterr().out
    assert "strategy='auto' chose" in out and "fastest that fits" in out
    assert trainer.global_step == 1


def test_trainer_rejects_an_unparsable_device_memory():
    with pytest.raises(ValueError, match="device_memory='eighty'"):
        _fit(strategy="auto", device_memory="eighty")


@pytest.mark.slow
class _RecordingLM(TinyLM):
    def __init__(self):
        super().__init__()
        self.seen = []

    def training_step(self, batch):
        self.seen.append(batch[0].shape[0])
        return super().training_step(batch)


def _auto_trainer_at_3_2_mb() -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        strategy="auto",
        device_memory=3_200_000,
    )


def test_auto_strategy_runs_the_chosen_micro_batch_split(capsys):
    """16 sequences per step do not fit at once in 3.2 MB: the plan splits them, and the run uses that split."""
    module = _RecordingLM()
    trainer = _auto_trainer_at_3_2_mb()
    trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 256, (64, 33))), batch_size=16))
    out = capsys.readouterr().out
    chosen = out.split("chose ", 1)[1]
    micro, acc = (int(x) for x in chosen.split(", mb ", 1)[1].split(":", 1)[0].split("x"))
    assert micro * acc == 16 and acc > 1, out
    assert "re-batched the training DataLoader from batch_size=16" in out
    assert trainer.accumulate_grad_batches == acc and module.seen == [micro] * acc


def test_auto_strategy_refuses_a_loader_it_cannot_rebatch():
    from torch.utils.data import BatchSampler, SequentialSampler

    class Pairs(BatchSampler):  # a custom batch sampler decides batches itself
        pass

    data = TensorDataset(torch.randint(0, 256, (64, 33)))
    loader = DataLoader(data, batch_sampler=Pairs(SequentialSampler(data), batch_size=16, drop_last=False))
    trainer = _auto_trainer_at_3_2_mb()
    with pytest.raises(
        ValueError, match=r"DataLoader\(\.\.\., batch_size=\d+\) and Trainer\(accumulate_grad_batches=\d+\)"
    ):
        trainer.fit(_RecordingLM(), loader)


@pytest.mark.xfail(
    torch.version.cuda is not None,
    strict=True,
    reason="Known bug on CUDA builds of torch (2.10, 2.11, 2.13+cu130; not the CPU build): after the in-process "
    "trace's backward under FakeTensorMode, autograd refuses to run in forked children, so the plan under "
    "track_memory falls back to the analytic estimate (with a note). Found by .ci/torch_matrix.sh.",
)
def test_a_module_defined_in_a_script_is_planned_in_workers_and_under_track_memory(tmp_path):
    """The README's example with the module class in the user's own script (pickled by path it failed)."""
    import subprocess
    import sys

    script = tmp_path / "user_script.py"
    script.write_text("""
import torch, torch.nn.functional as F, shardwise
from shardwise import TrainModule
from shardwise.models import GPT, gpt_config

class MyModule(TrainModule):
    def __init__(self):
        super().__init__(); self.model = None
    def configure_model(self):
        if self.model is None:
            self.model = GPT(gpt_config("gpt-tiny"))
    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

batch = (torch.randint(0, 256, (4, 33)),)
kw = dict(example_batch=batch, batch_size=4, devices=2, accelerator="cpu", candidates=["ddp", "fsdp"])
a = shardwise.plan(MyModule(), workers=2, **kw)
b = shardwise.plan(MyModule(), workers=1, **kw)
with shardwise.track_memory():
    c = shardwise.plan(MyModule(), workers=1, **kw)
rows = [[e.allocated for e in p.estimates] for p in (a, b, c)]
assert rows[0] == rows[1] == rows[2], rows
assert all(e.method.startswith("traced") for e in c.estimates), [e.method for e in c.estimates]
print("OK")
""")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
