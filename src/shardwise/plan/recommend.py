"""Which configuration to run: the fastest whose reserved memory fits, and the reason in one sentence.

Without a device memory nothing can be judged to fit, so the fastest
estimate is named with a note; when nothing fits, the smallest is named with
what to change. When a faster configuration was passed over for memory, the
reason says by how much it would have been faster.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from shardwise.memory import format_bytes


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def recommend(estimates: List[Any], device_memory: Optional[int]) -> Tuple[Optional[Any], str]:
    """The fastest estimate that fits (or the fastest, without a device memory), and the sentence that says why."""
    if not estimates:
        return None, "no configurations were evaluated"
    fastest = min(estimates, key=lambda e: e.step_seconds)
    if device_memory is None:
        return fastest, (
            f"{fastest.label} has the shortest estimated step ({format_seconds(fastest.step_seconds)}); "
            "give a device memory to check what fits."
        )
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        smallest = min(estimates, key=lambda e: e.reserved)
        return None, (
            f"Nothing fits in {format_bytes(device_memory)}: the smallest is {smallest.label} at "
            f"{format_bytes(smallest.reserved)} reserved. Add devices, use CPU offload, or shorten "
            "sequences."
        )
    best = min(fitting, key=lambda e: e.step_seconds)
    why = (
        f"{best.label}: fastest that fits ({format_bytes(best.reserved)} reserved of "
        f"{format_bytes(device_memory)}, est. {format_seconds(best.step_seconds)} per step)"
    )
    ratio = best.step_seconds / max(fastest.step_seconds, 1e-12)
    if fastest is not best and not fastest.fits and ratio >= 1.01:
        speed = f"{ratio:.1f}x as fast" if ratio >= 1.5 else f"{ratio - 1:.0%} faster"
        why += f"; {fastest.label} would be {speed} but needs {format_bytes(fastest.reserved)}"
    return best, why + "."


__all__ = ["recommend", "format_seconds"]
