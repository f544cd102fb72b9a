"""ruff's lint and format checks (configured in pyproject.toml) over the code, as part of the suite."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATHS = ["src", "tests", "benchmarks", "examples"]


def _ruff(*args):
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0
    ):
        pytest.fail("ruff is not installed: it is in the test extras (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_lint():
    done = _ruff("check", "--output-format", "concise")
    assert done.returncode == 0, done.stdout + done.stderr


def test_format():
    done = _ruff("format", "--check")
    assert done.returncode == 0, "run `ruff format " + " ".join(PATHS) + "`:\n" + done.stdout + done.stderr
