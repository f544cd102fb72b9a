"""How the ranks that do not tokenise wait for the one that does, without a collective that could time out.

One rank builds a cache entry (global rank 0; then local rank 0 of a node that
cannot see it) while the others wait. The builder posts its progress -- the
phase, the tokens written, the input done out of its total -- to the process
group's store, which every rank reaches whatever filesystem it has, and to a
progress file beside the entry (`.<key>.progress.json`, gone when the build
ends). A waiting rank reads the store once a second and prints the progress
every 30 s; it waits as long as the progress moves, and fails only when it
stands still for the collective timeout (`timeout_s`), or at once when the
builder posts its failure or the store stops answering (the builder died),
with a message that names the tokenisation and the builder's own error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, Optional

from shardwise.distributed.progress import mark as mark_progress

POLL_S = 1.0
PRINT_EVERY_S = 30.0
WHAT = "tokenising the fine-tuning data"


class DataPreparationError(RuntimeError):
    """The rank that tokenises the data failed, died or stopped making progress (the message says which)."""


def describe(state: Optional[Dict[str, Any]]) -> str:
    """One line: tokens done and the share of the input."""
    if not state:
        return "not started yet"
    text = f"{state.get('phase', '?')}, {state.get('tokens', 0):,} tokens"
    if state.get("total"):
        text += f", {100 * state.get('done', 0) / state['total']:.0f}% of the input"
    return text


class Board:
    """One build's progress, posted by its builder and read by the ranks waiting for it."""

    def __init__(self, store: Any, key: str, progress_file: Optional[str] = None) -> None:
        self.store, self.key, self.progress_file = store, key, progress_file
        self.printed = time.monotonic()

    def post(self, state: Dict[str, Any]) -> None:
        self.store.set(self.key, json.dumps(state))
        if self.progress_file:
            try:  # for people and other runs; the waiting ranks read the store
                if state["phase"] in ("done", "failed"):
                    os.remove(self.progress_file)
                    return
                os.makedirs(os.path.dirname(self.progress_file), exist_ok=True)
                with open(self.progress_file + ".tmp", "w") as fh:
                    json.dump({**state, "time": time.time(), "pid": os.getpid()}, fh)
                os.replace(self.progress_file + ".tmp", self.progress_file)
            except OSError:
                pass

    def read(self) -> Optional[Dict[str, Any]]:
        if not self.store.check([self.key]):
            return None
        return json.loads(self.store.get(self.key))

    def reporter(self, who: str) -> Callable[[Dict[str, Any]], None]:
        """The builder's report function: posts every change, prints a line every PRINT_EVERY_S."""

        def report(state: Dict[str, Any]) -> None:
            self.post(state)
            mark_progress(WHAT, 0)
            if time.monotonic() - self.printed >= PRINT_EVERY_S:
                self.printed = time.monotonic()
                print(f"{who}: {WHAT}: {describe(state)}", file=sys.stderr, flush=True)

        return report


def run_posting(board: Board, who: str, build: Callable[[Callable[[Dict[str, Any]], None]], Any]) -> Any:
    """Run `build(report)` on the building rank, posting its progress, then its end: done, or its error."""
    board.post({"phase": "starting", "tokens": 0})
    try:
        result = build(board.reporter(who))
    except BaseException as exc:
        board.post({"phase": "failed", "error": f"{type(exc).__name__}: {exc}"})
        raise
    board.post({"phase": "done"})
    return result


def wait_for(board: Board, who: str, me: str, stall_s: float, poll_s: float = POLL_S) -> None:
    """Wait until `who` posts done; fail naming the tokenisation when it fails, dies or stands still `stall_s`."""
    last: Optional[Dict[str, Any]] = None
    moved = time.monotonic()
    while True:
        try:
            state = board.read()
        except Exception as exc:  # the store lives with rank 0: it stopped answering
            raise DataPreparationError(
                f"{me} was waiting for {who} {WHAT}, and {who} is gone (the process group's store stopped "
                f"answering: {exc}); its own error is in its log. Last progress: {describe(last)}."
            ) from exc
        now = time.monotonic()
        if state != last:
            last, moved = state, now
        phase = (state or {}).get("phase")
        if phase == "done":
            return
        if phase == "failed":
            raise DataPreparationError(f"{WHAT} failed on {who}: {state['error']}")  # type: ignore[index]
        if now - moved > stall_s:
            raise DataPreparationError(
                f"{me} waited {stall_s:.0f} s for {who} {WHAT}, which made no progress in that time (last: "
                f"{describe(last)}). Look at {who}'s log; if one record takes longer, raise timeout_s."
            )
        if now - board.printed >= PRINT_EVERY_S:
            board.printed = now
            print(f"{me}: waiting for {who} {WHAT}: {describe(state)}", file=sys.stderr, flush=True)
        mark_progress(f"waiting for {WHAT}", 0)
        time.sleep(poll_s)
