"""Ulysses sequence parallel against one process: the attention primitive, the bundled GPT, the Trainer.

One 2-rank launch checks the primitives (outputs and input gradients of `ulysses_attention`, with and
without packed-document masks, and the gather whose backward is a reduce-scatter SUM) and the bundled
GPT with its sequence split in the model (logits, and parameter gradients averaged over the sp group
as FSDP does), all against the same computation on one process, within 1e-6.

Then the Trainer: a Llama-shaped GPT (rotary, grouped-query attention, untied head), fp32, 5 steps of
the same global batch, on one process and under FSDPStrategy(sp_size=2) (2 processes), dp 2 x sp 2 and
tp 2 x sp 2 (4 processes; the sequence split nested around tensor parallel's): a mean loss, and a
summed loss over packed documents normalised by `loss_weight` (global target tokens), with activation
checkpointing of Block. Per-step losses within 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import shardwise
from shardwise import Trainer, TrainModule
from shardwise.models import GPT, Block, gpt_config
from shardwise.strategies import FSDPStrategy
from shardwise.strategies.sequence_parallel import (
    apply_sequence_parallel,
    check_heads_divisible,
    document_ids_from_positions,
    gather_sequence,
    split_sequence,
    ulysses_attention,
)

B, HQ, HKV, S, D = 2, 4, 2, 8, 4
# Two packed documents per row (position ids restart at 0), at different boundaries.
POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
LLAMA = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)


def _qkv_and_grad():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(B, HQ, S, D, generator=g, dtype=torch.float64)


def _attention(q, k, v, grad_out, group, document_ids):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ulysses_attention(q, k, v, group, document_ids=document_ids)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


def _gpt(cfg_name):
    torch.manual_seed(0)
    return GPT(gpt_config(cfg_name, **LLAMA)).double()


def _gpt_run(model, position_ids):
    tokens = torch.arange(B * S).reshape(B, S) % LLAMA["vocab_size"]
    logits = model(tokens, position_ids)
    # A loss every sp rank computes on the full logits, as a training_step would.
    logits.pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker():
    dist.init_process_group("gloo")
    group, rank = dist.group.WORLD, dist.get_rank()
    q, k, v, grad_out = _qkv_and_grad()
    chunk = lambda t: split_sequence(t, group, dim=2)  # noqa: E731
    out = {}
    for key, docs in (("causal", None), ("documents", document_ids_from_positions(POSITIONS))):
        out[key] = _attention(chunk(q), chunk(k), chunk(v), chunk(grad_out), group, docs)
    try:
        ulysses_attention(torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4), group)
    except ValueError as e:
        out["odd_heads"] = str(e)
    # gather_sequence: a loss replicated over the group; each chunk's gradient is the sum over ranks.
    x = torch.arange(6.0, dtype=torch.float64).reshape(1, 2, 3).add(rank).requires_grad_(True)
    full = gather_sequence(x, group, dim=1)
    (full * torch.arange(12.0, dtype=torch.float64).reshape(1, 4, 3)).sum().backward()
    out["gather"] = (full.detach(), x.grad)
    for name in ("llama-tiny", "gpt-tiny"):  # rotary + GQA; learned positions + tied head
        model = _gpt(name)
        apply_sequence_parallel(model, group)
        logits, grads = _gpt_run(model, POSITIONS if name == "llama-tiny" else None)
        for g in grads.values():  # FSDP's mean over the dp x sp mesh
            dist.all_reduce(g)
            g /= dist.get_world_size()
        out[name] = (logits, grads)
    try:
        model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as e:
        out["odd_length"] = str(e)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_rank_launch():
    # One launch for the primitives and the 2-process Trainer runs: process start-up dominates.
    return shardwise.launch(_two_rank_worker, devices=2)


@pytest.fixture(scope="module")
def two_ranks(two_rank_launch):
    return [r["primitives"] for r in two_rank_launch]


@pytest.mark.parametrize("key", ["causal", "documents"])
def test_ulysses_attention_matches_one_process(two_ranks, key):
    q, k, v, grad_out = _qkv_and_grad()
    docs = document_ids_from_positions(POSITIONS) if key == "documents" else None
    expected = _attention(q, k, v, grad_out, None, docs)
    got = [torch.cat([r[key][i] for r in two_ranks], dim=2) for i in range(4)]
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=0, msg=f"{key}: {name}")


def test_document_mask_keeps_documents_apart():
    q, k, v, _ = _qkv_and_grad()
    docs = document_ids_from_positions(POSITIONS)
    packed = ulysses_attention(q, k, v, None, document_ids=docs)
    # Row 0's second document (positions 3..7) attended alone gives the same output.
    alone = ulysses_attention(q[:1, :, 3:], k[:1, :, 3:], v[:1, :, 3:], None)
    torch.testing.assert_close(packed[:1, :, 3:], alone)
    assert not torch.allclose(packed, ulysses_attention(q, k, v, None))


def test_gather_sequence_backward_is_a_reduce_scatter_sum(two_ranks):
    weights = torch.arange(12.0, dtype=torch.float64).reshape(1, 4, 3)
    for rank, r in enumerate(two_ranks):
        full, grad = r["gather"]
        expected = torch.cat([torch.arange(6.0).reshape(1, 2, 3) + i for i in range(2)], dim=1)
        torch.testing.assert_close(full, expected.double())
        # Both ranks computed the same loss: the chunk gets 2 x its weights, not 1 x (a slice would).
        torch.testing.assert_close(grad, 2 * weights[:, 2 * rank : 2 * rank + 2])


@pytest.mark.parametrize("name", ["llama-tiny", "gpt-tiny"])
def test_gpt_split_in_the_model_matches_one_process(two_ranks, name):
    logits, grads = _gpt_run(_gpt(name), POSITIONS if name == "llama-tiny" else None)
    for r in two_ranks:
        got_logits, got_grads = r[name]
        torch.testing.assert_close(got_logits, logits, atol=1e-6, rtol=0)
        for n, g in grads.items():
            torch.testing.assert_close(got_grads[n], g, atol=1e-6, rtol=0, msg=n)


def test_head_counts_the_degree_does_not_divide_are_refused(two_ranks):
    assert "sp_size=2 must divide the number of attention heads (3)" in two_ranks[0]["odd_heads"]
    with pytest.raises(ValueError, match=r"Choose sp_size among \[1, 2\]"):
        check_heads_divisible(4, 2, 4)


def test_a_sequence_length_the_degree_does_not_divide_is_refused(two_ranks):
    assert "sequence length 7 is not divisible by the sequence parallel degree sp_size=2" in two_ranks[0]["odd_length"]


def test_a_model_without_an_attention_hook_is_refused():
    with pytest.raises(ValueError, match="bundled shardwise.models.GPT .* Hugging Face causal LM"):
        apply_sequence_parallel(torch.nn.Linear(2, 2), None)


def test_a_model_with_its_own_hook_is_switched_on_by_it():
    """The engine asks the model: the outermost module whose class defines enable_sequence_parallel gets the
    sp mesh, and a bundled GPT inside it is left to that hook."""

    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.group = _gpt("llama-tiny"), None

        def enable_sequence_parallel(self, group) -> None:
            self.group = group

    own, mesh = Own(), object()
    apply_sequence_parallel(torch.nn.Sequential(own), mesh)
    assert own.group is mesh and own.inner.sp_group is None


def test_packed_gpt_does_not_attend_across_documents():
    model = _gpt("llama-tiny")
    tokens = torch.arange(B * S).reshape(B, S) % LLAMA["vocab_size"]
    packed = model(tokens, POSITIONS)
    # Row 0 holds documents [0:3] and [3:8]; each alone, from position 0, gives the same logits.
    torch.testing.assert_close(packed[:1, :3], model(tokens[:1, :3]))
    torch.testing.assert_close(packed[:1, 3:], model(tokens[:1, 3:]))
    assert not torch.allclose(packed[:1, 3:], model(tokens[:1])[:, 3:])


def test_without_a_group_it_is_plain_causal_attention():
    q, k, v, _ = _qkv_and_grad()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ulysses_attention(q, k, v, None), ref)


# ------------------------------------------------------------------ the Trainer, 1 process vs sp
STEPS, GLOBAL_BATCH, SEQ = 5, 4, 16
# 8 query and 4 key/value heads: whole heads for every rank of tp 2 x sp 2.
TRAIN_LLAMA = dict(vocab_size=64, block_size=SEQ, n_layer=2, n_head=8, n_kv_head=4, n_embd=32)


def _packed_data(n: int = GLOBAL_BATCH * STEPS):
    """Rows of SEQ + 1 tokens counting upwards, each holding 2 or 3 packed documents (position ids restart)."""
    g = torch.Generator().manual_seed(0)
    tokens = (torch.randint(0, 64, (n, 1), generator=g) + torch.arange(SEQ + 1)) % 64
    positions = torch.empty_like(tokens)
    for row in positions:
        n_cuts = int(torch.randint(1, 3, (1,), generator=g))
        starts = [0, *sorted((torch.randperm(SEQ - 1, generator=g)[:n_cuts] + 1).tolist())]
        for a, b in zip(starts, [*starts[1:], SEQ + 1]):
            row[a:b] = torch.arange(b - a)
    return torch.utils.data.TensorDataset(tokens, positions)


class MeanLlama(TrainModule):
    """The bundled GPT, Llama-shaped, on unpacked rows: the mean loss over every next token."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(gpt_config("llama-tiny", **TRAIN_LLAMA))

    def training_step(self, batch):
        tokens, _ = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)


class PackedLlama(MeanLlama):
    """Packed documents (position ids restart at 0): the loss SUMMED over target tokens (a document's first
    token is not one), normalised by the Trainer over the global count that `loss_weight` gives."""

    @staticmethod
    def _targets(batch):
        tokens, positions = batch
        return tokens[:, 1:].masked_fill(positions[:, 1:] == 0, -100)

    def loss_weight(self, batch):
        return (self._targets(batch) != -100).sum()

    def training_step(self, batch):
        tokens, positions = batch
        logits = self.model(tokens[:, :-1], positions[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), self._targets(batch).flatten(), reduction="sum")


class _Losses:
    """Per step: the Trainer's global mean loss (weighted modules), or the loss averaged over ranks."""

    def __init__(self) -> None:
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.weighting is not None:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))
        else:
            self.losses.append(float(trainer.strategy.reduce(outputs.detach(), "mean")))


def _fit(packed: bool, world: int, sp: int = 1, tp: int = 1, ac: bool = False):
    shardwise.seed_everything(1234)
    if world == 1:
        strategy = "single"
    else:
        checkpointed = {Block} if ac else None
        strategy = FSDPStrategy(
            auto_wrap_policy={Block}, activation_checkpointing_policy=checkpointed, sp_size=sp, tp_size=tp
        )
    recorder = _Losses()
    trainer = Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[recorder],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
    )
    # The same global batch: ranks of an sp / tp group read the same rows, so each loader holds GLOBAL_BATCH / dp.
    loader = torch.utils.data.DataLoader(_packed_data(), batch_size=GLOBAL_BATCH * sp * tp // world)
    trainer.fit(PackedLlama() if packed else MeanLlama(), loader)
    if world > 1:
        _check_layout_against_device_mesh(trainer.strategy)
    return recorder.losses


def _check_layout_against_device_mesh(strategy) -> None:
    """The pure rank answers (strategies/mesh.ParallelMesh) are the groups the real gloo DeviceMesh made."""
    import torch.distributed as dist

    layout, rank, world = strategy.layout, dist.get_rank(), strategy.world_mesh
    fsdp_ranks = dist.get_process_group_ranks(strategy.mesh.get_group())
    assert fsdp_ranks == layout.fsdp_group(rank), (rank, fsdp_ranks, layout)
    assert world.mesh.flatten().tolist() == list(range(layout.world_size))
    assert world["sp", "tp"].mesh.flatten().tolist() == layout.batch_group(rank), (rank, layout)
    dp_rank = world.get_local_rank("dp_replicate") * layout.dims.dp_shard + world.get_local_rank("dp_shard")
    assert strategy.data_parallel_rank == dp_rank == layout.data_parallel_rank(rank)


def _fit_many(configs):
    return {key: _fit(**c) for key, c in configs.items()}


TRAINER_RUNS = {
    1: {"mean": dict(packed=False, world=1), "packed": dict(packed=True, world=1)},
    2: {"mean": dict(packed=False, world=2, sp=2), "packed": dict(packed=True, world=2, sp=2, ac=True)},
    4: {"packed": dict(packed=True, world=4, sp=2, ac=True), "tp x sp": dict(packed=True, world=4, sp=2, tp=2)},
}


def _two_rank_worker():
    return {"primitives": _worker(), "trainer": _fit_many(TRAINER_RUNS[2]), "data": _data_worker()}


@pytest.fixture(scope="module")
def trainer_losses(two_rank_launch):
    return {
        1: _fit_many(TRAINER_RUNS[1]),  # in this process: one launch fewer
        2: two_rank_launch[0]["trainer"],
        4: shardwise.launch(_fit_many, TRAINER_RUNS[4], devices=4)[0],
    }


@pytest.mark.parametrize("world,key", [(2, "mean"), (2, "packed"), (4, "packed"), (4, "tp x sp")])
def test_trainer_with_sequence_parallel_matches_one_process(trainer_losses, world, key):
    reference, got = trainer_losses[1][key.replace("tp x sp", "packed")], trainer_losses[world][key]
    assert len(reference) == len(got) == STEPS
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    assert rel < 1e-5, (world, key, got, reference)
    assert reference[-1] < reference[0]


# ------------------------------------------------------------------ the data an sp group reads
# Under sp (and tp) the ranks of a group each run a share of ONE sample: the distributed sampler splits by
# data-parallel rank, and the Trainer checks on each epoch's first batch that the group holds the same
# batch. The planted bug: a user's own DistributedSampler split by global rank (what every DDP script does)
# gives the two sp ranks different samples; the run must stop before its first step, naming the ranks and
# the fix. The control (a plain DataLoader) trains, with one sampler replica. (Shares the 2-rank launch.)
DATA_CONFIG = dict(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=16)


class TinyLM(TrainModule):
    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = GPT(gpt_config("llama-tiny", **DATA_CONFIG))

    def training_step(self, batch):
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data_fit(loader_for):
    dataset = TensorDataset(torch.arange(8 * 9).reshape(8, 9) % 32)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, sp_size=2),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), loader_for(dataset))
    return trainer


def _data_worker():
    out = {}
    plain = _data_fit(lambda ds: DataLoader(ds, batch_size=2))
    sampler = plain.train_dataloader.sampler
    out["plain"] = (plain.global_step, sampler.num_replicas, plain.strategy.data_parallel_size)
    by_global_rank = lambda ds: DataLoader(  # noqa: E731
        ds, batch_size=2, sampler=DistributedSampler(ds, num_replicas=2, rank=dist.get_rank(), shuffle=False)
    )
    try:
        _data_fit(by_global_rank)
        out["planted"] = None
    except ValueError as error:
        out["planted"] = str(error)
    return out


def test_an_sp_group_reads_one_sample_and_a_sampler_split_by_global_rank_is_stopped(two_rank_launch):
    for result in (r["data"] for r in two_rank_launch):
        assert result["plain"] == (2, 1, 1)  # trained; the sampler has one replica: both ranks read every sample
        message = result["planted"]
        assert message is not None, "a sampler split by global rank trained silently under sp"
        assert "Ranks [0, 1] are one sequence/tensor-parallel group" in message
        assert "hold different batches" in message and "strategy.data_parallel_rank" in message
