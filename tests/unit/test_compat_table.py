"""The "Coming from Lightning / Accelerate / the HF FSDP recipe" table cannot drift (issue 12, item 5)."""

from __future__ import annotations

import os

import pytest

from shardwise.recipes import hf_args
from shardwise.strategies import fsdp_compat

from helpers import coming_from as compat

README = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "coming-from.md")  # README's table moved here


@pytest.mark.parametrize("row", [r for r in compat.ROWS if r.check], ids=lambda r: f"{r.source}: {r.theirs}"[:60])
def test_every_row_means_what_it_says(row):
    assert row.check() is True


def test_every_accepted_name_has_a_row():
    table = compat.render_table()
    for name in list(fsdp_compat.NOTHING_TO_DO) + list(hf_args.NOT_HONOURED) + list(hf_args.RENAMED):
        if name in ("config", "model_name_or_path", "log_level_replica", "do_train", "do_eval", "hub_model_id"):
            continue  # self-explanatory spellings, covered by their neighbours' rows
        assert name in table, name


def test_readme_carries_the_rendered_table():
    text = open(README).read()
    assert compat.MARK_START in text, (
        "docs/coming-from.md has no compat-table block; run `python tests/helpers/coming_from.py`"
    )
    block = text[text.index(compat.MARK_START) : text.index(compat.MARK_END) + len(compat.MARK_END)]
    assert block == compat.render_block(), (
        "docs/coming-from.md's table is stale: paste `python tests/helpers/coming_from.py` into it"
    )
