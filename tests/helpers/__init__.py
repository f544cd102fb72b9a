"""Helpers the test files share: plain modules, importable as `helpers.<name>` through pyproject's
[tool.pytest.ini_options] pythonpath (tests/), in pytest and in the worker processes tests spawn
(they inherit sys.path). Fixtures stay in conftest.py; a module named conftest is not importable
by name from a worker, so nothing here imports one.

  lm             the demo language model runs, a per-step loss recorder, a tiny GPT on counting data
  hf             a tiny local Llama, its tokenizer and chat data (nothing downloaded), the recipe's flags
  checkpoints    full model / optimizer state of a run, and an exact comparison of two
  strict_device  a CPU stand-in for "NCCL only moves CUDA tensors"
  seeds          the seed documents' stand-in data
  collective_counts  the collectives per optimizer step per strategy (counted in training, priced by the planner)
  trainers       quiet_trainer: a one-process CPU Trainer without logger, progress bar or checkpoints
  selection      the selected parameters of a module's tests, for fixtures that run them in one launch
"""
