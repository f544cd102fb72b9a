# Data side of the fine-tuning recipe: chat formatting, packing with document
# boundaries (checked against a real Hugging Face model: a packed document
# must produce the same logits as the document alone), the field check that
# lists the fields, and the on-disk tokenisation cache built exactly once.
from __future__ import annotations

import json
import os

import pytest
import torch

from shardwise.recipes import data as D

from helpers.hf import build_tokenizer, chat_records, write_jsonl


def test_tags_format_matches_the_seed_recipe():
    text = D.format_tags(
        D._normalise_messages(
            [
                {"role": "system", "content": "be nice"},
                {"from": "human", "value": "hi"},
                {"role": "assistant", "content": "yo"},
            ]
        )
    )
    assert text == "<|system|> be nice <|endoftext|> <|prompter|> hi <|endoftext|> <|assistant|> yo <|endoftext|>"


def test_tokenizer_chat_template_is_used_when_present():
    tok = build_tokenizer(["hi there"])
    assert D.resolve_chat_format("auto", tok) == "tags"
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    assert D.resolve_chat_format("auto", tok) == "tokenizer"
    assert D.record_text([{"role": "user", "content": "hi"}], "tokenizer", tok) == "[user]hi"
    # 'none' adds no template: text as it is, messages by the tokenizer's own template only
    assert D.record_text([{"role": "user", "content": "hi"}], "none", tok) == "[user]hi"
    with pytest.raises(ValueError, match="has no template"):
        D.record_text([{"role": "user", "content": "hi"}], "none", build_tokenizer(["hi"]))


def test_packing_masks_boundaries_and_restarts_positions():
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
    out = D.pack_documents(docs, block=4, mode="attention")
    assert out["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    # first token of each document is never a target
    assert out["labels"].tolist() == [[-100, 2, 3, -100], [5, 6, 7, 8], [-100, 10, 11, 12]]
    # positions restart at each document and at each block
    assert out["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 3], [0, 1, 2, 3]]
    loss_mode = D.pack_documents(docs, block=4, mode="loss")
    assert loss_mode["position_ids"].tolist() == [[0, 1, 2, 3]] * 3
    assert loss_mode["labels"].tolist() == out["labels"].tolist()
    with pytest.raises(ValueError, match="fewer than one block"):
        D.pack_documents([[1, 2]], block=8, mode="attention")


def test_packed_document_sees_only_itself_in_a_hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    ).eval()
    a, b = [3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    packed = D.pack_documents([a, b], block=12, mode="attention")
    ids = torch.from_numpy(packed["input_ids"]).long()
    pos = torch.from_numpy(packed["position_ids"]).long()
    with torch.no_grad():
        together = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        alone = model(input_ids=torch.tensor([b]), use_cache=False).logits
        leaky = model(input_ids=ids, use_cache=False).logits  # plain causal: b attends to a
    torch.testing.assert_close(together[0, 5:], alone[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(leaky[0, 5:], alone[0], atol=1e-3)


def test_missing_field_lists_the_fields(tmp_path):
    path = write_jsonl(str(tmp_path / "d.jsonl"), chat_records(4))
    assert D.dataset_columns(path) == ["messages", "id"]
    with pytest.raises(D.DatasetFieldError, match=r"'content'.*fields are \['messages', 'id'\]"):
        D.resolve_text_field(D.dataset_columns(path), "content", path)
    assert D.resolve_text_field(["id", "text"], None, path) == "text"


def test_parquet_and_save_to_disk_sources(tmp_path):
    import datasets

    rows = [{"text": f"<|prompter|> q{i} <|endoftext|> <|assistant|> a{i} <|endoftext|>"} for i in range(20)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(3))}).save_to_disk(str(tmp_path / "folder"))
    assert D.dataset_columns(str(tmp_path / "d.parquet")) == ["text"]
    assert D.dataset_columns(str(tmp_path / "folder")) == ["text"]
    tok = build_tokenizer([r["text"] for r in rows])
    spec = D.DataSpec(path=str(tmp_path / "folder"), max_seq_len=8, packing=False)
    prepared = D.prepare_data(spec, tok, str(tmp_path / "cache"))
    assert prepared.summary["eval"]["records"] == 3  # the folder's own test split
    batch = prepared.collate([prepared.train[0], prepared.train[1][:3]])
    assert batch["input_ids"].shape[0] == 2 and (batch["labels"][1, 3:] == -100).all()
    assert batch["attention_mask"][1].tolist()[:4] == [1, 1, 1, 0]


def test_tokenisation_cache_is_built_once(tmp_path, monkeypatch):
    path = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(60))
    tok = build_tokenizer([m["content"] for r in chat_records(60) for m in r["messages"]])
    spec = D.DataSpec(path=path, max_seq_len=32, eval_split_ratio=0.1)
    first = D.prepare_data(spec, tok, str(tmp_path / "cache"))
    assert len(first.train) > 0 and first.eval is not None and first.summary["chat_format"] == "tags"
    item = first.train[0]
    assert set(item) == {"input_ids", "labels", "position_ids"} and item["input_ids"].shape == (32,)
    calls = []
    monkeypatch.setattr(D, "build_cache", lambda *a, **k: calls.append(a))
    again = D.prepare_data(spec, tok, str(tmp_path / "cache"))
    assert calls == [] and again.folder == first.folder
    # anything that changes the tokens changes the key
    assert D.cache_key(D.DataSpec(path=path, max_seq_len=16), tok) != D.cache_key(spec, tok)
    with open(os.path.join(first.folder, "summary.json")) as fh:
        assert json.load(fh)["train"]["records"] == 54
    assert [int(first.train[i]["labels"][0]) for i in range(len(first.train))].count(-100) >= 1
