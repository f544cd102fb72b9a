"""MkDocs hooks: the pages whose text is generated when the site is built (docs/WRITING.md).

- docs/cli.md: the line `<!-- cli-reference -->` becomes every `shardwise <command> --help`,
  rendered from the jsonargparse parser the command itself parses with
  (`shardwise.cli.<command>.parser()`), so the reference cannot drift from the CLI.
- `<!-- include: FILE -->` on a line of its own becomes FILE's text (a path relative to the
  repository's root; docs/benchmarks.md includes BENCHMARKS.md this way), its headings one level
  deeper so the page keeps one title, and a blank line before a list that follows a paragraph line
  (GitHub renders such a list; Python-Markdown would run it into the paragraph).
"""

from __future__ import annotations

import importlib
import os
import re

CLI_MARK = re.compile(r"^<!-- cli-reference -->$", re.MULTILINE)  # on a line of its own
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)
LIST_ITEM = re.compile(r"([-*]|\d+\.) ")
WIDTH = "100"  # argparse wraps help at $COLUMNS: fixed, so the page does not depend on the terminal


def cli_reference() -> str:
    from shardwise.cli import COMMANDS

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        sections = []
        for name, summary in COMMANDS.items():
            parser = importlib.import_module(f"shardwise.cli.{name}").parser()
            parser.prog = f"shardwise {name}"
            sections.append(
                f"## shardwise {name}\n\n{summary[0].upper() + summary[1:]}.\n\n```text\n{parser.format_help()}```\n"
            )
        return "\n".join(sections)
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns


def include(match: re.Match, root: str) -> str:
    lines, fenced = [], False
    for line in open(os.path.join(root, match.group(1)), encoding="utf-8").read().splitlines():
        fenced ^= line.lstrip().startswith(("```", "~~~"))
        if not fenced and LIST_ITEM.match(line) and lines and lines[-1].strip() and not LIST_ITEM.match(lines[-1]):
            if not lines[-1].startswith(" "):  # GitHub starts a list under a paragraph line; Markdown needs a gap
                lines.append("")
        lines.append("#" + line if re.match(r"#+ ", line) and not fenced else line)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = os.path.dirname(config.config_file_path)
    if CLI_MARK.search(markdown):
        markdown = CLI_MARK.sub(lambda _: cli_reference(), markdown)
    return INCLUDE.sub(lambda match: include(match, root), markdown)
