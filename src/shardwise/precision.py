"""Precision names -> what each strategy needs to know.

A user says one string ("bf16-mixed", "32-true", ...). Every strategy needs a
different view of it: FSDP2 wants a MixedPrecisionPolicy, DDP and single
device want an autocast context and, for fp16, a gradient scaler, DeepSpeed
wants its own config section. This file parses the name once, validates it
against the device (fp16 on CPU is refused here, before any process starts)
and exposes the dtypes; the strategies turn those into their engine's knobs.
"""

from __future__ import annotations

import contextlib
import copy
from collections import UserDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch

# Canonical names, in the order the docs list them.
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")

# What users of Lightning also type.
_ALIASES = {
    "32": "32-true",
    32: "32-true",
    "fp32": "32-true",
    "float32": "32-true",
    "64": "64-true",
    64: "64-true",
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "fp16": "16-mixed",
    "half": "16-mixed",
}


@dataclass(frozen=True)
class Precision:
    """One training precision.

    param_dtype:   dtype parameters (and optimizer master state) are stored in.
    compute_dtype: dtype matmuls run in (autocast target, or FSDP's param_dtype).
    reduce_dtype:  dtype gradients are reduced in across ranks.
    mixed:         True when compute_dtype differs from the stored parameters.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    mixed: bool

    @property
    def needs_grad_scaler(self) -> bool:
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range.
        return self.name == "16-mixed"

    @property
    def casts_module(self) -> bool:
        """The model itself is stored in another dtype than fp32 (64-true, bf16-true, 16-true): it is
        built and cast to param_dtype, and floating inputs are cast to it (convert_input)."""
        return not self.mixed and self.param_dtype != torch.float32

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """What a step runs under: autocast for the mixed modes; for 64-true, float64 as the default
        dtype (tensors a step creates, torch.randn(...) or torch.zeros(...), match the float64
        model, as Lightning's double precision does); nothing for the other true modes."""
        if self.name == "64-true":
            return self.default_dtype()
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def convert_input(self, data: Any) -> Any:
        """`data` with every floating-point tensor in it cast to param_dtype when the model is cast
        (casts_module), as Lightning's true and double precisions convert inputs; integer tensors
        (token ids, labels), other objects and the mixed modes are left alone. Containers are rebuilt
        (dict and Mapping types, UserDict such as BatchEncoding, lists, tuples, namedtuples)."""
        if not self.casts_module:
            return data
        return _cast_floating(data, self.param_dtype)

    def grad_scaler(self, device: torch.device) -> Optional["torch.amp.GradScaler"]:
        if not self.needs_grad_scaler:
            return None
        return torch.amp.GradScaler(device.type)

    @contextlib.contextmanager
    def default_dtype(self) -> Iterator[None]:
        """Create floating tensors in param_dtype (used while building true-half models)."""
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.param_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() and data.dtype != dtype else data
    if isinstance(data, UserDict):  # keep a BatchEncoding's other attributes
        out = copy.copy(data)
        out.data = {k: _cast_floating(v, dtype) for k, v in data.items()}
        return out
    if isinstance(data, Mapping):
        items = {k: _cast_floating(v, dtype) for k, v in data.items()}
        try:
            return items if type(data) is dict else type(data)(items)
        except TypeError:  # a Mapping type that cannot be built from a dict
            return items
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_cast_floating(v, dtype) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_cast_floating(v, dtype) for v in data)
    return data


def build_precision(name: Union[str, int, Precision], device_type: str = "cpu") -> Precision:
    """Parse a precision name and check the device can run it.

    Raises ValueError naming the valid choices, or the supported alternative on
    this device, before anything expensive happens.
    """
    if isinstance(name, Precision):
        precision = name
    else:
        key = name.lower().strip() if isinstance(name, str) else name
        canonical = _ALIASES.get(key, key)
        if canonical not in PRECISIONS:
            raise ValueError(
                f"Unknown precision {name!r}. Valid names: {', '.join(PRECISIONS)} (aliases: 32, 16, bf16)."
            )
        precision = _TABLE[canonical]
    if device_type == "cpu" and precision.name in ("16-mixed", "16-true"):
        raise ValueError(
            f"precision={precision.name!r} needs a CUDA GPU: float16 training is not supported "
            "on CPU here (gloo reductions and many CPU kernels lack fp16). "
            "Use precision='bf16-mixed' or 'bf16-true' on CPU, or accelerator='cuda'."
        )
    return precision


_f32, _bf16, _f16, _f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
_TABLE = {
    "32-true": Precision("32-true", _f32, _f32, _f32, mixed=False),
    "64-true": Precision("64-true", _f64, _f64, _f64, mixed=False),
    # Mixed: fp32 master weights, half compute, fp32 gradient reduction (the
    # numerically safe default FSDP users expect).
    "bf16-mixed": Precision("bf16-mixed", _f32, _bf16, _f32, mixed=True),
    "16-mixed": Precision("16-mixed", _f32, _f16, _f32, mixed=True),
    # True half: everything, including optimizer state, in half precision.
    "bf16-true": Precision("bf16-true", _bf16, _bf16, _bf16, mixed=False),
    "16-true": Precision("16-true", _f16, _f16, _f16, mixed=False),
}
