"""assistant_only_loss (issue 21 item 5): the loss is taken on the assistant turns only.

The expected targets are found here independently of the code under test,
by reading the token stream: after an `<|assistant|>` token, every token
through the next `<|endoftext|>` is the assistant's; nothing else is. The
masks must be exactly those tokens, packed and unpacked, for the tagged
format, a tokenizer chat template rendered prefix by prefix, and one with
`{% generation %}` markers. On the tiny Llama the recipe's summed loss
equals the cross-entropy summed over those tokens by hand, and one
optimizer step over two micro-batches with different masks has the gradient
of the mean over all their assistant tokens (the global-token normalisation).
What has no turns is refused, naming the fix.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from shardwise.cli.finetune import parser
from shardwise.recipes import data as D
from shardwise.recipes.assistant_spans import AssistantSpanError
from shardwise.recipes.causal_lm import CausalLMModule
from shardwise.recipes.data import DataOptions
from shardwise.recipes.finetune import FinetuneConfig, coerce_config

from helpers.hf import build_tokenizer, chat_records, write_jsonl
from helpers.trainers import quiet_trainer

ROLE = (
    "{% if m['role'] == 'assistant' %}<|assistant|>{% elif m['role'] == 'user' %}<|prompter|>"
    "{% else %}<|system|>{% endif %}"
)
PLAIN = (
    "{% for m in messages %}" + ROLE + " {{ m['content'] }} <|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
MARKED = (
    "{% for m in messages %}" + ROLE + " {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} "
    "<|endoftext|>{% endgeneration %}{% else %}{{ m['content'] }} <|endoftext|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def expected_targets(ids, tok):
    """True for each token from after an <|assistant|> through the <|endoftext|> that ends its turn."""
    start, end = tok.convert_tokens_to_ids("<|assistant|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    out, inside = [], False
    for t in ids:
        out.append(inside)
        if t == start:
            inside = True
        elif t == end:
            inside = False
    return np.array(out, dtype=bool)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tmp_path_factory.mktemp("aol")
    records = chat_records(12, seed=3)
    tok = build_tokenizer([m["content"] for r in records for m in r["messages"]])
    return SimpleNamespace(folder=folder, tok=tok, path=write_jsonl(str(folder / "chat.jsonl"), records))


def _prepared(chat, name, packing, template=None, **kw):
    tok = chat.tok
    if template is not None:
        tok = build_tokenizer([m["content"] for r in chat_records(12, seed=3) for m in r["messages"]])
        tok.chat_template = template
    spec = D.DataSpec(
        path=chat.path, max_seq_len=24, packing=packing, eval_split_ratio=0, assistant_only_loss=True, **kw
    )
    return D.prepare_data(spec, tok, str(chat.folder / f"cache-{name}")), tok


@pytest.mark.parametrize("template", [None, PLAIN, MARKED], ids=["tags", "template", "generation-markers"])
def test_the_labels_are_exactly_the_assistant_tokens(chat, template):
    fmt = "tags" if template is None else "tokenizer"
    unpacked, tok = _prepared(chat, f"{fmt}-{template is MARKED}-u", False, template, chat_template_format=fmt)
    assert unpacked.summary["chat_format"] == fmt
    targets = 0
    for i in range(len(unpacked.train)):
        item = unpacked.train[i]
        ids, labels = item["input_ids"].numpy(), item["labels"].numpy()
        want = expected_targets(ids, tok)
        assert want.any()
        np.testing.assert_array_equal(labels != -100, want)
        np.testing.assert_array_equal(labels[want], ids[want])
        targets += int(want[1:].sum())
    assert unpacked.summary["train"]["assistant_tokens"] == targets
    # Padded into a batch: the padding is no target either.
    batch = unpacked.collate([unpacked.train[0], unpacked.train[1]])
    for row in range(2):
        ids = unpacked.train[row]["input_ids"].numpy()
        n = len(ids)
        np.testing.assert_array_equal(batch["labels"][row, :n].numpy() != -100, expected_targets(ids, tok))
        assert (batch["labels"][row, n:] == -100).all()
    # Packed: the same stream cut into blocks; a document's first token is no target anyway (a role tag).
    packed, _ = _prepared(chat, f"{fmt}-{template is MARKED}-p", True, template, chat_template_format=fmt)
    ids = np.concatenate([packed.train[i]["input_ids"].numpy() for i in range(len(packed.train))])
    labels = np.concatenate([packed.train[i]["labels"].numpy() for i in range(len(packed.train))])
    want = expected_targets(ids, tok)
    np.testing.assert_array_equal(labels != -100, want)
    np.testing.assert_array_equal(labels[want], ids[want])


def test_the_cache_key_keeps_old_caches_and_separates_the_option(chat):
    off = D.DataSpec(path=chat.path, max_seq_len=24, append_eos=True, eval_split_ratio=0.05)  # the old defaults
    on = D.DataSpec(path=chat.path, max_seq_len=24, append_eos=True, eval_split_ratio=0.05, assistant_only_loss=True)
    assert D.cache_key(off, chat.tok) != D.cache_key(on, chat.tok)
    # Off, the key is the one computed before the option existed (the spec without it).
    import dataclasses
    import hashlib
    import json

    later = ("assistant_only_loss", "split", "eval_split", "completion_only_loss", "revision")  # unset or default
    old_spec = {k: v for k, v in dataclasses.asdict(off).items() if k not in later}
    blob = json.dumps(
        {
            "v": D.CACHE_VERSION,
            "spec": old_spec,
            "data": D._file_fingerprint(chat.path),
            "tok": D._tokenizer_fingerprint(chat.tok),
        },
        sort_keys=True,
        default=str,
    )
    assert D.cache_key(off, chat.tok) == hashlib.sha256(blob.encode()).hexdigest()[:16]
    # The option's spellings reach the spec: nested in Python, flat or nested in a dict (YAML) and on the command line.
    assert FinetuneConfig(data=DataOptions(assistant_only_loss=True)).data.spec("messages", 1).assistant_only_loss
    assert coerce_config({"assistant_only_loss": True}).data.assistant_only_loss
    assert coerce_config({"data": {"assistant_only_loss": True}}).data.assistant_only_loss
    for argv, value in (
        (["--assistant_only_loss", "true"], True),
        (["--data.assistant_only_loss", "true"], True),
        ([], False),
    ):
        parsed = parser().parse_args(argv).as_dict()
        assert FinetuneConfig(**{k: v for k, v in parsed.items() if k != "config"}).data.assistant_only_loss is value


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _hand_loss(model, batch, want):
    """Cross-entropy of each assistant token given what precedes it, summed, from the logits."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits.float()
    total = logits.new_zeros(())
    for row in range(logits.shape[0]):
        for t in range(1, logits.shape[1]):
            if want[row, t]:
                total = total + F.cross_entropy(logits[row, t - 1], batch["input_ids"][row, t])
    return total


def test_the_loss_is_the_hand_masked_loss_and_the_step_normalises_over_assistant_tokens(chat):
    unpacked, tok = _prepared(chat, "tags-u", False, chat_template_format="tags")
    module = CausalLMModule(SimpleNamespace(learning_rate=0.1), folder=None, total_steps=1)
    module.model = _tiny_llama()
    assert len(tok) <= 64
    batch = unpacked.collate([unpacked.train[i] for i in range(3)])
    want = np.stack([expected_targets(r, tok) for r in batch["input_ids"].numpy()])
    want &= batch["attention_mask"].numpy().astype(bool)
    summed = module.training_step(batch, 0)
    torch.testing.assert_close(summed, _hand_loss(module.model, batch, want), rtol=1e-5, atol=1e-5)
    assert int(module.loss_weight(batch)) == int(want[:, 1:].sum())

    # One optimizer step over two micro-batches whose masks differ: its gradient is the gradient of the
    # summed assistant-token loss of both over their assistant tokens together (the Trainer's weighting).
    micro = [unpacked.collate([unpacked.train[0]]), unpacked.collate([unpacked.train[1], unpacked.train[2]])]
    counts = [int(module.loss_weight(b)) for b in micro]
    assert counts[0] != counts[1]
    reference = _tiny_llama()
    total = sum(_hand_loss(reference, b, b["labels"].numpy() != -100) for b in micro) / sum(counts)
    total.backward()
    seen = {}

    class Grab:
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen.update({n: p.grad.detach().clone() for n, p in module.model.named_parameters()})

    class Recipe(CausalLMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.0)

        def configure_callbacks(self):
            return [Grab()]

    trained = Recipe(SimpleNamespace(learning_rate=0.0, logging_steps=1), folder=None, total_steps=1)
    trained.model = _tiny_llama()
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2, precision="32-true")
    trainer.fit(trained, train_dataloaders=DataLoader(micro, batch_size=None))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(seen[name], p.grad, rtol=1e-4, atol=1e-6)


def test_what_has_no_turns_is_refused(chat, tmp_path):
    options = D.DataOptions(dataset=chat.path, assistant_only_loss=True, chat_template_format="none")
    with pytest.raises(AssistantSpanError, match="chat_template_format='none'.*turn assistant_only_loss off"):
        D.check_assistant_only_loss(options, "messages")
    text = write_jsonl(str(tmp_path / "text.jsonl"), _text_records())
    with pytest.raises(AssistantSpanError, match="field 'content' holds text.*dataset_text_field"):
        D.check_assistant_only_loss(D.DataOptions(dataset=text, assistant_only_loss=True), "content")
    with pytest.raises(AssistantSpanError, match="holds text"):  # and when the cache is built
        D.prepare_data(D.DataSpec(path=text, max_seq_len=8, assistant_only_loss=True), chat.tok, str(tmp_path / "c"))
    D.check_assistant_only_loss(D.DataOptions(dataset=text), "content")  # off: nothing to check


def _text_records():
    return [{"content": "<|prompter|> hi <|endoftext|> <|assistant|> yo <|endoftext|>"}] * 4


def test_templates_without_spans_and_data_without_answers_are_refused(chat, tmp_path):
    # A template that does not render a conversation turn after turn (here: newest turn first).
    reverse = "{% for m in messages|reverse %}" + ROLE + " {{ m['content'] }} <|endoftext|> {% endfor %}"
    with pytest.raises(AssistantSpanError, match="record 0 as the concatenation of its turns"):
        _prepared(chat, "reverse", False, reverse, chat_template_format="tokenizer")
    first = [{"messages": [{"role": "assistant", "content": "the sky is blue ."}]}] * 4
    with pytest.raises(AssistantSpanError, match="record 0 starts with an assistant turn"):
        tok = build_tokenizer(["the sky is blue ."])
        tok.chat_template = PLAIN
        spec = D.DataSpec(path=write_jsonl(str(tmp_path / "a.jsonl"), first), max_seq_len=8, assistant_only_loss=True)
        D.prepare_data(spec, tok, str(tmp_path / "c1"))
    questions = [{"messages": [{"role": "user", "content": "what colour is the sky ?"}]}] * 6
    spec = D.DataSpec(path=write_jsonl(str(tmp_path / "q.jsonl"), questions), max_seq_len=8, assistant_only_loss=True)
    with pytest.raises(ValueError, match="no assistant tokens to train on"):
        D.prepare_data(spec, chat.tok, str(tmp_path / "c2"))
    assert not [f for f in os.listdir(tmp_path / "c2") if not f.startswith("hf_datasets")]
