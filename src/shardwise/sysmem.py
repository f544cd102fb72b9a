"""Whole-process memory (RSS high-water mark), host memory still available, and byte-size strings.

Split from memory.py, which counts tensor storages: these helpers answer the
other two questions every memory report needs -- what did the whole process
peak at (VmHWM, resettable through /proc/self/clear_refs) and how to read or
print a size such as "80GiB" -- and are shared with the planner and the
fine-tuning recipe's loading benchmark. `available_host_bytes` (MemAvailable
under a cgroup limit) is asked before a full gather or a merge holds a whole
model on the host (checkpoint/formats.py, checkpoint/convert.py, recipes/).
"""

from __future__ import annotations

import re
import sys
import warnings

# ----------------------------------------------------------- whole-process RSS
# For the process as a whole: reset the kernel's high-water mark, run, read VmHWM.
# resource.getrusage().ru_maxrss cannot be reset (it is the peak since exec), and
# tracemalloc only sees Python-object allocations, not tensor storages. Current RSS
# after a step overstates live memory because freed heap pages often stay resident.
_WARNED_CLEAR_REFS = False


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark (VmHWM); False if refused (non-Linux, read-only
    /proc in a container), and then peak_rss_bytes() means "since process start"."""
    global _WARNED_CLEAR_REFS
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError as err:  # PermissionError, FileNotFoundError, read-only /proc
        if not _WARNED_CLEAR_REFS:
            _WARNED_CLEAR_REFS = True
            warnings.warn(
                f"shardwise.memory.reset_peak_rss(): cannot reset the RSS high-water mark "
                f"({err}); peak_rss_bytes() reports the peak since process start. Use a "
                "MemoryTracker for resettable tensor-memory peaks.",
                stacklevel=2,
            )
        return False


def peak_rss_bytes() -> int:
    """Peak resident set size since start or the last reset_peak_rss() (VmHWM)."""
    value = _proc_status_bytes("VmHWM")
    if value is not None:
        return value
    try:  # not Linux: ru_maxrss is the never-reset peak (bytes on macOS, kB elsewhere)
        import resource  # Unix only

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except ImportError:
        return 0


def current_rss_bytes() -> int:
    """Current resident set size (VmRSS); 0 where /proc is missing."""
    return _proc_status_bytes("VmRSS") or 0


# ------------------------------------------------------------------ byte units
# GB & co. are powers of 1000, GiB & co. powers of 1024; bare K/M/G/T/P are binary, as
# in Slurm's --mem and Docker.
_UNITS = {"": 1, "b": 1} | {f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgtp")}
_UNITS |= {f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgtp")}
_UNITS |= {p: 1024 ** (i + 1) for i, p in enumerate("kmgtp")}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def format_bytes(n: float) -> str:
    """1234567 -> '1.2 MiB' (binary units, one decimal; plain bytes below 1 KiB)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024:
            return f"{sign}{n:.1f} {unit}"
    return f"{sign}{n / 1024:.1f} PiB"


def parse_bytes(value: str | int) -> int:
    """'80GiB' / '80GB' / '512MiB' / '1.5TiB' / '4096' / 4096 -> bytes.

    GB/MB/... are powers of 1000, GiB/MiB/... powers of 1024, and bare K/M/G/T are
    binary (as in Slurm's --mem). Case does not matter.
    """
    if isinstance(value, bool):
        raise ValueError(f"Cannot parse memory size {value!r}: expected bytes or a size string")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"Memory size must be non-negative, got {value}")
        return value
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"Cannot parse memory size {value!r}. Use a number with an optional unit, "
            "e.g. '80GiB', '80GB', '512MiB', '1.5TiB' or an integer number of bytes; "
            "units: B, KB/MB/GB/TB/PB (powers of 1000), KiB/MiB/GiB/TiB/PiB or "
            "K/M/G/T/P (powers of 1024)."
        )
    return int(round(float(match.group(1)) * _UNITS[unit]))


# ----------------------------------------------------------- host memory left
def available_host_bytes() -> int | None:
    """Host memory this process can still take: MemAvailable, capped by a cgroup (container) limit.

    None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as fh:
                limit = fh.read().strip()
            with open(usage_file) as fh:
                usage = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            found.append(max(0, int(limit) - usage))
    return min(found) if found else None
