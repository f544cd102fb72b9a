# The data shapes users bring to `shardwise finetune`, as TRL's SFTTrainer takes them: prompt/completion
# records (text and conversational, trained on the completion only), Alpaca's instruction/input/output, a
# .csv file, a hub-style data folder with named splits, a `tool` role left to the chat template. Each trains
# one step on a tiny model in this process; the tokens it trains on are checked exactly. Broken files (empty,
# a malformed line) are refused before any worker starts, naming the file and the line. Also the defaults
# that match TRL's (no EOS after a chat template, no held-out records unless asked) and the cache's place.
from __future__ import annotations

import csv
import json
import math
import os
import threading
import time
from types import SimpleNamespace

import pytest

from shardwise.recipes import data as D
from shardwise.recipes.data import DataOptions
from shardwise.recipes.data_formats import ALPACA, PROMPT_COMPLETION, DataFileError, alpaca_prompt, check_source
from shardwise.recipes.finetune import FinetuneConfig, finetune

from helpers.hf import COLOURS, THINGS, build_model_folder, chat_records, write_jsonl


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama whose tokenizer has no chat template (room for ChatML's two markers), and the same
    tokenizer with ChatML, saved apart."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("shapes")
    records = chat_records(24)
    records.append({"messages": [{"role": "user", "content": "instruction input output tool weather"}]})
    model = build_model_folder(str(root / "m"), records, vocab_pad=4)
    tok = AutoTokenizer.from_pretrained(model)
    D.apply_chatml(tok)
    chat_dir = str(root / "chat-tokenizer")
    tok.save_pretrained(chat_dir)
    return SimpleNamespace(
        root=root, model=model, chat_dir=chat_dir, chat_tok=tok, plain=AutoTokenizer.from_pretrained(model)
    )


def _qa(i):
    thing = THINGS[i % len(THINGS)]
    return f"what colour is the {thing} ?", f"the {thing} is {COLOURS[i % len(COLOURS)]} ."


def one_step(tiny, tmp_path, tokenizer_path=None, eval_steps=None, **data):
    """One optimizer step of the recipe on `data`, in this process."""
    options = dict(max_seq_len=64, packing=False, per_device_train_batch_size=2, cache_dir=str(tmp_path / "cache"))
    cfg = FinetuneConfig(
        model_path=tiny.model,
        tokenizer_path=tokenizer_path,
        max_steps=1,
        eval_steps=eval_steps,
        precision="32-true",
        strategy="single",
        devices=1,
        logging_steps=1,
        output_dir=str(tmp_path / "out"),
        data=DataOptions(**{**options, **data}),
    )
    result = finetune(cfg)
    assert len(result.losses) == 1 and math.isfinite(result.losses[0]["loss"]), result.losses
    return result


def _examples(path, tok, tmp_path, **spec):
    """The unpacked training examples of `path`, as (input ids, label-or-None per token) lists."""
    options = DataOptions(dataset=path, max_seq_len=64, packing=False, **spec)
    field = D.resolve_text_field(D.dataset_columns(path, options.dataset_split), None, path)
    prepared = D.prepare_data(options.spec(field, 42), tok, str(tmp_path / "cache"))
    out = []
    for i in range(len(prepared.train)):
        item = prepared.train[i]
        ids = (item["input_ids"] if isinstance(item, dict) else item).tolist()
        labels = item["labels"].tolist() if isinstance(item, dict) else ids
        out.append((ids, [None if y == -100 else y for y in labels]))
    return prepared, out


def _words(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_prompt_completion_records_train_on_the_completion_only(tiny, tmp_path):
    tok = tiny.plain
    records = [dict(zip(("prompt", "completion"), _qa(i))) for i in range(8)]
    path = write_jsonl(str(tmp_path / "pc.jsonl"), records)
    prepared, examples = _examples(path, tok, tmp_path)
    assert prepared.summary["text_field"] == PROMPT_COMPLETION and "eval" not in prepared.summary
    by_ids = {tuple(ids): labels for ids, labels in examples}
    for r in records:
        prompt, completion = _words(tok, r["prompt"]), _words(tok, r["completion"]) + [tok.eos_token_id]
        labels = by_ids[tuple(prompt + completion)]  # the completion ends with EOS, as TRL appends it
        assert labels == [None] * len(prompt) + completion
    result = one_step(tiny, tmp_path, dataset=path)
    assert result.data["train"]["completion_tokens"] == sum(len(_words(tok, r["completion"])) + 1 for r in records)


def test_conversational_prompt_completion(tiny, tmp_path):
    tok = tiny.chat_tok
    records = []
    for i in range(8):
        q, a = _qa(i)
        records.append(
            {
                "prompt": [
                    {"role": "system", "content": "you are a helpful assistant"},
                    {"role": "user", "content": q},
                ],
                "completion": [{"role": "assistant", "content": a}],
            }
        )
    path = write_jsonl(str(tmp_path / "cpc.jsonl"), records)
    _, examples = _examples(path, tok, tmp_path)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for ids, labels in examples:
        targets = [y for y in labels if y is not None]
        # the answer and its end of turn; not the prompt, nor the assistant header
        assert any(targets == _words(tok, r["completion"][0]["content"]) + [end] for r in records), targets
        assert ids[-1] == end  # no EOS after the template's own end of turn
    one_step(tiny, tmp_path, tokenizer_path=tiny.chat_dir, dataset=path)


def test_alpaca_records_use_the_documented_template(tiny, tmp_path):
    tok = tiny.plain
    records = []
    for i in range(8):
        q, a = _qa(i)
        records.append({"instruction": q, "input": "" if i % 2 else "the weather", "output": a})
    path = write_jsonl(str(tmp_path / "alpaca.jsonl"), records)
    prepared, examples = _examples(path, tok, tmp_path)
    assert prepared.summary["text_field"] == ALPACA
    assert alpaca_prompt("q", "").endswith("### Instruction:\nq\n\n### Response:\n")
    assert "### Input:\nx\n\n" in alpaca_prompt("q", "x")
    by_ids = {tuple(ids): labels for ids, labels in examples}
    for r in records:
        prompt = _words(tok, alpaca_prompt(r["instruction"], r["input"]))
        completion = _words(tok, r["output"]) + [tok.eos_token_id]
        assert by_ids[tuple(prompt + completion)] == [None] * len(prompt) + completion
    one_step(tiny, tmp_path, dataset=path)


def test_csv_file_and_the_cache_beside_the_hub_cache(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf-home"))
    path = str(tmp_path / "d.csv")
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text"])
        for i in range(6):
            writer.writerow([i, " ".join(_qa(i))])
    assert D.dataset_columns(path) == ["id", "text"]
    result = one_step(tiny, tmp_path, dataset=path, cache_dir=None)
    assert result.data["train"]["records"] == 6
    cache = os.path.join(str(tmp_path / "hf-home"), "shardwise", "tokenized")
    entries = [e for e in os.listdir(cache) if not e.startswith((".", "hf_datasets"))]
    assert len(entries) == 1 and not os.path.exists(os.path.join(str(tmp_path / "out"), "tokenized"))


def test_hub_style_folder_with_named_splits(tiny, tmp_path):
    import datasets

    folder = tmp_path / "snapshot"
    (folder / "data").mkdir(parents=True)
    rows = [{"messages": r["messages"]} for r in chat_records(14, seed=3)]
    datasets.Dataset.from_list(rows[:10]).to_parquet(str(folder / "data" / "train_sft-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[10:]).to_parquet(str(folder / "data" / "test_sft-00000-of-00001.parquet"))
    with pytest.raises(ValueError, match=r"'train' is not a split of .*\['test_sft', 'train_sft'\]"):
        check_source(str(folder), "train", None)  # what finetune checks before any worker starts
    result = one_step(tiny, tmp_path, dataset=str(folder), dataset_split="train_sft", eval_steps=1)
    assert result.data["train"]["records"] == 10 and result.data["eval"]["records"] == 4  # test_sft, found
    assert len(result.eval_losses) == 1


def test_tool_role_is_left_to_the_chat_template(tiny, tmp_path):
    messages = [
        {"role": "user", "content": "what colour is the sky ?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "weather"}}]},
        {"role": "tool", "content": "red"},
        {"role": "assistant", "content": "the sky is red ."},
    ]
    path = write_jsonl(str(tmp_path / "tools.jsonl"), [{"messages": messages}] * 4)
    assert "<|im_start|>tool\nred<|im_end|>" in D.record_text(messages, "tokenizer", tiny.chat_tok)
    with pytest.raises(ValueError, match="'tool' has no tag in the tagged format.*chat_template_format='tokenizer'"):
        D.record_text(messages, "tags", tiny.plain)
    # chatml on a tokenizer without a template: ChatML and its markers are added (the model has room)
    result = one_step(tiny, tmp_path, dataset=path, chat_template_format="chatml")
    assert result.data["chat_format"] == "tokenizer"


def test_broken_files_are_refused_before_any_worker_starts(tiny, tmp_path):
    def refused(path):
        cfg = FinetuneConfig(
            model_path=tiny.model,
            devices=2,
            strategy="fsdp",
            output_dir=str(tmp_path / "o"),
            data=DataOptions(dataset=path, max_seq_len=64),
        )
        with pytest.raises(DataFileError) as info:  # raised here, in the launching process
            finetune(cfg)
        return str(info.value)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{str(empty)!r} is empty" in refused(str(empty))
    lines = [json.dumps(r) for r in chat_records(4)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:2] + ['{"messages": [{"role": "user", "content": "hi"}'] + lines[2:]) + "\n")
    said = refused(str(bad))
    assert f"{str(bad)!r} line 3 is not valid JSON" in said and "Fix or delete that line" in said
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    assert "holds no records" in refused(str(blank))
    header = tmp_path / "header.csv"
    header.write_text("text\n")
    assert "holds no records" in refused(str(header))


def test_defaults_add_no_token_and_hold_nothing_out(tiny, tmp_path):
    """As TRL: a chat rendering gets no EOS after the template's end of turn, plain text does; every record
    is trained on unless evaluation is asked for or the data has an eval split."""
    tok = tiny.chat_tok
    records = chat_records(20, seed=5)
    path = write_jsonl(str(tmp_path / "chat.jsonl"), records)
    prepared, examples = _examples(path, tok, tmp_path)
    assert "eval" not in prepared.summary and prepared.summary["train"]["records"] == 20
    rendered = sorted(tuple(_words(tok, tok.apply_chat_template(r["messages"], tokenize=False))) for r in records)
    assert sorted(tuple(ids) for ids, _ in examples) == rendered
    text = write_jsonl(str(tmp_path / "text.jsonl"), [{"text": " ".join(_qa(i))} for i in range(3)])
    _, plain = _examples(text, tok, tmp_path)
    assert all(ids[-1] == tok.eos_token_id for ids, _ in plain)
    # Evaluation asked for (eval_steps / eval_strategy / an eval split named) holds 5% out; so does the ratio.
    assert DataOptions(dataset=path).spec("messages", 1, evaluate=True).eval_split_ratio == 0.05
    assert DataOptions(dataset=path, eval_split="test").spec("messages", 1).eval_split_ratio == 0.05
    assert DataOptions(dataset=path).spec("messages", 1).eval_split_ratio == 0.0


def test_one_build_per_cache_entry_under_concurrent_runs(tiny, tmp_path, monkeypatch):
    """A second run with the same data waits for the first one's build, then reads it (no second build)."""
    path = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(8))
    spec = DataOptions(dataset=path, max_seq_len=32).spec("messages", 1)
    cache = str(tmp_path / "shared")
    builds = []
    real = D.build_cache

    def slow_build(*args):
        builds.append(threading.get_ident())
        time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(D, "build_cache", slow_build)
    folders = []
    runs = [
        threading.Thread(target=lambda: folders.append(D.build_on_rank0(spec, tiny.plain, cache))) for _ in range(2)
    ]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    assert len(builds) == 1 and folders[0] == folders[1] and os.path.isdir(folders[0])
    assert not [f for f in os.listdir(cache) if f.endswith(".lock")]
