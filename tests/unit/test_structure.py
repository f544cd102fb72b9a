"""The code's structure rules hold (`python .ci/structure.py --check`), and the check sees what it must.

The check is the one place the layer table lives (docs/architecture.md must agree with it). Its import
graph counts imports inside functions too: the second test builds a small package in which the only
upward import and the only circle hide in functions, and the check must name both.
"""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, ".ci", "structure.py")


def _structure():
    spec = importlib.util.spec_from_file_location("structure_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_structure_check_passes():
    done = subprocess.run([sys.executable, SCRIPT, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, "python .ci/structure.py --check failed:\n" + done.stdout + done.stderr


def test_check_sees_imports_inside_functions(tmp_path, monkeypatch):
    package = tmp_path / "shardwise"
    (package / "checkpoint").mkdir(parents=True)
    (package / "recipes").mkdir()
    files = {
        "__init__.py": "",
        "checkpoint/__init__.py": "from shardwise.checkpoint.formats import save\n",
        # upward (checkpoint I/O -> commands) and relative, inside a function
        "checkpoint/formats.py": "def save():\n    from ..recipes import hf_model\n    return hf_model\n",
        # a circle through functions only
        "checkpoint/reader.py": "def read():\n    from shardwise.checkpoint import layout\n    return layout\n",
        "checkpoint/layout.py": "def name():\n    from . import reader\n    return reader\n",
        "recipes/__init__.py": "",
        "recipes/hf_model.py": "",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    structure = _structure()
    monkeypatch.setattr(structure, "SRC", package)
    found = structure.imports()
    assert sum(i.in_function for i in found) == 3
    assert structure.upward_imports(found) == [
        "checkpoint/formats.py:2 imports recipes/hf_model.py (checkpoint I/O and model converters -> commands)"
        " [in a function]"
    ]
    # checkpoint/__init__ importing its own formats.py to re-export it is no circle; reader <-> layout is one.
    assert [members for members, _ in structure.circles(found)] == [["checkpoint/layout.py", "checkpoint/reader.py"]]
