"""FSDP gradient accumulation keeps gradients sharded (issue 15), measured as tracked tensor memory.

Two processes, SGD (no optimizer state to hide behind), the seed
Transformer with every layer and the embedding as FSDP units. The default
`accumulation_sync="reduce_scatter"` reduce-scatters every micro-batch, so
accumulation 2's peak may exceed accumulation 1's only by what a second
micro-batch can add -- less than one micro-batch's activations. The old
behaviour (`accumulation_sync="none"`, FSDP1's no_sync) keeps every unit's
unsharded gradient until the last micro-batch: the test checks that it still
costs that much (so the first check would fail on it) and that both modes,
and the replicate-dimension path (a (2, 1) mesh: reduce-scatter now,
all-reduce deferred), accumulate the same gradients.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import shardwise
from shardwise import FSDPStrategy, Trainer
from shardwise.demos import LanguageModel, PythonDocsText
from shardwise.distributed import ops
from shardwise.memory import active_tracker

from helpers.lm import LAYERS, PeakOfSteps

SIZES = dict(nlayers=6, nhid=1024, ninp=128, nhead=4)  # ~4.2M parameters with the bundled vocabulary
POLICY = LAYERS | {nn.Embedding}


class SGDLanguageModel(LanguageModel):
    """SGD, and the activation bytes alive at the end of each micro-batch's forward (its saved activations)."""

    micro_batch_activations = 0

    def training_step(self, batch):
        loss = super().training_step(batch)
        tracker = active_tracker()
        if tracker is not None:
            self.micro_batch_activations = max(self.micro_batch_activations, tracker.current_breakdown["activations"])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _peak(accumulate, sync, batch_size=2, block_size=32):
    data = PythonDocsText(block_size=block_size)
    shardwise.seed_everything(0)
    probe = PeakOfSteps()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=2,
        accumulate_grad_batches=accumulate,
        strategy=FSDPStrategy(auto_wrap_policy=POLICY, accumulation_sync=sync),
        callbacks=[probe],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    module = SGDLanguageModel(data.vocab_size, **SIZES)
    trainer.fit(module, DataLoader(data, batch_size=batch_size))
    params = sum(p.numel() for p in module.model.parameters())  # DTensors: global count
    return probe.peak, probe.breakdown, params, module.micro_batch_activations


def _accumulated_grads(sharding, sync, mesh=None):
    """Local gradient shards after two micro-batches without a step (flattened, in parameter order)."""
    data = PythonDocsText(block_size=16)
    shardwise.seed_everything(0)
    strategy = FSDPStrategy(
        auto_wrap_policy=LAYERS, sharding_strategy=sharding, device_mesh=mesh, accumulation_sync=sync
    )
    strategy.setup_environment()
    with strategy.module_init_context():
        module = LanguageModel(data.vocab_size, nlayers=2, nhid=64, ninp=32, nhead=2)
        module.configure_model()
    model = strategy.setup_module(module.model)
    module.model = model
    batches = [data[i] for i in range(4 * ops.rank(), 4 * ops.rank() + 4)]
    first = {}  # collectives FSDP ran during the first (non-final) micro-batch
    for k, half in enumerate((batches[:2], batches[2:])):
        batch = tuple(torch.stack(t) for t in zip(*half))
        with _counting(first if k == 0 else {}), strategy.no_backward_sync(model, enabled=k == 0):
            strategy.backward(module._loss(batch) / 2, model)
    return torch.cat([p.grad.to_local().flatten() for p in model.parameters()]), first


# FSDP2's reduce-scatter: dist.reduce_scatter_single from torch 2.13, dist.reduce_scatter_tensor before it.
REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


@contextlib.contextmanager
def _counting(counts):
    originals = {name: getattr(dist, name) for name in ("all_reduce", REDUCE_SCATTER)}

    def counted(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def measure():
    peaks = {
        key: _peak(acc, sync)
        for key, acc, sync in (("acc1", 1, "reduce_scatter"), ("acc2", 2, "reduce_scatter"), ("acc2_none", 2, "none"))
    }
    grads = {
        key: _accumulated_grads(*args)
        for key, args in (
            ("full_rs", ("FULL_SHARD", "reduce_scatter")),
            ("full_none", ("FULL_SHARD", "none")),
            ("replicate_rs", ("HYBRID_SHARD", "reduce_scatter", (2, 1))),
            ("replicate_none", ("HYBRID_SHARD", "none", (2, 1))),
        )
    }
    return peaks, {k: (v[0].tolist(), v[1]) for k, v in grads.items()}


@pytest.fixture(scope="module")
def measured():
    return shardwise.launch(measure, devices=2)[0]


def test_accumulation_keeps_gradients_sharded(measured):
    peaks = measured[0]
    acc1, acc2 = peaks["acc1"], peaks["acc2"]
    activations = acc1[3]  # saved activations of one micro-batch, at the end of its forward
    assert activations > 0
    # A second micro-batch adds at most what lives during its own pass, never a full gradient.
    assert acc2[0] - acc1[0] <= activations, {k: (v[0], v[3], v[1]) for k, v in peaks.items()}


def test_no_sync_mode_costs_the_unsharded_gradient(measured):
    peaks = measured[0]
    acc1, none = peaks["acc1"], peaks["acc2_none"]
    shard_grad = acc1[2] * 4 / 2  # fp32 gradient shard of 2 ranks
    # The old default holds each unit's whole gradient instead of its half: about one more shard,
    # which is more than a micro-batch's activations here (so the check above has teeth).
    assert none[0] - acc1[0] >= 0.8 * shard_grad, (acc1[0], none[0], shard_grad)
    assert none[0] - acc1[0] > acc1[3], (acc1[0], none[0], acc1[3])


@pytest.mark.parametrize("layout", ["full", "replicate"])
def test_both_modes_accumulate_the_same_gradients(measured, layout):
    grads = measured[1]
    rs, none = torch.tensor(grads[f"{layout}_rs"][0]), torch.tensor(grads[f"{layout}_none"][0])
    assert rs.abs().sum() > 0
    torch.testing.assert_close(rs, none, rtol=1e-5, atol=1e-7)


def test_first_micro_batch_reduce_scatters_and_defers_only_the_replica_all_reduce(measured):
    first = {k: v[1] for k, v in measured[1].items()}
    assert first["full_rs"].get(REDUCE_SCATTER, 0) > 0, first  # sharded now, not at the end
    assert first["full_none"] == {}, first  # the opt-in mode communicates nothing
    # (2, 1) mesh: the shard group has one rank (no reduce-scatter call); the all-reduce waits.
    assert first["replicate_rs"].get("all_reduce", 0) == 0 and first["replicate_none"] == {}, first


def test_unknown_accumulation_sync_is_refused():
    with pytest.raises(ValueError, match="accumulation_sync"):
        FSDPStrategy(accumulation_sync="no_sync")


if __name__ == "__main__":  # python tests/distributed/test_fsdp_accumulation.py: print the figures
    from shardwise.memory import format_bytes

    peaks, _ = shardwise.launch(measure, devices=2)[0]
    print(f"parameters: {next(iter(peaks.values()))[2]:,}")
    for name, (peak, breakdown, _, acts) in peaks.items():
        print(
            f"{name:10s} {format_bytes(peak):>10s} (one micro-batch's activations {format_bytes(acts)})  "
            + " ".join(f"{k}={format_bytes(v)}" for k, v in breakdown.items())
        )
