"""Re-measure the code's structure (issue: one parallel plan): file sizes, private members used
across modules, environment variables read in src/, and imports of the Trainer from below it.

    python .ci/structure.py          # the report
    python .ci/structure.py --check  # exit 1 when a limit is broken (600 lines a file, 5 private names)
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
from collections import defaultdict

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "shardwise"
MAX_LINES, MAX_PRIVATE = 600, 5
# Packages above the Trainer (they may import it): the CLI, the recipes, `shardwise check`, the demo, the package root.
ABOVE_TRAINER = ("cli", "recipes", "scaling", "demos.py", "__init__.py", "trainer")


def files():
    return sorted(p for p in SRC.rglob("*.py"))


def rel(p):
    return p.relative_to(SRC).as_posix()


def private_defs():
    """`_name` -> modules defining it (methods, attributes set on self, functions, module constants)."""
    defs = defaultdict(set)
    for p in files():
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs[node.name].add(rel(p))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                defs[node.attr].add(rel(p))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defs[node.id].add(rel(p))
    return {k: v for k, v in defs.items() if k.startswith("_") and not k.startswith("__")}


def private_uses_across_modules():
    """Private names (`x._name` attribute reads or `from m import _name`) used in a module that does not define them."""
    defs = private_defs()
    uses = defaultdict(set)
    for p in files():
        tree = ast.parse(p.read_text())
        here = rel(p)
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                # self._x / cls._x inside the defining module is internal; obj._x from elsewhere is not
                name = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shardwise"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        uses[alias.name].add(here)
                continue
            if name and name in defs and here not in defs[name]:
                uses[name].add(here)
    return dict(sorted(uses.items()))


def env_reads():
    pattern = re.compile(r"""environ(?:\.get)?\s*[\[(]\s*["']([A-Z0-9_]+)["']|getenv\(\s*["']([A-Z0-9_]+)["']""")
    out = defaultdict(set)
    for p in files():
        for m in pattern.finditer(p.read_text()):
            out[m.group(1) or m.group(2)].add(rel(p))
    # names held in module constants (X_ENV = "SHARDWISE_...") and read through them
    const = re.compile(r"""^([A-Z_]+_ENV)\s*=\s*["']([A-Z0-9_]+)["']""", re.M)
    for p in files():
        text = p.read_text()
        for m in const.finditer(text):
            if re.search(rf"environ(?:\.get)?\s*[\[(]\s*{m.group(1)}\b|getenv\(\s*{m.group(1)}\b", text) or any(
                re.search(rf"environ(?:\.get)?\s*[\[(]\s*(?:\w+\.)?{m.group(1)}\b", q.read_text()) for q in files()
            ):
                out[m.group(2)].add(rel(p))
    return dict(sorted(out.items()))


def trainer_imports_from_below():
    bad = []
    for p in files():
        here = rel(p)
        if here.startswith(ABOVE_TRAINER):
            continue
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            if any(m == "shardwise.trainer" or m.startswith("shardwise.trainer.") or m == "shardwise.Trainer"
                   for m in mods):
                bad.append(f"{here}:{node.lineno}")
    return bad


def main() -> int:
    check = "--check" in sys.argv
    sizes = sorted(((len(p.read_text().splitlines()), rel(p)) for p in files()), reverse=True)
    over = [(n, f) for n, f in sizes if n > MAX_LINES]
    print(f"largest files in src/ (limit {MAX_LINES}):")
    for n, f in sizes[:8]:
        print(f"  {n:5d}  {f}")
    priv = private_uses_across_modules()
    print(f"\nprivate members used across modules: {len(priv)} (limit {MAX_PRIVATE})")
    for name, where in priv.items():
        print(f"  {name:28s} {', '.join(sorted(where))}")
    env = env_reads()
    print(f"\nenvironment variables read in src/: {len(env)}")
    for name, where in env.items():
        print(f"  {name:32s} {', '.join(sorted(where))}")
    below = trainer_imports_from_below()
    print(f"\nimports of the Trainer from below it: {len(below)}")
    for b in below:
        print(f"  {b}")
    broken = bool(over) or len(priv) > MAX_PRIVATE or bool(below)
    return 1 if (check and broken) else 0


if __name__ == "__main__":
    sys.exit(main())
