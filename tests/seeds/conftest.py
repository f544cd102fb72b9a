"""The seed documents' code, run with only imports and sizes changed (issue 12).

Each test_seed_NNN.py takes the code blocks of one document in order. What
changed besides imports and sizes is commented at the line (e.g. CUDA-only
calls on this CPU machine). Code that needs two processes runs under
shardwise.launch(fn, devices=2): Trainer(devices=2) in a pytest process does
not start its own workers.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "recipes"))  # hf_fixtures, test_finetune_flags

WORDS = ("the cat sat on the mat and the dog ran to the park while a bird sang in the tall green tree "
         "near the river where children played with a red ball until the sun went down").split()


def write_wikitext(folder: str, n_words: int = 400) -> str:
    """A tiny stand-in for WikiText-2's train.txt (Lightning's demo downloads it; shardwise never downloads)."""
    os.makedirs(folder, exist_ok=True)
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(20)) for i in range(n_words // 20)]
    with open(os.path.join(folder, "train.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a fresh directory: the seeds' Trainers write logs / checkpoints to the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
