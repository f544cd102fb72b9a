"""The corpus pipeline: `shardwise prepare` tokenises, resumes and never re-tokenises a finished chunk; the packed
mixture's global order resumes exactly on any number of data-parallel ranks.

The mixture test drives the real loaders in one process: each data-parallel rank of a world is a DataLoader
over its own PackedMixture (dp_rank, dp_size), stepped in turn, and a checkpoint's loader states go back
through checkpoint/loader_state.py as a resumed run's would. Two corpora of about 36 and 24 samples are mixed
in blocks of 60; weighted by their sizes in blocks of their total, the first block is an epoch: every sample once.
"""

from __future__ import annotations

import json
import os
import random
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

from shardwise.callbacks.fingerprint import global_fingerprint, sample_digests
from shardwise.checkpoint import CheckpointMismatchError, loader_state
from shardwise.cli import main as cli
from shardwise.corpus import PackedMixture, TokenCorpus, prepare
from shardwise.data import distribute_dataloader

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
SEQ, GLOBAL_BATCH, STEPS, SAVED_AT = 16, 12, 10, 3
KIND = "shardwise.corpus.mixture.PackedMixture"  # what a checkpoint records the position's owner as


def _docs(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from helpers.hf import build_tokenizer

    path = str(tmp_path_factory.mktemp("tok"))
    build_tokenizer(_docs(50, 0)).save_pretrained(path)
    return path


def _reference(tokenizer, docs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return [t for d in docs for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def test_prepare_tokenises_with_workers_resumes_and_refuses_other_settings(tmp_path, tokenizer, capsys):
    docs_a, docs_b = _docs(300, 1), _docs(100, 2)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs_a))
    (tmp_path / "b.txt").write_text("".join(d + "\n" for d in docs_b))
    inputs, out = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")], str(tmp_path / "corpus")
    index = prepare(inputs, out, tokenizer, num_proc=2, chunk_bytes=3000)
    assert "tokens/s" in capsys.readouterr().err and index["dtype"] == "uint16"
    assert len(index["shards"]) > 4 and index["documents"] == 400
    corpus = TokenCorpus(out)
    tokens, starts = corpus.window(0, corpus.num_tokens)
    assert tokens.tolist() == _reference(tokenizer, docs_a + docs_b)  # every line once, in input order
    eos = tokens[-1]  # each document ends with EOS, and the index says where the next one starts
    assert len(starts) == 400 and starts[0] == 0 and (tokens[starts[1:] - 1] == eos).all()

    # Interrupted: two chunks lost their records (killed before finishing them), index.json not yet written.
    names = [s["name"] for s in index["shards"]]
    for name in names[1:3]:
        os.remove(os.path.join(out, name + ".json"))
    os.remove(os.path.join(out, "index.json"))
    kept = {n: os.stat(os.path.join(out, n + ".tokens")).st_mtime_ns for n in names[3:]}
    with pytest.raises(FileNotFoundError, match="did not finish; run prepare again"):
        TokenCorpus(out)
    assert cli(["prepare", *inputs, "--out", out, "--tokenizer", tokenizer, "--num_proc", "1"]) == 0
    assert "2/2 chunks" in capsys.readouterr().err  # only the two unfinished chunks were tokenised
    assert {n: os.stat(os.path.join(out, n + ".tokens")).st_mtime_ns for n in names[3:]} == kept
    assert TokenCorpus(out).window(0, corpus.num_tokens)[0].tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="other settings \\(text_key"):
        prepare(inputs, out, tokenizer, text_key="body")


def _corpus(root, name, tokenizer, samples, seed):
    """A corpus of about `samples` packed samples of SEQ tokens (documents of 21 words on average)."""
    docs, path = _docs(samples * 3 // 4, seed), os.path.join(root, name)
    with open(path + ".jsonl", "w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prepare([path + ".jsonl"], path, tokenizer, num_proc=1, progress=False)
    return path


def _world(corpora, dp_size, saved=None, batch_idx=0):
    """One DataLoader per data-parallel rank, restored from a checkpoint's loader states when given."""
    loaders = []
    for rank in range(dp_size):
        mixture = PackedMixture(corpora, seq_len=SEQ, seed=7, block=60, dp_rank=rank, dp_size=dp_size)
        loader = DataLoader(mixture, batch_size=GLOBAL_BATCH // dp_size)
        if saved is not None:
            assert loader_state.restore(loader, saved, rank, dp_size, batch_idx)
        loaders.append(loader)
    return loaders


def _world_of(corpora, block, dp_size):
    return [
        DataLoader(
            PackedMixture(corpora, SEQ, seed=7, block=block, dp_rank=r, dp_size=dp_size), GLOBAL_BATCH // dp_size
        )
        for r in range(dp_size)
    ]


def _steps(loaders, steps):
    """Per step: the global batch's sample ids (sorted) and its fingerprint; the batches themselves."""
    iterators = [iter(loader) for loader in loaders]
    out, batches = [], []
    for _ in range(steps):
        step = [next(it) for it in iterators]
        ids = sorted(i for b in step for i in b["sample_id"].tolist())
        out.append((ids, global_fingerprint([d for b in step for d in sample_digests(b)])))
        batches += step
    return out, batches


def _saved(loaders):
    return {"kind": KIND, "per_rank": [loader.dataset.state_dict() for loader in loaders]}


def test_the_mixture_resumes_on_any_number_of_ranks_without_repeating_or_skipping(tmp_path, tokenizer):
    corpora = {
        "web": (_corpus(str(tmp_path), "web", tokenizer, 36, 3), 36.0),
        "code": (_corpus(str(tmp_path), "code", tokenizer, 24, 4), 24.0),
    }
    sizes = [TokenCorpus(p).num_tokens // SEQ for p, _ in corpora.values()]
    corpora = {n: (p, float(k)) for (n, (p, _)), k in zip(corpora.items(), sizes)}
    block = sum(sizes)
    uninterrupted, batches = _steps(_world(corpora, 4), STEPS)

    # Packing keeps document boundaries: labels -100 and positions restarting exactly at each document start.
    for b in batches:
        starts = b["labels"] == -100
        assert torch.equal(starts[:, 1:], b["position_ids"][:, 1:] == 0)
        assert torch.equal(b["input_ids"][~starts], b["labels"][~starts])

    first = _world(corpora, 4)
    assert _steps(first, SAVED_AT)[0] == uninterrupted[:SAVED_AT]
    saved = _saved(first)
    for dp_size in (3, 2, 1, 6, 4):
        resumed, _ = _steps(_world(corpora, dp_size, saved, batch_idx=SAVED_AT), STEPS - SAVED_AT)
        assert resumed == uninterrupted[SAVED_AT:], dp_size  # same samples and fingerprint at every step

    # An epoch of the mixture (blocks of all the samples, weighted by size): every sample once, none left out.
    assert block <= STEPS * GLOBAL_BATCH, sizes
    mixture = PackedMixture(corpora, seq_len=SEQ, seed=7, block=block)
    epoch = _steps(_world_of(corpora, block, 2), STEPS)[0]
    seen = [i for ids, _ in epoch for i in ids]
    assert len(seen) == len(set(seen))  # nothing repeated over the steps
    first = [(i >> 40, i & (2**40 - 1)) for i in seen if (i & (2**40 - 1)) < sizes[i >> 40]]
    assert sorted(first) == [(c, n) for c, k in enumerate(sizes) for n in range(k)]  # the epoch: each read once
    packed = sorted(mixture.locate(g)[::2] for g in range(block))
    assert packed == [(c, j) for c, n in enumerate(sizes) for j in range(n)]  # ... and each packed sample once

    # It gives each rank its share itself: distributing its loader at 2 ranks leaves it alone, and says nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert distribute_dataloader(first[0], 2, 0, seed=0) is first[0]

    # The position belongs to this mixture: other weights would point it at other samples.
    other = DataLoader(PackedMixture({**corpora, "web": (corpora["web"][0], 1.0)}, SEQ, seed=7, block=60))
    with pytest.raises(ValueError, match="differs in weights"):
        loader_state.restore(other, saved, 0, 1, SAVED_AT)
    unequal = {"kind": KIND, "per_rank": [*saved["per_rank"][:3], {**saved["per_rank"][0], "consumed": 0}]}
    with pytest.raises(CheckpointMismatchError, match="different positions"):
        loader_state.restore(_world(corpora, 1)[0], unequal, 0, 1, SAVED_AT)


def test_ctrl_c_stops_prepare_at_once_and_a_second_run_continues(tmp_path, tokenizer):
    # SIGINT to `shardwise prepare` alone (a scheduler's or `kill -INT`'s; a terminal's Ctrl-C reaches the
    # workers too, which leave it to the parent): it stops within seconds, not after every queued chunk, and
    # the next run encodes only the chunks without a record.
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(5)
    path, out = str(tmp_path / "big.jsonl"), str(tmp_path / "corpus")
    with open(path, "w") as f:
        while f.tell() < 12 * 2**20:  # 12 chunks of 1 MiB: seconds of work for each worker
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(400))}) + "\n")
    command = [sys.executable, "-m", "shardwise.cli", "prepare", path, "--out", out, "--tokenizer", tokenizer]
    # SIGINT's default action restored in the child: a shell without job control starts background jobs with
    # SIGINT ignored (a CI step, `cmd &`), and Python then keeps ignoring it instead of raising KeyboardInterrupt.
    first = subprocess.Popen(
        [*command, "--num_proc", "2", "--chunk_mb", "1"],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    records = lambda: [n for n in os.listdir(out) if n.endswith(".json") and n not in ("plan.json", "index.json")]  # noqa: E731
    deadline = time.monotonic() + 240
    while not (os.path.isdir(out) and records()) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.05)
    first.send_signal(signal.SIGINT)
    sent = time.monotonic()
    first.communicate(timeout=120)
    stopped_after, done = time.monotonic() - sent, len(records())
    assert first.returncode != 0 and 0 < done < 12, (first.returncode, done)
    assert stopped_after < 30, stopped_after  # a bound for a loaded machine: the chunks are a second or so each
    time.sleep(1)
    assert len(records()) == done  # no worker left behind writing
    assert cli(["prepare", path, "--out", out, "--tokenizer", tokenizer, "--num_proc", "2", "--chunk_mb", "1"]) == 0
    with open(path) as f:
        assert TokenCorpus(out).index["documents"] == sum(1 for _ in f)
