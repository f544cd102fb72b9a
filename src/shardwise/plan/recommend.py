"""Which configuration to run: the fastest that fits with headroom to spare, and the reason in one sentence.

"Fits" keeps a margin: a configuration is accepted when its reserved memory
is at most (1 - headroom) of the device memory (and its host memory at most
that share of the host's, when given). The default 10% covers what no model
sees -- a longer batch than planned, a fragmentation spike, a library that
allocates on first use -- so advice followed as given does not run at 99% of
the device. Among fitting configurations whose step times are within
TIE_TOLERANCE of the fastest, the one that needs the least memory wins: the
step-time model cannot tell them apart, the memory prediction can. Without a
device memory nothing can be judged to fit, so the fastest estimate is named
with a note. When nothing fits, the reason names the binding limit -- the
device, the host, or both -- and only the changes that address it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from shardwise.memory import format_bytes

DEFAULT_HEADROOM = 0.10  # fraction of device (and host) memory left free by a recommendation
TIE_TOLERANCE = 0.02  # step times this close are the same to the cost model (cost.py is relative)


def format_seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} us"


def usable(total: Optional[int], headroom: float) -> Optional[float]:
    """The bytes a recommendation may fill of `total` (None stays None)."""
    return None if total is None else total * (1.0 - headroom)


def _budget(total: int, headroom: float) -> str:
    if not headroom:
        return format_bytes(total)
    return f"{format_bytes(usable(total, headroom))} ({1 - headroom:.0%} of {format_bytes(total)})"


def binding_limit(estimates: List[Any]) -> Optional[str]:
    """ "device", "host" or "both" when nothing fits; None when something does (or nothing was judged)."""
    judged = [e for e in estimates if e.fits is not None]
    if not judged or any(e.fits for e in judged):
        return None
    on_device = [e for e in judged if e.device_fits]
    if on_device:
        return "host"  # some configuration fits the device; every one of them overflows the host
    smallest = min(judged, key=lambda e: e.reserved)
    return "both" if smallest.host_fits is False else "device"


def recommend(
    estimates: List[Any],
    device_memory: Optional[int],
    *,
    headroom: float = DEFAULT_HEADROOM,
    cpu_memory: Optional[int] = None,
) -> Tuple[Optional[Any], str]:
    """The fastest estimate that fits (ties: the smallest), or the fastest without a device memory; and why."""
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
        return None, _nothing_fits(estimates, device_memory, cpu_memory, headroom)
    quickest = min(e.step_seconds for e in fitting)
    tied = [e for e in fitting if e.step_seconds <= quickest * (1 + TIE_TOLERANCE)]
    best = min(tied, key=lambda e: (e.reserved, e.step_seconds))
    why = (
        f"{best.label}: fastest that fits ({format_bytes(best.reserved)} reserved of "
        f"{_budget(device_memory, headroom)}, est. {format_seconds(best.step_seconds)} per step)"
    )
    if len(tied) > 1:
        others = sorted((e for e in tied if e is not best), key=lambda e: e.reserved)
        why += (
            f"; as fast as {others[0].label} ({format_bytes(others[0].reserved)}) within the step-time "
            f"model's {TIE_TOLERANCE:.0%}, and smaller"
        )
    ratio = best.step_seconds / max(fastest.step_seconds, 1e-12)
    if fastest is not best and not fastest.fits and ratio >= 1.01:
        speed = f"{ratio:.1f}x as fast" if ratio >= 1.5 else f"{ratio - 1:.0%} faster"
        why += f"; {fastest.label} would be {speed} but needs {format_bytes(fastest.reserved)}"
    return best, why + "."


def _nothing_fits(estimates: List[Any], device_memory: int, cpu_memory: Optional[int], headroom: float) -> str:
    limit = binding_limit(estimates)
    smallest = min(estimates, key=lambda e: e.reserved)
    device_text = (
        f"the smallest is {smallest.label} at {format_bytes(smallest.reserved)} reserved per device "
        f"(usable: {_budget(device_memory, headroom)})"
    )
    if limit == "host" and cpu_memory is not None:
        on_device = [e for e in estimates if e.device_fits]
        least = min(on_device, key=lambda e: e.cpu_per_node)
        return (
            f"Nothing fits in host memory: {len(on_device)} configuration(s) fit the device, but the one "
            f"needing the least host memory, {least.label}, needs {format_bytes(least.cpu_per_node)} per node "
            f"(offloaded state + one full copy of the weights for loading; usable: "
            f"{_budget(cpu_memory, headroom)}). Add host memory or nodes (offloaded state is split across "
            "them), load a sharded checkpoint instead of a consolidated one, or offload less."
        )
    if limit == "both" and cpu_memory is not None:
        return (
            f"Nothing fits on the device or the host: {device_text}, and it needs "
            f"{format_bytes(smallest.cpu_per_node)} of host memory per node (usable: "
            f"{_budget(cpu_memory, headroom)}). Add devices or nodes, or shorten sequences."
        )
    offload = any(e.candidate.plan.offload_optimizer for e in estimates)
    hint = "Add devices, shorten sequences or use a smaller micro-batch" + ("" if offload else ", or plan CPU offload")
    return f"Nothing fits on the device: {device_text}. {hint}."


__all__ = ["recommend", "format_seconds", "binding_limit", "usable", "DEFAULT_HEADROOM", "TIE_TOLERANCE"]
