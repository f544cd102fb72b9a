"""Re-measure the code's structure: file sizes, private members used across modules, environment
variables read in src/, and which way the imports flow.

    python .ci/structure.py          # the report
    python .ci/structure.py --check  # exit 1 when a rule is broken

The rules --check enforces: no file in src/ over 600 lines; at most 5 private names used outside the
module that defines them; every module sits in a layer of `LAYERS` (the one list of layers; the table
in docs/architecture.md must list the same packages in the same layers); no import points upward; no
circle of imports. The import graph counts every `import` / `from ... import` of shardwise anywhere in
a file, inside functions too (a function-level import runs the same code, only later), relative ones
resolved. A package's `__init__` importing its own submodules to re-export them is no circle; a
submodule importing its package's `__init__` that imports it back is one.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "shardwise"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES, MAX_PRIVATE = 600, 5
# Top imports bottom only. Each entry is a package (`cli/`) or a top-level module (`step.py`) of
# src/shardwise; `__init__.py` is the package root. docs/architecture.md's layer table lists the same.
LAYERS = (
    ("commands", ("cli/", "recipes/", "scaling/", "smoke/", "demos/", "plugins/", "tuner.py", "__init__.py")),
    ("the loop", ("trainer/",)),
    ("planning", ("plan/",)),
    (
        "run state",
        ("callbacks/", "loggers/", "metrics.py", "module.py", "module_hooks.py", "module_weights.py", "core.py"),
    ),
    ("models", ("models/",)),
    ("engines", ("strategies/",)),
    ("checkpoint I/O and model converters", ("checkpoint/", "adapters/")),
    (
        "step core",
        ("step.py", "health.py", "losses.py", "precision.py", "memory/", "flops.py", "data.py", "state.py",
         "dtypes.py", "seed.py", "sysmem.py", "fqn.py", "ulysses.py", "sdpa.py", "expert_parallel.py", "utilities/",
         "corpus/"),
    ),
    ("processes", ("distributed/", "_version.py")),
)
# Documented import paths kept after their code moved up a layer: file -> the module it re-exports. Such a
# file may import only that module (nothing else, no code of its own), and nothing in src/ may import it;
# its one import is then no dependency of its layer and is not counted as upward.
ALIASES = {"adapters/export.py": "recipes/lora_export.py"}
# Packages above the Trainer (they may import it): the CLI, the recipes, `shardwise check`, the demo, the package root,
# the GPU smoke test (python -m shardwise.smoke).
ABOVE_TRAINER = ("cli", "recipes", "scaling", "demos", "__init__.py", "trainer", "smoke")


def files():
    return sorted(p for p in SRC.rglob("*.py"))


@functools.lru_cache(maxsize=None)
def text_of(p):
    return p.read_text()


@functools.lru_cache(maxsize=None)
def tree_of(p):
    return ast.parse(text_of(p))


def rel(p):
    return p.relative_to(SRC).as_posix()


def private_defs():
    """`_name` -> modules defining it (methods, attributes set on self, functions, module constants)."""
    defs = defaultdict(set)
    for p in files():
        tree = tree_of(p)
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
        tree = tree_of(p)
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
        for m in pattern.finditer(text_of(p)):
            out[m.group(1) or m.group(2)].add(rel(p))
    # names held in module constants (X_ENV = "SHARDWISE_...") and read through them
    const = re.compile(r"""^([A-Z_]+_ENV)\s*=\s*["']([A-Z0-9_]+)["']""", re.M)
    for p in files():
        text = text_of(p)
        for m in const.finditer(text):
            if re.search(rf"environ(?:\.get)?\s*[\[(]\s*{m.group(1)}\b|getenv\(\s*{m.group(1)}\b", text) or any(
                re.search(rf"environ(?:\.get)?\s*[\[(]\s*(?:\w+\.)?{m.group(1)}\b", text_of(q)) for q in files()
            ):
                out[m.group(2)].add(rel(p))
    return dict(sorted(out.items()))


def trainer_imports_from_below():
    bad = []
    for p in files():
        here = rel(p)
        if here.startswith(ABOVE_TRAINER):
            continue
        tree = tree_of(p)
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


# ------------------------------------------------------------------ imports: layers and circles
def module_name(p):
    """shardwise.checkpoint.convert for src/shardwise/checkpoint/convert.py; a package is its `__init__`."""
    parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_entry(p):
    """The LAYERS entry a file belongs to: its top-level package (`plan/`) or its own name (`step.py`)."""
    parts = p.relative_to(SRC).parts
    return parts[0] + "/" if len(parts) > 1 else parts[0]


def layer_of():
    return {entry: i for i, (_, entries) in enumerate(LAYERS) for entry in entries}


class Import:
    def __init__(self, source, line, target, in_function):
        self.source, self.line, self.target, self.in_function = source, line, target, in_function


def imports():
    """Every import of a shardwise module in src/ (module level and inside functions), resolved to the file
    it runs: `from shardwise.checkpoint import adapters` is checkpoint/adapters.py, `from shardwise.checkpoint
    import open_checkpoint` is checkpoint/__init__.py. The parent packages Python imports on the way are not
    counted: they are no dependency the importing code chose."""
    by_name = {module_name(p): p for p in files()}
    out = []
    for p in files():
        here = module_name(p)
        package = here if p.name == "__init__.py" else here.rpartition(".")[0]
        tree = tree_of(p)
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in by_name else module for a in node.names]
            for target in dict.fromkeys(targets):
                if target.split(".")[0] != "shardwise":
                    continue
                while target not in by_name:
                    target = target.rpartition(".")[0]
                if by_name[target] != p:
                    out.append(Import(p, node.lineno, by_name[target], id(node) in in_function))
    return out


def alias_problems(found):
    """How the ALIASES files break their rule (they hold more than the re-export, or src/ imports them)."""
    out = []
    for alias, target in ALIASES.items():
        path = SRC / alias
        if not path.exists():
            out.append(f"{alias}: listed in ALIASES but missing (drop it from ALIASES)")
            continue
        body = ast.parse(path.read_text()).body
        body = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body
        if not all(isinstance(node, ast.ImportFrom) and node.module == module_name(SRC / target) for node in body):
            out.append(f"{alias}: an alias holds only `from {module_name(SRC / target)} import ...`")
        users = [i for i in found if i.target == path]
        out += [f"{rel(i.source)}:{i.line} imports the alias {alias} (import {target})" for i in users]
    return out


def upward_imports(found):
    """`file:line imports X (layer A -> layer B)` for each import of a layer above the importing file's."""
    layers = layer_of()
    bad = []
    for imp in found:
        if rel(imp.source) in ALIASES and rel(imp.target) == ALIASES[rel(imp.source)]:
            continue
        a, b = layers.get(layer_entry(imp.source)), layers.get(layer_entry(imp.target))
        if a is not None and b is not None and b < a:
            bad.append(
                f"{rel(imp.source)}:{imp.line} imports {rel(imp.target)} ({LAYERS[a][0]} -> {LAYERS[b][0]})"
                + (" [in a function]" if imp.in_function else "")
            )
    return sorted(set(bad))


def unplaced():
    """Packages and top-level modules of src/shardwise that no layer of LAYERS lists."""
    layers = layer_of()
    return sorted({layer_entry(p) for p in files()} - set(layers))


def circles(found):
    """Each strongly connected component (two or more modules importing each other, directly or
    around), with the imports inside it."""
    graph = defaultdict(set)
    for imp in found:
        graph[imp.source].add(imp.target)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(files())))
    for v in sorted(set(graph)):
        if v not in index:
            visit(v)
    result = []
    for component in sorted(out):
        members = set(component)
        edges = sorted(
            f"{rel(i.source)}:{i.line} imports {rel(i.target)}" + (" [in a function]" if i.in_function else "")
            for i in found
            if i.source in members and i.target in members
        )
        result.append(([rel(m) for m in component], edges))
    return result


def doc_layers():
    """The layer table of docs/architecture.md: [(layer, [package or module, ...]), ...] in its order."""
    rows, in_table = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("| layer |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((cells[0], re.findall(r"`([\w./]+)`", cells[1])))
    return rows


def doc_disagreements():
    """How docs/architecture.md's layer table differs from LAYERS (empty: they agree)."""
    doc = doc_layers()
    want = [(name, sorted(entries)) for name, entries in LAYERS]
    got = [(name, sorted(entries)) for name, entries in doc]
    if got == want:
        return []
    out = []
    if [n for n, _ in got] != [n for n, _ in want]:
        out.append(f"layers in the doc {[n for n, _ in got]} vs structure.py {[n for n, _ in want]}")
    for (name, entries), (_, doc_entries) in zip(want, got):
        if entries != doc_entries:
            missing, extra = sorted(set(entries) - set(doc_entries)), sorted(set(doc_entries) - set(entries))
            out.append(f"layer {name!r}: the doc lacks {missing}, lists {extra} that structure.py does not")
    return out or ["the doc's layer table differs from LAYERS"]


def main() -> int:
    check = "--check" in sys.argv
    sizes = sorted(((len(text_of(p).splitlines()), rel(p)) for p in files()), reverse=True)
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
    found = imports()
    in_functions = [i for i in found if i.in_function]
    statements = {(i.source, i.line) for i in in_functions}
    print(f"\nimports of shardwise modules: {len(found)}, {len(statements)} statements inside functions")
    loose = unplaced()
    print(f"\npackages and modules in no layer: {len(loose)}")
    for entry in loose:
        print(f"  {entry} (add it to LAYERS and to the table in docs/architecture.md)")
    doc = doc_disagreements()
    print(f"\ndocs/architecture.md's layer table against LAYERS: {'agrees' if not doc else 'differs'}")
    for d in doc:
        print(f"  {d}")
    up = upward_imports(found)
    print(f"\nupward imports: {len(up)}")
    for u in up:
        print(f"  {u}")
    aliased = alias_problems(found)
    print(f"\ndocumented paths kept as aliases: {', '.join(f'{a} -> {t}' for a, t in ALIASES.items()) or 'none'}")
    for a in aliased:
        print(f"  {a}")
    rings = circles(found)
    print(f"\ncircles of imports: {len(rings)}")
    for members, edges in rings:
        print(f"  {' <-> '.join(members)}")
        for e in edges:
            print(f"    {e}")
    broken = bool(over) or len(priv) > MAX_PRIVATE or bool(below)
    broken = broken or bool(loose) or bool(doc) or bool(up) or bool(rings) or bool(aliased)
    return 1 if (check and broken) else 0


if __name__ == "__main__":
    sys.exit(main())
