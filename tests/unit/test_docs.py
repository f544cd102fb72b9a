"""The documentation builds and its code runs (issue 26 item 1).

`mkdocs build --strict` builds the site from docs/ into a temporary folder: a broken link or
anchor, a page missing from the nav or an API entry that does not resolve fails it. Every Python
block in README.md and docs/ says whether it runs (docs/WRITING.md: `<!-- run -->`,
`<!-- run: continue -->`, `<!-- run: replace "A" with "B" -->`, `<!-- no-run: why -->`), and the
marked blocks run here, scaled down where their page says so. README.md stays a short entry page
that starts with the two set-up commands `.ci/run` and the fresh-machine check read. Without running
anything: every `shardwise <command> --option` shown is a real option, and the tables that mirror the
code (Trainer arguments, finetune options, SHARDWISE_* variables) have a row for each (WRITING.md).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import subprocess
import sys
from typing import List, Optional, Tuple

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(ROOT, "README.md")
SETUP_COMMANDS = [
    'pip install "torch==2.13.0" -e . && shardwise demo',
    'pip install "torch==2.13.0" -e ".[test]" -c constraints.txt && python -m pytest tests',
]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(run|no-run)\s*(?::\s*(.*?))?\s*-->\s*$")
REPLACE = re.compile(r'^replace "([^";]*)" with "([^";]*)"$')
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
BLOCK_TIMEOUT_S = 120
# Blocks see the commands an installed user has on PATH (`shardwise`, this `python`).
ENV = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository's root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    run: bool = False
    continues: bool = False
    replacements: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    problem: Optional[str] = None  # a marker that is missing or malformed

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def runnable_code(self) -> str:
        code = self.code
        for old, new in self.replacements:
            code = code.replace(old, new)
        return code


def pages() -> List[str]:
    found = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [README] + found


def read_marker(block: Block, marker: Optional[str]) -> None:
    if marker is None:
        if block.lang in PYTHON:
            block.problem = "a Python block without <!-- run --> or <!-- no-run: why --> on the line above it"
        return
    kind, options = MARKER.match(marker).groups()
    if kind == "no-run":
        if not options:
            block.problem = "<!-- no-run --> without a reason: write <!-- no-run: why -->"
        return
    if block.lang not in PYTHON | SHELL:
        block.problem = f"<!-- run --> on a {block.lang or 'plain'} block: only python and bash blocks run"
        return
    block.run = True
    for option in filter(None, (part.strip() for part in (options or "").split(";"))):
        replace = REPLACE.match(option)
        if option == "continue":
            block.continues = True
        elif replace:
            block.replacements.append(replace.groups())
        else:
            block.problem = f'unknown run option {option!r}: use continue or replace "A" with "B"'
    for old, _ in block.replacements:
        if old not in block.code:
            block.problem = f"replace {old!r}: the block has no such text (the substitution is stale)"


def parse(path: str) -> List[Block]:
    """The fenced blocks of a Markdown file with the marker on the line above each (nested fences skipped)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, lang = opening.groups()
        body, j = [], i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing.group(2)[0] == fence[0] and len(closing.group(2)) >= len(fence):
                if not closing.group(3):
                    break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        previous = lines[i - 1] if i > 0 else ""
        block = Block(os.path.relpath(path, ROOT), i + 1, lang.lower(), "\n".join(body) + "\n")
        read_marker(block, previous if MARKER.match(previous) else None)
        blocks.append(block)
        i = j + 1
    return blocks


def all_blocks() -> List[Block]:
    return [block for page in pages() for block in parse(page)]


def groups() -> List[List[Block]]:
    """A `run` block and the `continue` blocks after it on the same page, in order."""
    out: List[List[Block]] = []
    for block in all_blocks():
        if not block.run or block.problem:
            continue
        if block.continues and out and out[-1][0].page == block.page:
            out[-1].append(block)
        else:
            out.append([block])
    return out


# --------------------------------------------------------------------------------------- README
def test_readme_is_short_and_starts_with_the_two_setup_commands():
    lines = open(README, encoding="utf-8").read().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; move the text into a docs/ page"
    first_block = lines[lines.index("```bash") + 1 :]
    assert first_block[:3] == SETUP_COMMANDS + ["```"], "README.md's first block must be the two set-up commands"
    assert all(not line.startswith("```") for line in lines[: lines.index("```bash")])


def test_readme_links_point_at_files_that_exist():
    text = open(README, encoding="utf-8").read()
    links = [link.split("#")[0] for link in re.findall(r"\]\(([^)]+)\)", text) if "://" not in link]
    assert links and all(os.path.exists(os.path.join(ROOT, link)) for link in links), [
        link for link in links if not os.path.exists(os.path.join(ROOT, link))
    ]


def test_readme_example_is_the_getting_started_example():
    readme = next(block for block in parse(README) if block.lang in PYTHON)
    page = next(block for block in parse(os.path.join(ROOT, "docs", "getting-started.md")) if block.lang in PYTHON)
    assert readme.code == page.code, "README.md's first example and docs/getting-started.md's differ: keep them equal"
    assert readme.run, "README.md's first example runs (docs/getting-started.md's copy is no-run)"


def test_every_python_block_says_whether_it_runs():
    problems = [f"{block.where}: {block.problem}" for block in all_blocks() if block.problem]
    assert not problems, "see docs/WRITING.md, 'Code blocks':\n" + "\n".join(problems)


def test_a_continue_block_has_a_block_to_continue():
    seen = set()
    for block in all_blocks():
        if block.run and block.continues:
            assert block.page in seen, f"{block.where}: run: continue, but no run block before it on the page"
        if block.run:
            seen.add(block.page)


# ---------------------------------------------------------------------------------- the blocks
# A Python block runs as `python block.py` would, but forked from this warm process, which has imported
# torch and shardwise once (about 2 s a block saved). It has run nothing else, so no thread pool exists
# to break in the fork; each block gets its own process group, directory, argv, sys.path[0] and
# __main__ (runpy), so `Trainer(devices=2)` re-runs `python block.py` for its workers as for a user.
RUNNER = r"""
import atexit, json, os, runpy, signal, sys, time, traceback
import torch, shardwise

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setpgrp()
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1), os.dup2(log, 2), os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # stdin: not the jobs
        os.chdir(job["cwd"])
        sys.argv, sys.path[0], status = [job["script"]], job["cwd"], 0
        try:
            runpy.run_path(job["script"], run_name="__main__")
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
            status = 1
        atexit._run_exitfuncs()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    deadline, done = time.monotonic() + job["timeout"], None
    while done is None:
        waited, code = os.waitpid(pid, os.WNOHANG)
        if waited:
            done = os.waitstatus_to_exitcode(code)
        elif time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            done = "timeout"
        else:
            time.sleep(0.02)
    print(json.dumps(done), flush=True)
"""


@pytest.fixture(scope="module")
def runner():
    process = subprocess.Popen(
        [sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=ENV
    )
    yield process
    process.stdin.close()
    process.wait(timeout=60)


def run_script(runner, script: str, folder: str) -> Tuple[object, str]:
    log = os.path.join(folder, os.path.basename(script) + ".log")
    job = {"script": script, "cwd": folder, "log": log, "timeout": BLOCK_TIMEOUT_S}
    runner.stdin.write(json.dumps(job) + "\n")
    runner.stdin.flush()
    answer = runner.stdout.readline()
    assert answer, "the block runner died"
    return json.loads(answer), open(log).read()


def run_group(group: List[Block], folder: str, runner) -> None:
    os.symlink(os.path.join(ROOT, "examples"), os.path.join(folder, "examples"))
    steps: List[List[Block]] = []
    for block in group:  # consecutive Python blocks are one script; a shell block runs by itself
        if block.lang in PYTHON and steps and steps[-1][-1].lang in PYTHON:
            steps[-1].append(block)
        else:
            steps.append([block])
    for n, blocks in enumerate(steps):
        if blocks[0].lang in PYTHON:
            script = f"block{n}.py"
            with open(os.path.join(folder, script), "w") as f:
                f.write("\n".join(f"# {b.where}\n{b.runnable_code()}" for b in blocks))
            status, output = run_script(runner, script, folder)
        else:
            command = ["bash", "-eo", "pipefail", "-c", blocks[0].runnable_code()]
            try:
                done = subprocess.run(
                    command, cwd=folder, env=ENV, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
                )
                status, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:
                status, output = "timeout", f"{exc.stdout}\n{exc.stderr}"
        if status == "timeout":
            pytest.fail(f"{blocks[0].where}: did not finish within {BLOCK_TIMEOUT_S} s\n{output[-4000:]}")
        if status != 0:
            pytest.fail(f"{blocks[0].where}: exit status {status}\n{output[-4000:]}")


@pytest.mark.parametrize("group", groups(), ids=lambda group: group[0].where)
def test_marked_block_runs(group, tmp_path, runner):
    run_group(group, str(tmp_path), runner)


def test_the_markers_mean_what_writing_md_says(tmp_path, runner):
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- run: replace "big" with "small" -->\n```python\nsize = "big"\n```\n'
        "<!-- run: continue -->\n```python\nassert size == 'small', size\n```\n"
        '<!-- run: replace "gone" with "x" -->\n```python\npass\n```\n'
        "````markdown\n```python\nnot a block of the page\n```\n````\n"
        "```python\nunmarked = True\n```\n<!-- no-run -->\n```python\nx\n```\n"
        "<!-- run -->\n```python\nraise SystemExit(3)\n```\n"
    )
    first, second, stale, nested, unmarked, reasonless, failing = parse(str(page))
    assert first.run and second.continues and not first.problem and not second.problem
    assert "stale" in stale.problem and nested.lang == "markdown" and "```python" in nested.code
    assert "without <!-- run -->" in unmarked.problem and "without a reason" in reasonless.problem
    for folder in ("ok", "fails"):
        os.mkdir(tmp_path / folder)
    run_group([first, second], str(tmp_path / "ok"), runner)  # substituted, and one script for both
    with pytest.raises(pytest.fail.Exception, match="exit status 3"):
        run_group([failing], str(tmp_path / "fails"), runner)


def shardwise_commands(page: str) -> List[Tuple[str, List[str]]]:
    """Each `shardwise <command> ...` in a page's shell blocks and inline code: (where, its words)."""
    lines = [(b.where, b.code.replace("\\\n", " ")) for b in parse(page) if b.lang in SHELL]
    prose = re.sub(r"```.*?```", "", open(page, encoding="utf-8").read(), flags=re.S)
    lines += [(os.path.relpath(page, ROOT), span) for span in re.findall(r"`(shardwise [^`]*--[^`]+)`", prose)]
    found = []
    for where, text in lines:
        for line in text.replace("\n", " \n ").split("\n"):
            words = [w.strip("[]") for w in shlex.split(line.split(" #")[0].replace("|", " "))]
            starts = [i for i, word in enumerate(words) if word == "shardwise"] + [len(words)]
            found += [(where, words[a + 1 : b]) for a, b in zip(starts, starts[1:]) if b > a + 1]
    return found


def test_shardwise_commands_in_the_docs_use_real_options():
    """No run needed: every option a page shows is one the command's parser (or its translations) takes."""
    import importlib

    from shardwise.cli import COMMANDS, _flags, normalise

    wrong = []
    for page in pages():
        for where, (name, *words) in shardwise_commands(page):
            if name.startswith("<"):  # `shardwise <command> --help`: a placeholder
                continue
            if name not in COMMANDS:
                wrong.append(f"{where}: no command `shardwise {name}`")
                continue
            command = importlib.import_module(f"shardwise.cli.{name}")
            parser = command.parser()
            known = {option for action in parser._actions for option in action.option_strings}
            args = normalise(words, _flags(parser), getattr(command, "PASSTHROUGH", False))
            for file_option in ("--fsdp_config", "--config_file"):  # they read a file the page only names
                while file_option in args:
                    del args[args.index(file_option) : args.index(file_option) + 2]
            args = command.translate(args) if hasattr(command, "translate") else args
            for arg in args:
                option = arg.split("=")[0]
                if arg.startswith("--") and option not in known and option.split(".")[0] not in known:
                    wrong.append(f"{where}: `shardwise {name}` has no option {option}")
    assert not wrong, "\n".join(wrong)


def test_trainer_signature_on_the_trainer_page_names_every_argument():
    import inspect

    from shardwise import Trainer

    text = open(os.path.join(ROOT, "docs", "trainer.md"), encoding="utf-8").read()
    block = text[text.index("Trainer(accelerator=") :]
    block = block[: block.index("```")]
    missing = [name for name in inspect.signature(Trainer).parameters if not re.search(rf"\b{name}=", block)]
    assert not missing, f"docs/trainer.md's Trainer(...) block lacks {missing}: add them, with a line saying where"


def test_every_environment_variable_shardwise_reads_is_documented():
    names = set()
    for path in glob.glob(os.path.join(ROOT, "src", "shardwise", "**", "*.py"), recursive=True):
        names |= set(re.findall(r"SHARDWISE_[A-Z][A-Z0-9_]*", open(path, encoding="utf-8").read()))
    table = open(os.path.join(ROOT, "docs", "launching.md"), encoding="utf-8").read()
    missing = sorted(name for name in names if f"`{name}" not in table)
    assert names and not missing, f"{missing}: add them to docs/launching.md's table"


def test_finetuning_options_table_has_every_option():
    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig

    text = open(os.path.join(ROOT, "docs", "finetuning.md"), encoding="utf-8").read()
    table = text[text.index("\n## Options\n") :]
    table = table[: table.index("\n## ", 1)]
    rows = {line.split("|")[1] for line in table.splitlines() if line.startswith("| `")}
    named = set(re.findall(r"`(\w+)`", " ".join(rows).replace("adam_beta1/2", "adam_beta1`, `adam_beta2")))
    fields = {f.name for f in dataclasses.fields(FinetuneConfig) + dataclasses.fields(DataOptions)} - {"data"}
    assert fields <= named, f"docs/finetuning.md's Options table has no row for {sorted(fields - named)}"


# ----------------------------------------------------------------------------------- the site
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("site"))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", folder],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),  # Material's notice about its successor
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return folder


def html(site: str, page: str) -> str:
    return open(os.path.join(site, page, "index.html"), encoding="utf-8").read()


def test_site_builds_strict_with_the_cli_and_api_reference(site):
    from shardwise.cli import COMMANDS

    cli = html(site, "cli")
    for name in COMMANDS:
        assert f"usage: shardwise {name}" in cli, f"the CLI reference has no `shardwise {name} --help`"
    assert "<!-- cli-reference -->" not in cli and "usage: shardwise demo" not in html(site, "WRITING")
    trainer = html(site, "api/trainer")
    assert "estimated_stepping_batches" in trainer and 'id="shardwise.Trainer"' in trainer
    assert "benchmarks" in os.listdir(site) and "<!-- include:" not in html(site, "benchmarks")
