"""benchmarks/charts.py draws the docs' demo-memory chart from given figures (no demo run) into a real PNG.

The figures are the shape `shardwise demo` returns (name, peak bytes, breakdown per category); the PNG is
opened with Pillow, so a file matplotlib did not finish, or one that is not an image, fails. The command
line's `--demo-json` path (redraw from saved figures) is the one docs/charts.md gives.
"""

from __future__ import annotations

import json

import charts
import pytest
from PIL import Image

MIB = 2**20


def _rows():
    def row(name, params, grads, optim, activ):
        breakdown = dict(parameters=params * MIB, gradients=grads * MIB, optimizer=optim * MIB, activations=activ * MIB)
        return dict(name=name, peak=sum(breakdown.values()), breakdown=breakdown)

    return [
        row("ddp", 30, 30, 60, 33),
        row("fsdp_no_shard", 30, 0, 60, 42),
        row("fsdp", 25, 0, 30, 33),
        row("fsdp_ac", 15, 24, 30, 9),
    ]


def _assert_png(path, min_width=600):
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.width >= min_width and image.height >= 300
        # not a blank canvas: the bars' colours are there besides the white background
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 10


def test_demo_memory_chart_writes_a_png(tmp_path):
    path = charts.demo_memory_chart(_rows(), str(tmp_path / "demo.png"), where="2 CPU processes")
    _assert_png(path)


def test_demo_memory_chart_from_saved_json_on_the_command_line(tmp_path):
    saved = tmp_path / "demo_memory.json"
    saved.write_text(json.dumps(dict(devices=2, rows=_rows())))
    assert charts.main(["--only", "demo", "--demo-json", str(saved), "--out", str(tmp_path / "img")]) == 0
    _assert_png(tmp_path / "img" / "demo_memory.png")


def test_demo_memory_chart_refuses_what_it_cannot_draw(tmp_path):
    with pytest.raises(ValueError, match="unknown strategies \\['zero9'\\]"):
        charts.demo_memory_chart([dict(name="zero9", peak=1, breakdown={})], str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="no rows"):
        charts.demo_memory_chart([], str(tmp_path / "x.png"))
