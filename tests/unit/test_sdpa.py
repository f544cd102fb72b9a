"""SDPA's kernel choice on CUDA, predicted; the planner counting seq x seq where math runs (issue 36, item 5).

On a GPU, grouped key/value heads (enable_gqa) with any mask, or in fp32,
leave flash and the memory-efficient kernel both unable to take the call, and
SDPA silently runs the math kernel: a seq x seq matrix per head, kept for the
backward. sdpa.cuda_backend is torch's rule (cuda/sdp_utils.cpp); the planner's
trace (plan/kernels.target_attention) must keep that matrix for such calls and
only for them, and the models' attention (sdpa.attention) must repeat the k/v
heads where that keeps the call off math. Saved tensors are read with
autograd's saved-tensor hooks on small CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwise import sdpa
from shardwise.plan.kernels import cuda_choice, target_attention

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "dtype, mask, gqa, head_dim, capability, expected",
    [
        (BF16, False, True, 128, (9, 0), sdpa.FLASH),  # flash reads grouped heads in place
        (BF16, True, True, 128, (9, 0), sdpa.MATH),  # a mask: no flash; grouped heads: no efficient
        (BF16, True, False, 128, (9, 0), sdpa.EFFICIENT),  # the same call with repeated heads
        (FP32, False, True, 128, (9, 0), sdpa.MATH),  # fp32: no flash; grouped heads: no efficient
        (FP32, False, False, 128, (9, 0), sdpa.EFFICIENT),
        (FP32, True, False, 64, (8, 0), sdpa.EFFICIENT),
        (BF16, False, False, 512, (9, 0), sdpa.EFFICIENT),  # flash stops at head_dim 256
        (BF16, False, True, 512, (9, 0), sdpa.MATH),
        (BF16, False, False, 200, (8, 6), sdpa.EFFICIENT),  # sm86: flash's backward fails for 192 < d <= 224
        (BF16, False, False, 200, (8, 0), sdpa.FLASH),
        (BF16, False, False, 64, (7, 5), sdpa.MATH),  # no bf16 kernel before sm80
        (FP16, False, False, 64, (7, 5), sdpa.EFFICIENT),
        (FP16, True, False, 100, (9, 0), sdpa.MATH),  # half needs head_dim % 8 == 0 on the efficient kernel
        (FP32, True, False, 100, (9, 0), sdpa.EFFICIENT),  # fp32: % 4
    ],
)
def test_cuda_backend_follows_torchs_rules(dtype, mask, gqa, head_dim, capability, expected):
    assert sdpa.cuda_backend(dtype, mask=mask, gqa=gqa, head_dim=head_dim, capability=capability) == expected


def test_causal_with_unequal_lengths_is_not_flash():
    assert sdpa.cuda_backend(BF16, mask=False, gqa=False, head_dim=64, causal_non_square=True) == sdpa.EFFICIENT


def test_kv_heads_are_repeated_only_where_that_avoids_math():
    assert sdpa.repeats_kv_heads(BF16, mask=True, head_dim=128, capability=(9, 0))
    assert sdpa.repeats_kv_heads(FP32, mask=False, head_dim=128, capability=(9, 0))
    assert not sdpa.repeats_kv_heads(BF16, mask=False, head_dim=128, capability=(9, 0))  # flash already
    assert sdpa.repeats_kv_heads(BF16, mask=False, head_dim=512, capability=(9, 0))  # beyond flash's 256


def _qkv(dtype=FP32, q_heads=4, kv_heads=2, seq=16, dim=8):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_heads, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
    return q, k, v


def _document_mask(seq=16):
    docs = torch.tensor([0] * 6 + [1] * (seq - 6))
    return ((docs[:, None] == docs[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[None, None]


def _largest_saved(fn) -> int:
    """The most elements of any tensor autograd saves for the backward of fn()."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return max(sizes, default=0)


def test_the_planner_keeps_the_score_matrix_exactly_where_cuda_runs_math():
    q, k, v = _qkv()
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]  # B x H x S x S
    mask = _document_mask()
    assert cuda_choice(q, k, v, attn_mask=mask, enable_gqa=True) == sdpa.MATH
    assert cuda_choice(q.detach().bfloat16(), k, v, enable_gqa=True, is_causal=True) == sdpa.FLASH
    with target_attention("cuda"):
        masked_gqa = _largest_saved(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        causal_gqa_bf16 = _largest_saved(
            lambda: F.scaled_dot_product_attention(
                *(t.detach().bfloat16().requires_grad_() for t in (q, k, v)), is_causal=True, enable_gqa=True
            )
        )
        # The models' attention repeats the heads instead, which the efficient kernel takes: no matrix.
        models = _largest_saved(lambda: sdpa.attention(q, k, v, attn_mask=mask))
    assert masked_gqa >= scores  # math on the GPU: the matrix is counted
    assert causal_gqa_bf16 < scores and models < scores


def test_attention_repeats_heads_for_a_gpu_and_leaves_cpu_runs_alone(monkeypatch):
    q, k, v = _qkv()
    mask = _document_mask()
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    calls = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        calls.append((key.size(1), kwargs["enable_gqa"]))
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    on_cpu = sdpa.attention(q, k, v, attn_mask=mask)
    with sdpa.planning_target((9, 0)):
        for_gpu = sdpa.attention(q, k, v, attn_mask=mask)
        flash_case = sdpa.attention(*(t.detach().bfloat16() for t in (q, k, v)), is_causal=True)
    assert calls == [(2, True), (4, False), (2, True)]  # CPU as before; the GPU's math case repeated; flash kept
    torch.testing.assert_close(on_cpu, reference)
    torch.testing.assert_close(for_gpu, reference)
    assert flash_case.shape == q.shape
