"""FLOPs a training step does, what the device could do, and the ratio between them (MFU).

A step's FLOPs are counted, not modelled: `FlopCounter` applies torch's FLOP
formulas (torch.utils.flop_counter) to the operators of one real forward and backward (the throughput monitor
counts the first micro-batch of a run), so any user model gets a number,
whatever its layers, including attention through scaled_dot_product_attention.
The counter sees the matrix products and convolutions that dominate a step;
elementwise work, norms and the optimizer update are left out, as every MFU
figure leaves them out. The peak is the device's dense (no 2:4 sparsity)
tensor throughput for the precision the step runs in, from NVIDIA's data
sheets by `torch.cuda.get_device_name`; a GPU not in the table, or the CPU,
has no peak and so no MFU unless the user gives one (`Trainer(peak_tflops=)`);
a CUDA device the table does not list is named in a warning, once, so a missing
MFU is never silent.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, Optional, Set, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from shardwise.distributed.env import is_global_zero

# Dense TFLOP/s per GPU by the kind of number a matmul multiplies. "tf32" is float32 storage with
# TF32 tensor-core products (torch's float32_matmul_precision "high"/"medium"); "fp32" is IEEE
# float32 on the CUDA cores. Checked against the vendor's data sheets (sparse figures halved).
# Order matters: the first pattern that matches the device name wins (H100 NVL before H100).
PEAK_TFLOPS: Tuple[Tuple[str, str, Dict[str, float]], ...] = (
    ("B200", r"\bb200\b", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),
    # Grace Hopper's GPU is an H100 SXM's (GH200 data sheet: the same dense tensor figures).
    ("GH200", r"\bgh200\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("H200 NVL", r"\bh200\b.*\bnvl\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", r"\bh200\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("H100 NVL", r"\bh100\b.*\bnvl\b", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", r"\bh100\b.*\bpcie\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H100 SXM", r"\bh100\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    # H800 / A800: the export versions of H100 / A100, their NVLink (and FP64) cut, tensor throughput as theirs.
    ("H800 PCIe", r"\bh800\b.*\bpcie\b", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H800 SXM", r"\bh800\b", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("A100", r"\ba100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("A800", r"\ba800\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", r"\bl40s\b", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", r"\bl4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", r"\ba10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # AWS's A10G: the A10 data sheet's figures (the same GA102 part, full-rate tensor cores).
    ("A10G", r"\ba10g\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
)


def number_kind(precision: str) -> str:
    """The numbers a step's matrix products use under a precision name: bf16, fp16, tf32, fp32 or fp64."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    # float32 products run on the tensor cores as TF32 when torch is allowed to (Ampere and later).
    return "tf32" if tf32_matmuls() else "fp32"


def tf32_matmuls() -> bool:
    """Whether CUDA float32 matrix products may run as TF32, however the user allowed it.

    torch >= 2.9 has a second switch, `torch.backends.cuda.matmul.fp32_precision` ("tf32" / "ieee",
    or inherited from `torch.backends.fp32_precision`); once it is set, the old getters
    (`torch.get_float32_matmul_precision()`, `matmul.allow_tf32`) raise instead of answering. The new
    one is read first; "none" (never set) means the old ones decide.
    """
    try:
        new = torch.backends.cuda.matmul.fp32_precision
    except (AttributeError, RuntimeError):  # torch < 2.9: only the old switches exist
        new = "none"
    if new in ("tf32", "ieee"):
        return new == "tf32"
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def lookup_peak(device_name: str, kind: str) -> Optional[Tuple[str, float]]:
    """(the table's name for the device, its dense peak TFLOP/s for `kind`), or None when not in the table."""
    name = device_name.lower()
    for label, pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return (label, peaks[kind]) if kind in peaks else None
    return None


def device_peak(device: torch.device, precision: str, override: Optional[float] = None) -> Tuple[Optional[float], str]:
    """The peak TFLOP/s MFU is measured against, and where it came from (said once in the run's output).

    override: the user's `peak_tflops`, taken as it is on any device. Otherwise the table's entry for a
    CUDA device, or None (no MFU) for the CPU and for GPUs the table does not list.
    """
    kind = number_kind(precision)
    if override is not None:
        return float(override), f"peak_tflops={override:g} as given"
    if device.type != "cuda":
        return None, f"no peak for the {device.type.upper()}: TFLOP/s without MFU (pass peak_tflops for MFU)"
    name = torch.cuda.get_device_name(device)
    found = lookup_peak(name, kind)
    if found is None:
        _warn_unknown_peak(name, kind)
        return None, f"no peak known for {name} in {kind}: TFLOP/s without MFU (pass peak_tflops for MFU)"
    label, peak = found
    return peak, f"{label} dense {kind} peak {peak:g} TFLOP/s"


_WARNED: Set[Tuple[str, str]] = set()


def _warn_unknown_peak(name: str, kind: str) -> None:
    """Say once per process (on global rank 0) that a GPU has no MFU, and how to give its peak."""
    if (name, kind) in _WARNED or not is_global_zero():
        return
    _WARNED.add((name, kind))
    warnings.warn(
        f"MFU is not measured: {name!r} is not in shardwise's table of peak TFLOP/s ({kind}). Pass the "
        f"device's dense {kind} peak from its data sheet: Trainer(peak_tflops=...), "
        "ThroughputMonitor(peak_tflops=...) or the recipe's --peak_tflops.",
        stacklevel=3,
    )


def mfu(achieved_tflops: float, peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation: the achieved share of the peak, 0..1 (None without a peak)."""
    if not peak_tflops or peak_tflops <= 0:
        return None
    return achieved_tflops / peak_tflops


def check_peak(value: Any, where: str = "Trainer(peak_tflops=...)") -> Optional[float]:
    """A user's peak_tflops: None or a positive number of TFLOP/s per device."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise ValueError(
            f"{where}: {value!r} is not a peak; give the device's dense TFLOP/s for the run's precision "
            "(e.g. 989.5 for an H100 SXM in bf16), or None to use the built-in table."
        )
    return float(value)


def _attention_flops(query: Any, key: Any, value: Any) -> int:
    """Scores (query x key) and the weighted sum (scores x value), 2 FLOPs a multiply-add, every head of
    the query (grouped-query attention shares key/value heads but computes every query head's scores)."""
    batch, heads, q_len, head_dim = query
    k_len, v_dim = key[-2], value[-1]
    return 2 * batch * heads * q_len * k_len * (head_dim + v_dim)


def _cpu_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return _attention_flops(query, key, value)


def _cpu_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * _attention_flops(query, key, value)  # the four products of the backward: twice the forward's


# The CPU's fused attention kernel is missing from torch's FLOP registry (the CUDA ones are there), so on
# the CPU scaled_dot_product_attention would count as nothing; these formulas are the CUDA ones' shapes.
_CUSTOM = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


_FORMULAS = {**flop_registry, **{op: shape_wrapper(formula) for op, formula in _CUSTOM.items()}}


class _CountingMode(TorchDispatchMode):
    """Runs every operator as it is and adds up torch's FLOP formulas for the ones that have one.

    Not torch's FlopCounterMode: that one decomposes each operator it has no formula for (silu_backward,
    for one) into others, which round differently, so the counted step would not be the step the run
    takes; a resumed run, which counts its own first step, would then drift from the uninterrupted one.
    The operators it would decompose are elementwise (no formula, no FLOPs counted either way).
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out

    def get_total_flops(self) -> int:
        return self.total


def _counter_mode() -> _CountingMode:
    return _CountingMode()


class FlopCounter:
    """Counts the FLOPs of whatever runs between `start()` and `stop()` (may span several hooks).

    The counting mode is a dispatch mode: entered here, it sees every operator the model, its
    backward and any collectives run, whichever thread of hooks starts and ends it. `stop()` is safe
    to call twice (an exception path and the normal one).
    """

    def __init__(self) -> None:
        self._mode: Optional[_CountingMode] = None
        self._stance: Any = None
        self.total: Optional[int] = None

    @property
    def running(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        # Under a dispatch mode dynamo skips a torch.compile'd function it meets for the first time, and
        # keeps skipping it for the rest of the run: the counted step runs eagerly by the compiler's own
        # stance instead, so a user's torch.compile still compiles on the next call.
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        self._mode = _counter_mode()
        self._mode.__enter__()

    def stop(self) -> Optional[int]:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
            self._stance.__exit__(None, None, None)
            self.total = int(mode.get_total_flops())
        return self.total


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of `fn(*args, **kwargs)` (call it on a forward + backward to count a training step)."""
    counter = FlopCounter()
    counter.start()
    try:
        fn(*args, **kwargs)
    finally:
        total = counter.stop()
    return int(total or 0)
