"""`shardwise demo` runs where the machine can: accelerator "auto", not a hard-coded CPU (issue 15).

Here (no CUDA) "auto" resolves to CPU processes over gloo and the table
still prints; on a GPU machine the same command now trains on the GPUs.
"""

import inspect

import pytest
import torch

from shardwise.cli.demo import demo


def test_demo_defaults_to_auto_and_prints_its_table(tmp_path, capsys):
    assert inspect.signature(demo).parameters["accelerator"].default == "auto"
    rows = demo(
        devices=2,
        steps=3,
        compare_steps=3,
        nlayers=1,
        nhid=32,
        ninp=16,
        nhead=2,
        batch_size=2,
        block_size=8,
        strategies=["fsdp", "ddp"],
        root_dir=str(tmp_path),
    )
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert [r["device"] for r in rows] == [expected, expected]
    out = capsys.readouterr().out
    assert "FSDP FULL_SHARD" in out and "DDP" in out
    assert ("GPU" if expected == "cuda" else "2 CPU processes") in out


def test_demo_refuses_an_unknown_accelerator_before_starting_processes(tmp_path):
    with pytest.raises(ValueError, match="accelerator"):
        demo(devices=2, accelerator="tpu", root_dir=str(tmp_path))
