"""`shardwise finetune --devices 2` where rank 0 fails: the user sees rank 0's own error, not a peer's."""
from __future__ import annotations

import os
import subprocess
import sys

from helpers.hf import build_model_folder, chat_records, write_jsonl


def test_rank_0s_own_error_is_what_the_cli_shows(tmp_path):
    records = chat_records(16)
    model = build_model_folder(str(tmp_path / "model"), records)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), records)
    weights = os.path.join(model, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as fh:  # the file ends before the tensor bytes its header promises
        fh.truncate(size - 4096)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "finetune", "--model_path", model, "--dataset", data,
                           "--output_dir", str(tmp_path / "out"), "--devices", "2", "--max_steps", "2",
                           "--max_seq_len", "32"], capture_output=True, text=True, timeout=300, env=env)
    err = proc.stderr
    assert proc.returncode not in (0, None), err[-3000:]
    verdict = err[err.index("shardwise finetune: error: [shardwise] rank 0"):]
    assert "SafetensorError" in verdict.splitlines()[0], err[-3000:]
    # Rank 1 only lost its peer: one line, not a traceback that buries rank 0's.
    assert "rank 1 lost a peer" in err and "Connection closed by peer" not in verdict.split("Traceback")[0]
    assert "shardwise/cli" not in err  # the CLI adds no traceback of its own process
