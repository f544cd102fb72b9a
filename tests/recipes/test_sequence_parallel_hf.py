"""Sequence parallel for a Hugging Face Llama against one process, and packed documents kept apart.

One 2-rank gloo launch (sp=2) runs a tiny Llama built from a config (fp32, no download) through
transformers' attention interface (sequence_parallel_hf): per-token logits, the summed loss and the
gradients of a step over packed documents whose boundaries fall inside and across the ranks' slices
equal one process's within 1e-5; a right-padded, unpacked batch whose length sp does not divide gives
one process's logits and loss on its real tokens. The packing proof: changing the tokens of one
document changes its own logits and leaves every other document's unchanged under sp, while the same
check with the document ids dropped fails (later documents then attend to the changed one).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise
from shardwise.strategies.sequence_parallel_hf import (
    DOCUMENT_IDS,
    apply_hf_sequence_parallel,
    check_hf_sequence_parallel,
    document_ids,
    split_batch,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16
DOCS = [[5, 7, 4], [9, 7]]  # document lengths per row: boundaries inside and across the two slices of 8
CHANGED = (0, slice(0, 5))  # row 0's first document: its tokens change in the packing proof


def _config(**overrides):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    kw.update(overrides)
    return transformers.LlamaConfig(**kw)


def _model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(_config(), attn_implementation="sdpa").float()


def _packed(changed: bool = False):
    """Packed rows as packing.py makes them: position ids restart per document, first labels -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (len(DOCS), SEQ), generator=g)
    if changed:
        row, cols = CHANGED
        ids[row, cols] = (ids[row, cols] + 7) % VOCAB
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    labels = torch.where(positions == 0, -100, ids)
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def _padded():
    """Unpacked rows right-padded to 15 tokens (which sp=2 does not divide), as PadCollate makes them."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 15), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    labels = torch.where(mask.bool(), ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _summed(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")


def _reference(batch):
    """One process: the model on the whole batch (Hugging Face's own packed / padding masks)."""
    model = _model()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    if "labels" not in batch:
        return logits.detach(), None, None
    loss = _summed(logits, F.pad(batch["labels"][:, 1:], (0, 1), value=-100))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    model = _model()
    apply_hf_sequence_parallel(model, mesh)
    out = {}

    def run(batch, drop_documents=False):
        inputs, targets = split_batch(batch, rank, 2)
        if drop_documents:  # plain causal attention over the whole row
            inputs[DOCUMENT_IDS] = torch.zeros_like(inputs[DOCUMENT_IDS])
        return model(**inputs, use_cache=False).logits, targets

    logits, targets = run(_packed())
    loss = _summed(logits, targets)
    model.zero_grad()
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():  # the sp group's sum: each rank's slice of the loss
        dist.all_reduce(p.grad)
        grads[n] = p.grad.clone()
    out["packed"] = (logits.detach(), loss.detach(), int((targets != -100).sum()), grads)
    with torch.no_grad():
        out["changed"] = run(_packed(changed=True))[0]
        out["plain"] = run(_packed())[0]
        out["plain_changed"] = run(_packed(changed=True), drop_documents=True)[0]
        logits, targets = run(_padded())
        out["padded"] = (logits, _summed(logits, targets))
        out["one_document"] = run({"input_ids": _packed()["input_ids"]})[0]  # no mask built: plain causal
        for key, call in (
            ("no_documents", lambda: model(input_ids=_packed()["input_ids"][:, :8], use_cache=False)),
            ("full_batch", lambda: model(**split_batch(_packed(), 0, 1)[0], use_cache=False)),
        ):
            try:
                call()
            except ValueError as e:
                out[key] = str(e)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return shardwise.launch(_worker, devices=2)


def _joined(two_ranks, key):
    return torch.cat([r[key] if not isinstance(r[key], tuple) else r[key][0] for r in two_ranks], dim=1)


def test_logits_loss_and_gradients_equal_one_process(two_ranks):
    logits, loss, grads = _reference(_packed())
    torch.testing.assert_close(_joined(two_ranks, "packed"), logits, atol=1e-5, rtol=0)
    # Each rank's summed loss and target count is its slice's: they add up to the whole batch's.
    torch.testing.assert_close(sum(r["packed"][1] for r in two_ranks), loss, atol=1e-5, rtol=1e-6)
    assert sum(r["packed"][2] for r in two_ranks) == int((_packed()["labels"][:, 1:] != -100).sum())
    for r in two_ranks:
        for n, g in grads.items():
            torch.testing.assert_close(r["packed"][3][n], g, atol=1e-5, rtol=0, msg=n)


def test_a_padded_batch_sp_does_not_divide_equals_one_process_on_its_real_tokens(two_ranks):
    batch = _padded()
    logits, loss, _ = _reference(batch)
    got = _joined(two_ranks, "padded")[:, :15]  # split_batch padded 15 -> 16 tokens
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(sum(r["padded"][1] for r in two_ranks), loss, atol=1e-5, rtol=1e-6)


def test_rows_without_position_ids_are_one_document_as_on_one_process(two_ranks):
    logits, _, _ = _reference({"input_ids": _packed()["input_ids"]})
    torch.testing.assert_close(_joined(two_ranks, "one_document"), logits, atol=1e-5, rtol=0)


def _other_documents_unchanged(before, after):
    row, cols = CHANGED
    own = torch.zeros(before.shape[:2], dtype=torch.bool)
    own[row, cols] = True
    changed_own = (before[own] - after[own]).abs().max() > 1e-3
    others_same = torch.allclose(before[~own], after[~own], atol=1e-6, rtol=0)
    return changed_own, others_same


def test_no_token_attends_across_documents(two_ranks):
    changed_own, others_same = _other_documents_unchanged(_joined(two_ranks, "packed"), _joined(two_ranks, "changed"))
    assert changed_own and others_same
    # The same check without the document ids fails: row 0's later documents see the changed one.
    changed_own, others_same = _other_documents_unchanged(
        _joined(two_ranks, "plain"), _joined(two_ranks, "plain_changed")
    )
    assert changed_own and not others_same


def test_calls_the_attention_cannot_honour_are_refused(two_ranks):
    assert f"called without `{DOCUMENT_IDS}`" in two_ranks[0]["no_documents"]
    assert "not with the full batch" in two_ranks[0]["full_batch"]
    with pytest.raises(ValueError, match="sequence length 15 is not a multiple of sp_size=2"):
        split_batch({"input_ids": torch.zeros(1, 15, dtype=torch.long)}, 0, 2)
    with pytest.raises(ValueError, match="does not know how to split"):
        split_batch({"input_ids": torch.zeros(1, 16, dtype=torch.long), "pixel_values": torch.zeros(1)}, 0, 2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=1), r"num_key_value_heads=1\b.* Use sp_size in \[1\]"),
        (dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3), r"num_attention_heads=3\b.* in \[1, 3\]"),
        (dict(attention_dropout=0.1), "Set attention_dropout=0"),
        (dict(attn_implementation="flash_attention_2"), "Use attn_implementation='sdpa'"),
    ],
)
def test_models_the_attention_cannot_split_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_hf_sequence_parallel(_config(**overrides), 2)


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    mistral = transformers.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=64)
    check_hf_sequence_parallel(mistral, 2, max_seq_len=64)  # within the window: causal attention
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*Use max_seq_len <= 64"):
        check_hf_sequence_parallel(mistral, 2, max_seq_len=128)


def test_split_batch_shifts_labels_before_slicing_and_keeps_whole_documents():
    batch = _packed()
    first, t0 = split_batch(batch, 0, 2)
    second, t1 = split_batch(batch, 1, 2)
    # Rank 0's last position predicts rank 1's first token.
    assert t0[0, -1] == batch["labels"][0, 8] and t1[0, -1] == -100
    torch.testing.assert_close(second["input_ids"], batch["input_ids"][:, 8:])
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    torch.testing.assert_close(first[DOCUMENT_IDS], docs)
    torch.testing.assert_close(document_ids(batch["position_ids"]), docs)
    # Without position ids the block is one document, as Hugging Face attends to it on one device: no mask.
    plain, _ = split_batch({"input_ids": batch["input_ids"]}, 1, 2)
    assert plain[DOCUMENT_IDS] is None and plain["position_ids"][0].tolist() == list(range(8, 16))
