"""The planner's one error type, in a module of its own so every part of plan/ can raise it.

`PlanError` is a ValueError: a mistake in what the user asked the planner (an unknown preset, a config
it cannot read, a layout that cannot run), one line naming the value and the fix. It sat in
presets.py, which made any module that raises it import the presets, and the presets (which build the
LoRA model through plan/adapters.py) import them back; here it depends on nothing.
"""

from __future__ import annotations


class PlanError(ValueError):
    """The planner's input cannot be planned (unknown preset, bad config, impossible layout)."""
