"""Ulysses sequence parallel against one process: the attention primitive, the bundled GPT, the Trainer.

One 2-rank launch checks the primitives (outputs and input gradients of `ulysses_attention`, with and
without packed-document masks, and the gather whose backward is a reduce-scatter SUM) and the bundled
GPT with its sequence split in the model (logits, and parameter gradients averaged over the sp group
as FSDP does), all against the same computation on one process, within 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.models import GPT, gpt_config
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
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return shardwise.launch(_worker, devices=2)


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


def test_a_model_without_an_attention_hook_is_refused():
    with pytest.raises(ValueError, match="bundled shardwise.models.GPT .* Hugging Face causal LM"):
        apply_sequence_parallel(torch.nn.Linear(2, 2), None)


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
