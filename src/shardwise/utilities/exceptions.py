"""The exception names Lightning scripts raise and catch (`lightning.pytorch.utilities.exceptions`).

A template that raises `MisconfigurationException` for a bad setting, or a
script that catches it, ports by the import rename. shardwise's own checks
raise ValueError / TypeError; MisconfigurationException is an Exception as in
Lightning, for the user's code.
"""

from __future__ import annotations


class MisconfigurationException(Exception):
    """A setting that cannot work (Lightning's name)."""


class SIGTERMException(SystemExit):
    """Lightning raises it when a SIGTERM arrives. Never raised here: a preemption signal (SIGTERM among them)
    ends fit after the step in progress, saved, with exit code 75."""
