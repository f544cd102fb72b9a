# The fine-tuning cache built by the corpus pipeline's workers (token shards, a mask byte per token, the
# splits as document orders) gives exactly the examples the in-memory path gives: the records read by
# datasets, held out by its train_test_split, rendered and packed by pack_documents / truncate_documents.
# Checked on chat records (assistant-only loss) and prompt/completion records (completion-only loss),
# packed and not, with records spread over several chunks and two worker processes. Then the ranks that
# wait for the tokenising rank: they wait as long as it progresses (longer than their stall limit), and
# fail naming the tokenisation and its own error when it fails or stands still.
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from torch.distributed import HashStore

from shardwise.recipes import data as D
from shardwise.recipes import data_wait, token_cache
from shardwise.recipes.packing import pack_documents, target_tokens, truncate_documents

from helpers.hf import build_tokenizer, chat_records, write_jsonl


def _completions(n):
    records = chat_records(n, seed=7)
    return [
        {"prompt": f"q : {r['messages'][1]['content']}", "completion": f" {r['messages'][2]['content']}"}
        for r in records
    ]


def _reference(spec, tok, field):
    """The in-memory path: datasets reads and splits, each record rendered, EOS by the rule, then packed."""
    import datasets

    train = datasets.load_dataset("json", data_files=spec.path, split="train")
    n_eval = max(1, int(round(len(train) * spec.eval_split_ratio)))
    train = train.train_test_split(test_size=n_eval, seed=spec.seed, shuffle=True)["train"]
    encoder = D.RecordEncoder(tok, field, D.resolve_chat_format(spec.chat_template_format, tok), spec)
    docs = [d for d in encoder(train[:], len(train), 0) if len(d[0])]
    ids, flags = [d[0] for d in docs], [d[1] for d in docs]
    if spec.packing:
        return pack_documents(ids, spec.max_seq_len, spec.packing_mode, flags)
    return truncate_documents(ids, spec.max_seq_len, flags)


@pytest.mark.parametrize(
    "shape, packing, mode",
    [("chat", True, "attention"), ("chat", False, "attention"), ("completion", True, "loss")],
)
def test_the_cache_gives_the_in_memory_examples(tmp_path, monkeypatch, shape, packing, mode):
    monkeypatch.setattr(token_cache, "MIN_CHUNK_BYTES", 1500)  # several chunks, two workers
    monkeypatch.setattr(token_cache, "MAX_CHUNK_BYTES", 1500)
    records = chat_records(40, seed=2) if shape == "chat" else _completions(40)
    words = [m["content"] for r in chat_records(40, seed=2) + chat_records(40, seed=7) for m in r["messages"]]
    tok = build_tokenizer(words + ["q :"])
    path = write_jsonl(str(tmp_path / "d.jsonl"), records)
    spec = D.DataSpec(
        path=path, max_seq_len=24, packing=packing, packing_mode=mode, eval_split_ratio=0.2, seed=3,
        assistant_only_loss=shape == "chat",
    )  # fmt: skip
    field = "messages" if shape == "chat" else D.PROMPT_COMPLETION
    prepared = D.prepare_data(spec, tok, str(tmp_path / "cache"), num_proc=2)
    want = _reference(spec, tok, field)
    index = os.path.join(prepared.folder, "index.json")
    assert len(__import__("json").load(open(index))["shards"]) > 2  # the records were spread over chunks
    assert prepared.summary["train"]["records"] == 32 and prepared.summary["eval"]["records"] == 8
    counted = "assistant_tokens" if shape == "chat" else "completion_tokens"
    assert prepared.summary["train"][counted] == target_tokens(want, packing) > 0
    if packing:
        assert len(prepared.train) == len(want["input_ids"])
        for i in range(len(prepared.train)):
            item = prepared.train[i]
            for key in ("input_ids", "labels") + (("position_ids",) if mode == "attention" else ()):
                assert item[key].dtype == torch.int64
                np.testing.assert_array_equal(item[key].numpy(), want[key][i], err_msg=f"{key} of block {i}")
            assert mode == "attention" or "position_ids" not in item
    else:
        offsets = want["offsets"]
        assert len(prepared.train) == len(offsets) - 1
        for i in range(len(prepared.train)):
            item, where = prepared.train[i], slice(offsets[i], offsets[i + 1])
            np.testing.assert_array_equal(item["input_ids"].numpy(), want["tokens"][where])
            np.testing.assert_array_equal(item["labels"].numpy() != -100, want["targets"][where])
    # compact: tokens in two bytes (a vocabulary under 65,536), one mask byte, a few integers per document
    tokens = prepared.summary["train"]["tokens"] + prepared.summary["eval"]["tokens"]
    size = sum(os.path.getsize(os.path.join(prepared.folder, f)) for f in os.listdir(prepared.folder))
    assert not [f for f in os.listdir(prepared.folder) if "labels" in f or "position" in f]
    assert size < 1.5 * 4 * tokens + 16_000  # the .npy headers and index/summary JSON of a tiny set


def _progressing(report, steps=8, pause=0.25):
    for i in range(steps):
        report({"phase": "tokenising", "tokens": 1000 * (i + 1), "done": i + 1, "total": steps})
        time.sleep(pause)
    return "built"


def test_waiting_ranks_follow_the_progress_and_name_the_tokenisation_when_it_fails(tmp_path, monkeypatch):
    store, seen = HashStore(), {}
    progress_file = str(tmp_path / ".entry.progress.json")
    monkeypatch.setattr(data_wait, "PRINT_EVERY_S", 0.5)

    def builder(key, build):
        try:
            seen[key] = data_wait.run_posting(data_wait.Board(store, key, progress_file), "global rank 0", build)
        except Exception as exc:
            seen[key] = exc

    def progressing(report):
        result = _progressing(report)
        seen["file while building"] = os.path.exists(progress_file)
        return result

    # 2 s of building with progress every 0.25 s: the waiting rank's 1 s stall limit never runs out.
    thread = threading.Thread(target=builder, args=("a", progressing))
    thread.start()
    started = time.monotonic()
    data_wait.wait_for(data_wait.Board(store, "a"), "global rank 0", "rank 1", stall_s=1.0, poll_s=0.05)
    thread.join()
    assert seen["a"] == "built" and time.monotonic() - started > 1.5
    assert seen["file while building"] and not os.path.exists(progress_file)

    # The builder fails (a real build on records with no turns): the waiting rank says what and why at once.
    text = write_jsonl(str(tmp_path / "text.jsonl"), [{"content": "hi there"}] * 4)
    spec = D.DataSpec(path=text, max_seq_len=8, assistant_only_loss=True)
    tok = build_tokenizer(["hi there"])
    build = lambda report: D.build_cache(spec, tok, str(tmp_path / "entry"), 1, report)  # noqa: E731
    thread = threading.Thread(target=builder, args=("b", build))
    thread.start()
    with pytest.raises(data_wait.DataPreparationError, match="tokenising the fine-tuning data failed on global "
                       "rank 0: AssistantSpanError: .*holds text"):  # fmt: skip
        data_wait.wait_for(data_wait.Board(store, "b"), "global rank 0", "rank 1", stall_s=30.0, poll_s=0.05)
    thread.join()

    # A builder that stands still: the waiting rank stops after its stall limit, saying where it stood.
    store.set("c", '{"phase": "tokenising", "tokens": 5000, "done": 1, "total": 4}')
    said = "rank 1 waited 0 s for global rank 0 tokenising the fine-tuning data, which made no progress"
    with pytest.raises(data_wait.DataPreparationError, match=said + " .*5,000 tokens, 25% of the input.*timeout_s"):
        data_wait.wait_for(data_wait.Board(store, "c"), "global rank 0", "rank 1", stall_s=0.3, poll_s=0.05)
