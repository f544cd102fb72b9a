"""What the torch-version matrix (.ci/torch_matrix.sh) found, kept true on the version the suite runs on.

torch 2.11's CUDA build has a thread with a Python state but no frame, listed ahead of the main thread
in faulthandler's dump: a hung rank's stack must still show the thread that runs Python.
"""

from __future__ import annotations

from shardwise.distributed.faults import trim_stack

DUMP = """Thread 0x00007f8383fff6c0 (most recent call first):
  <no Python frame>

Current thread 0x00007f83a1b2c740 (most recent call first):
  File "/tmp/user_script.py", line 12 in training_step
  File "/src/shardwise/step.py", line 63 in forward_backward

Thread 0x00007f8390000640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait"""


def test_a_hung_ranks_stack_skips_threads_without_python_frames():
    trimmed = trim_stack(DUMP)
    assert trimmed.splitlines()[0].strip() == "Current thread 0x00007f83a1b2c740 (most recent call first):"
    assert "in training_step" in trimmed and "no Python frame" not in trimmed and "threading.py" not in trimmed


def test_a_dump_with_only_frameless_threads_is_kept_as_it_is():
    assert "<no Python frame>" in trim_stack("Thread 0x1 (most recent call first):\n  <no Python frame>")
