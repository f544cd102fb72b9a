"""The seed documents' code, run with only imports and sizes changed (issue 12).

Each test_seed_NNN.py takes the code blocks of one document in order. What
changed besides imports and sizes is commented at the line (e.g. CUDA-only
calls on this CPU machine). Code that needs two processes runs under
shardwise.launch(fn, devices=2): Trainer(devices=2) in a pytest process does
not start its own workers.
"""

import pytest


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a fresh directory: the seeds' Trainers write logs / checkpoints to the working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path
