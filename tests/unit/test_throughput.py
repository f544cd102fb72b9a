"""Throughput, FLOPs, MFU, profiles and the out-of-memory report (issue 23 items 2 and 4).

One short run is shared by the logger, token-count and profile checks (a module-scoped fixture).
"""

import csv
import json
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from shardwise import Trainer, TrainModule, flops
from shardwise.callbacks import ThroughputMonitor
from shardwise.callbacks.throughput import count_tokens
from shardwise.loggers import CSVLogger, TensorBoardLogger
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.recipes.causal_lm import CausalLMModule

VOCAB, SEQ, REAL = 64, 16, 12  # every sequence: 12 real tokens, then 4 of padding


def _analytic_flops(model: GPT, batch: int, seq: int) -> int:
    """6N per token for the N weights of matrix products (the output head included), plus attention's
    scores and weighted sum: 4 x seq x n_embd per token per layer forward, twice that backward."""
    cfg = model.config
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    matmul += cfg.vocab_size * cfg.n_embd if cfg.tie_embeddings else 0  # the head reuses wte.weight
    return 6 * matmul * batch * seq + 12 * cfg.n_layer * seq * cfg.n_embd * batch * seq


@pytest.mark.parametrize(
    "shape",
    [
        dict(),  # GPT-2: LayerNorm, GELU, tied head, learned positions
        dict(norm="rmsnorm", mlp="swiglu", rope=True, bias=False, n_kv_head=2, tie_embeddings=False),  # Llama
    ],
)
def test_counted_flops_of_the_bundled_gpt_match_6n_plus_attention(shape):
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, **shape))
    ids = torch.randint(0, 256, (2, 64))

    def step():
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids.reshape(-1)).backward()

    counted = flops.count_flops(step)
    assert counted == pytest.approx(_analytic_flops(model, 2, 64), rel=0.02)


def test_peak_table_and_mfu():
    assert flops.lookup_peak("NVIDIA H100 80GB HBM3", "bf16") == ("H100 SXM", 989.5)
    assert flops.lookup_peak("NVIDIA H100 PCIe", "bf16")[0] == "H100 PCIe"
    assert flops.lookup_peak("NVIDIA H200", "tf32") == ("H200", 494.5)
    assert flops.lookup_peak("NVIDIA A100-SXM4-80GB", "fp32") == ("A100", 19.5)
    assert flops.lookup_peak("NVIDIA A10G", "bf16") == ("A10G", 125.0)
    assert flops.lookup_peak("NVIDIA L4", "fp16") == ("L4", 121.0)
    assert flops.lookup_peak("NVIDIA B200", "bf16") == ("B200", 2250.0)
    assert flops.lookup_peak("NVIDIA L40S", "bf16")[0] == "L40S"  # not an L4
    assert flops.number_kind("bf16-mixed") == "bf16" and flops.number_kind("16-true") == "fp16"
    assert flops.device_peak(torch.device("cpu"), "32-true")[0] is None  # the CPU: TFLOP/s, no MFU
    assert flops.device_peak(torch.device("cpu"), "32-true", 2.0)[0] == 2.0  # a given peak applies anywhere
    assert flops.mfu(49.475, 989.5) == pytest.approx(0.05) and flops.mfu(1.0, None) is None
    # The monitor's rates for an interval: 4 ranks, 8e6 tokens in 2 s, 1e8 FLOPs per token, peak 200.
    monitor = ThroughputMonitor(peak_tflops=200)
    monitor.peak, monitor.flops_per_unit = 200.0, 1e8
    rates = monitor.rates(tokens=8e6, samples=4000, seconds=2.0, world=4)
    assert rates["throughput/tokens_per_sec"] == 4e6 and rates["throughput/tokens_per_sec_per_device"] == 1e6
    assert rates["throughput/tflops_per_device"] == pytest.approx(100.0)
    assert rates["throughput/mfu"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="peak_tflops"):
        Trainer(accelerator="cpu", devices=1, peak_tflops=-1)
    with pytest.raises(ValueError, match="throughput=False"):
        Trainer(accelerator="cpu", devices=1, throughput=False, peak_tflops=100)
    with pytest.raises(ValueError, match="profile_steps"):
        Trainer(accelerator="cpu", devices=1, profile_steps=(3, 2))


def test_padding_is_not_counted_as_trained_tokens():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": mask, "labels": torch.ones(2, 4)}
    packed = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4)}
    recipe = CausalLMModule(types.SimpleNamespace(learning_rate=1e-3), folder=None, total_steps=1)
    assert int(recipe.count_tokens(padded)) == 5 and int(recipe.count_tokens(packed)) == 8
    plain = object()  # a module without count_tokens: the batch's mask, else its token ids, else none
    assert int(count_tokens(plain, padded)) == 5 and count_tokens(plain, packed) == 8
    assert count_tokens(plain, (torch.ones(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long))) == 15
    assert count_tokens(plain, (torch.randn(3, 5), torch.tensor([0, 1, 2]))) is None  # samples only


class _Padded(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:REAL] = 1
        return {"input_ids": torch.randint(0, VOCAB, (SEQ,)), "attention_mask": mask}


class _LM(TrainModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=32))

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch["input_ids"].reshape(-1))
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("throughput")
    csv_logger, tb_logger = CSVLogger(str(root)), TensorBoardLogger(str(root), name="tb")
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        log_every_n_steps=1,
        logger=[csv_logger, tb_logger],
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(root),
        peak_tflops=1.0,
        profile_steps=(2, 3),
    )
    trainer.fit(_LM(), DataLoader(_Padded(), batch_size=4))
    return trainer, root, csv_logger, tb_logger


def test_throughput_reaches_csv_and_tensorboard(run):
    trainer, root, csv_logger, tb_logger = run
    with open(csv_logger.metrics_file, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("throughput/samples")]
    keys = ["tokens_per_sec", "tokens_per_sec_per_device", "samples_per_sec", "tflops_per_device", "mfu"]
    rated = [r for r in rows if r["throughput/tokens_per_sec"]]
    assert [int(r["step"]) for r in rated] == [2, 3, 4]  # step 1 (FLOPs counted, warm-up) starts the clock
    assert all(float(r[f"throughput/{k}"]) > 0 for r in rated for k in keys)
    # Trained tokens: 4 sequences of 12 real tokens per step; the 4 padding positions of each do not count.
    assert [float(r["throughput/tokens"]) for r in rows] == [48.0 * s for s in (1, 2, 3, 4)]
    # FLOPs per position, counted over the first micro-batch: 6N + attention for a 1-layer GPT.
    model = trainer.module.model
    assert float(rows[0]["throughput/flops_per_token"]) == pytest.approx(_analytic_flops(model, 1, SEQ) / SEQ)
    mfu = float(rated[-1]["throughput/mfu"])  # against peak_tflops=1.0
    assert mfu == pytest.approx(float(rated[-1]["throughput/tflops_per_device"]))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb_logger.log_dir)
    events.Reload()
    assert {f"throughput/{k}" for k in keys} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("throughput/tokens_per_sec")] == [2, 3, 4]


def test_profile_traces_exist_and_hold_the_steps_ops(run):
    _, root, _, _ = run
    traces = sorted((root / "profiles").glob("trace_*.json"))
    assert [t.name for t in traces] == ["trace_rank0_steps2-3.json"]
    trace = json.loads(traces[0].read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names  # the step's matrix products, with their shapes
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])


class _OutOfMemory(_LM):
    def training_step(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


def test_out_of_memory_prints_what_the_rank_held_then_raises(capsys, tmp_path):
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path))  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 GiB"):
        trainer.fit(_OutOfMemory(), DataLoader(_Padded(), batch_size=4))
    err = capsys.readouterr().err
    assert err.count("Out of memory during step 1, batch_idx 0 on cpu") == 1
    params = sum(p.numel() * 4 for p in trainer.module.parameters())
    assert f"parameters {flops_fmt(params)}" in err and "gradients 0 B" in err
    assert "device_memory='auto'" in err and "strategy='fsdp'" in err


def flops_fmt(n):
    from shardwise.sysmem import format_bytes

    return format_bytes(n)


def test_a_users_own_torch_compile_still_compiles_after_the_counted_step():
    """The first micro-batch runs under the FLOP counter; a torch.compile'd function met there first must
    not be skipped by dynamo for the rest of the run (it is, without the counter's eager stance)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    class Compiled(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 8)
            self.forward_fn = torch.compile(lambda x: self.net(x).sin(), backend="eager")

        def training_step(self, batch, batch_idx):
            return self.forward_fn(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False)
    trainer.fit(Compiled(), DataLoader(torch.randn(12, 8), batch_size=4))
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    torch._dynamo.reset()
