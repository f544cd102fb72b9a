"""QLoRA's frozen base: nn.Linear layers as bitsandbytes NF4 `Linear4bit`, in a storage FSDP2 shards like any weight.

`quantize_to_4bit` swaps a model's linear layers (except `skip`, the output
head by default) for bitsandbytes' `Linear4bit`: NF4 codes in blocks of 64
weights, double quantisation (each block's absmax is itself quantised to 8
bits in blocks of 256), dequantised to `compute_dtype` for every matmul. The
packed codes are stored as a uint8 column `(n / 2, 1)`, two codes per byte:
FSDP2 shards, gathers and frees it byte for byte like any frozen parameter,
never casts it (its mixed-precision policy casts floating parameters only; a
unit that also holds float parameters is all-gathered as bytes), and no float
operation ever reads it. Codes stored in a float dtype (the compute dtype, as
they were until issue 36) were at the mercy of every float path they passed:
about one byte pair in 256 reads as a NaN, and a copy that canonicalises NaN
payloads (bitsandbytes #1945 reports ~0.1% of codes altered under FSDP2)
silently changes the weights; the health check also took those NaN patterns
for non-finite parameters. The quantisation state (absmax, the nested absmax and
offset, the two code tables) is small -- about 1/32 of the packed bytes -- and
stays whole on every rank as `Linear4bit.quant_state`, a plain attribute that
no engine sees; bitsandbytes' forward takes it from the module whenever the
weight in place is a plain tensor, which is what FSDP2's all-gathered
parameter is. On a meta-device model the layers get a meta placeholder of the
packed shape and no state; the recipe's loader (recipes/hf_model.py) quantises
each full weight on global rank 0 as it streams the checkpoint
(`quantize_weight`), sends every rank its slice of the packed column and
broadcasts the state (`broadcast_quant_state`), so no rank ever holds the
full-precision model. `fourbit_bytes` is the accounting the planner uses.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from shardwise.distributed import ops
from shardwise.precision import build_precision

BLOCKSIZE = 64  # weights per absmax (bitsandbytes' default for NF4)
NESTED_BLOCKSIZE = 256  # absmax values per nested absmax (double quantisation)
QUANT_TYPE = "nf4"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_bitsandbytes() -> Any:
    """The bitsandbytes module, or a ValueError saying how to install it."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ValueError(
            "load_in_4bit needs the bitsandbytes package (NF4 quantisation); install it with "
            "`pip install shardwise[lora]` (or pip install bitsandbytes), or drop load_in_4bit."
        ) from exc
    return bitsandbytes


def _linear4bit_class() -> Optional[type]:
    # bitsandbytes is imported only by a model that uses it: importing it costs a second.
    if "bitsandbytes" not in sys.modules:
        return None
    return sys.modules["bitsandbytes"].nn.Linear4bit


def packed_shape(out_features: int, in_features: int, storage_dtype: torch.dtype) -> Tuple[int, int]:
    """The shape of a layer's packed NF4 codes: two codes per byte, as a column of `storage_dtype`."""
    numel = out_features * in_features
    itemsize = torch.empty((), dtype=storage_dtype).element_size()
    if numel % (2 * itemsize):
        raise ValueError(
            f"a {out_features} x {in_features} weight has {numel} entries, not a multiple of "
            f"{2 * itemsize} (two 4-bit codes per byte, {itemsize}-byte storage)"
        )
    return numel // (2 * itemsize), 1


def _matches(name: str, skip: Sequence[str]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


def _new_layer(linear: nn.Linear, compute_dtype: torch.dtype, storage_dtype: torch.dtype) -> nn.Module:
    bnb = require_bitsandbytes()
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=False,
        compute_dtype=compute_dtype,
        compress_statistics=True,
        quant_type=QUANT_TYPE,
        quant_storage=storage_dtype,
        device="meta",  # never a full-precision temporary; the weight is replaced below
    )
    layer.bias = linear.bias  # kept as it is (PEFT freezes it with the rest of the base)
    # bitsandbytes repacks the codes into another CPU layout, in place, on the first no-grad eval forward
    # on CPUs with AVX512-BF16. In place means inside FSDP's all-gathered buffer, which the next
    # all-gather overwrites with the original layout while the state says "repacked": wrong outputs.
    layer.support_avx512bf16_for_cpu = False
    return layer


def _params4bit(data: torch.Tensor, layer: nn.Module, state: Any) -> nn.Parameter:
    bnb = sys.modules["bitsandbytes"]
    return bnb.nn.Params4bit(
        data,
        requires_grad=False,
        quant_state=state,
        blocksize=BLOCKSIZE,
        compress_statistics=True,
        quant_type=QUANT_TYPE,
        quant_storage=data.dtype,
        module=layer,
        bnb_quantized=True,  # never let Params4bit.to() quantise the codes a second time
    )


def quantize_weight(full: torch.Tensor, layer: nn.Module) -> Tuple[torch.Tensor, Any]:
    """NF4-quantise a full weight for `layer` (a Linear4bit): the packed column and its QuantState.

    The weight is cast to the layer's compute dtype first, so dequantising gives that dtype back.
    """
    bnb = require_bitsandbytes()
    storage = layer.quant_storage
    return bnb.functional.quantize_4bit(
        full.to(layer.compute_dtype).contiguous(),
        blocksize=BLOCKSIZE,
        compress_statistics=True,
        quant_type=QUANT_TYPE,
        quant_storage=storage,
    )


def set_quant_state(layer: nn.Module, state: Any) -> None:
    """Install `state` as the layer's quantisation state (and its weight's, when the weight can hold one)."""
    layer.quant_state = state
    if isinstance(layer.weight, sys.modules["bitsandbytes"].nn.Params4bit):
        layer.weight.quant_state = state


@torch.no_grad()
def quantize_to_4bit(
    model: nn.Module,
    compute_dtype: torch.dtype,
    storage_dtype: torch.dtype = torch.uint8,
    skip: Sequence[str] = ("lm_head",),
) -> List[str]:
    """Replace every nn.Linear of `model` (not named in `skip`) by an NF4 Linear4bit; return the replaced names.

    `skip` entries match a module's full name or its last components ("lm_head" matches
    "model.lm_head"). Real weights are quantised now (in `compute_dtype`); meta weights
    become meta placeholders of the packed shape whose values and state the loader fills.
    The packed codes are uint8 (`storage_dtype` accepts nothing else; see the module docstring).
    The model is marked `is_loaded_in_4bit`, which is how PEFT chooses its 4-bit LoRA layer.
    """
    if compute_dtype not in FLOAT_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype}: 4-bit layers compute in {FLOAT_DTYPES}.")
    if storage_dtype != torch.uint8:
        raise ValueError(
            f"storage_dtype={storage_dtype}: the packed NF4 codes are stored as uint8 only, so that no float "
            "operation (a cast, a copy that canonicalises NaN bit patterns) can alter them. Leave storage_dtype "
            "out; FSDP2 shards and gathers a uint8 parameter byte for byte, next to float ones."
        )
    require_bitsandbytes()
    replaced: List[str] = []
    for name, child in list(model.named_modules()):  # in the model's order
        if type(child) is not nn.Linear or _matches(name, skip):
            continue
        if hasattr(child.weight, "ds_id"):
            raise ValueError(
                f"quantize_to_4bit: {name}.weight is partitioned by DeepSpeed ZeRO-3 (built under "
                "deepspeed.zero.Init); 4-bit layers work under FSDP, DDP and ZeRO-1/2 only."
            )
        layer = _new_layer(child, compute_dtype, storage_dtype)
        shape = packed_shape(child.out_features, child.in_features, storage_dtype)
        if child.weight.is_meta:
            data, state = torch.empty(shape, dtype=storage_dtype, device="meta"), None
        else:
            data, state = quantize_weight(child.weight.detach(), layer)
        layer.weight = _params4bit(data, layer, state)
        layer.quant_state = state
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, layer)
        replaced.append(name)
    if replaced:
        model.is_loaded_in_4bit = True
    return replaced


def compute_dtype_for(precision: Any) -> torch.dtype:
    """The dtype 4-bit layers dequantise to and compute in for a Trainer precision: its compute dtype
    (32-true: float32, bf16-mixed / bf16-true: bfloat16, 16-mixed: float16). 64-true is refused."""
    dtype = build_precision(precision, "cuda").compute_dtype  # the name's dtypes; devices are checked elsewhere
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"load_in_4bit with precision={precision!r}: bitsandbytes' 4-bit layers compute in float32, "
            "bfloat16 or float16. Use precision='bf16-mixed' (GPUs) or '32-true'."
        )
    return dtype


def check_4bit_plan(plan: Any) -> None:
    """Refuse parallel plans (strategies/parallel.py) 4-bit base weights do not work under; None passes."""
    if plan is None:
        return
    if plan.engine == "deepspeed" and plan.zero_stage == 3:
        raise ValueError(
            "load_in_4bit does not work under DeepSpeed ZeRO-3: zero.Init partitions each linear weight "
            "as the model is built, before it can become a 4-bit layer. Use strategy='fsdp' (FSDP2 shards "
            "the packed 4-bit weights) or "
            "'deepspeed_stage_2' / 'deepspeed_stage_1' (4-bit weights replicated, adapter state partitioned)."
        )
    if plan.offload_params or plan.offload_optimizer:
        raise ValueError(
            "load_in_4bit with CPU offload (cpu_offload, a *_offload strategy, or offload options) is not "
            "supported: offloaded shards of the packed 4-bit weights would live on the host while their "
            "quantisation state and the matmul are on the GPU, a path not implemented or tested here. Drop "
            "the offload: the 4-bit base needs about 0.52 bytes per weight, sharded over the ranks under FSDP."
        )


def check_4bit_config(config: Any, strategy: Any) -> None:
    """The up-front checks of the recipe's load_in_4bit (a FinetuneConfig and its built strategy, or "auto").

    Raises ValueError naming the option and the fix: without LoRA, without bitsandbytes, in a precision
    the 4-bit layers cannot compute in, under ZeRO-3 or offload. Under strategy="auto" the plan is
    known only in the worker, which runs `check_4bit_plan` again before anything is built.
    """
    if not getattr(config, "load_in_4bit", False):
        return
    if not isinstance(config.lora_r, int) or config.lora_r < 1:
        raise ValueError(
            f"load_in_4bit=True with lora_r={config.lora_r!r}: the 4-bit base weights are frozen (they "
            "cannot be trained), so QLoRA trains adapters on top of them. Set lora_r (e.g. 16), or drop "
            "load_in_4bit for full fine-tuning."
        )
    require_bitsandbytes()
    compute_dtype_for(config.precision)
    check_4bit_plan(None if isinstance(strategy, str) else strategy.parallel_plan)


def is_4bit(model: nn.Module) -> bool:
    """True when `model` holds a bitsandbytes 4-bit linear layer."""
    cls = _linear4bit_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def reset_4bit_fn(layer: nn.Module) -> Optional[Callable[[], None]]:
    """The initialisation of a meta-built 4-bit layer, or None when `layer` is not one.

    nn.Linear's own init cannot run on packed uint8 codes. This gives the layer what building it eagerly
    and then quantising gives: a kaiming-uniform float weight (nn.Linear's bound) quantised to NF4 into
    the codes, its quantisation state, and nn.Linear's bias. The strategies' materialisation calls it
    under the module's own seed on a full-size CPU copy of the codes (every rank draws the same weight,
    so the whole state agrees); the state goes to the device the weight lives on, taken here before
    that copy is swapped in. A loader that brings real weights overwrites codes and state afterwards.
    """
    cls = _linear4bit_class()
    if cls is None or not isinstance(layer, cls) or layer.weight.dtype != torch.uint8:
        return None
    weight = layer.weight
    device = (weight._local_tensor if hasattr(weight, "_local_tensor") else weight).device

    def reset() -> None:
        full = torch.empty(layer.out_features, layer.in_features)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        packed, state = quantize_weight(full, layer)
        with torch.no_grad():  # through the parameter itself, so its version shows it was written
            layer.weight.copy_(packed.reshape(layer.weight.shape))
        state.to(device)
        set_quant_state(layer, state)
        if layer.bias is not None:
            bound = 1 / math.sqrt(layer.in_features)
            nn.init.uniform_(layer.bias, -bound, bound)

    return reset


def fourbit_layers(model: nn.Module) -> Dict[int, nn.Module]:
    """The 4-bit layers keyed by the identity of their (possibly sharded) weight parameter."""
    cls = _linear4bit_class()
    if cls is None:
        return {}
    return {id(m.weight): m for m in model.modules() if isinstance(m, cls)}


def broadcast_quant_state(state: Any, device: torch.device) -> Any:
    """Global rank 0's QuantState on every rank, on `device` (a collective: every rank calls it, same order)."""
    import torch.distributed as dist

    bnb = require_bitsandbytes()
    if ops.world_size() == 1:
        state.to(device)
        return state
    plain = state.as_dict() if ops.rank() == 0 else None
    meta = ops.broadcast_object(
        None
        if plain is None
        else {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v) for k, v in plain.items()}
    )
    out: Dict[str, Any] = {}
    for key, (shape, dtype) in meta.items():
        if shape == "value":
            out[key] = dtype
            continue
        buf = (
            plain[key].to(ops.collective_device()).contiguous()
            if plain is not None
            else torch.empty(shape, dtype=dtype, device=ops.collective_device())
        )
        dist.broadcast(buf, src=0)
        out[key] = buf.to(device)
    return bnb.functional.QuantState.from_dict(out, device=device)


def place_4bit(tensor: torch.Tensor, full: Optional[torch.Tensor], layer: nn.Module, place: Callable) -> None:
    """Load one 4-bit weight during rank-0 loading (a collective: every rank calls it, same order).

    Global rank 0 holds the checkpoint's `full` weight and quantises it on the device the shards live
    on; `place(tensor, packed)` (the loader's own placement: a DTensor shard, or all of it) gives
    every rank its part of the packed codes, and the quantisation state is broadcast whole.
    """
    from torch.distributed.tensor import DTensor

    device = (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).device
    packed, state = quantize_weight(full.to(device), layer) if ops.rank() == 0 else (None, None)
    place(tensor, packed)
    del packed
    set_quant_state(layer, broadcast_quant_state(state, device))
    # Packed codes are not numbers; stored as uint8 no float check reads them, and the mark says so to
    # the strategy's check for its uninitialised-memory sentinel (materialize.py) in any case.
    tensor.packed_codes = True


def fourbit_bytes(numel: int, storage_dtype: torch.dtype = torch.uint8, shards: int = 1) -> Dict[str, float]:
    """Bytes one rank holds for a 4-bit weight of `numel` entries sharded over `shards` ranks (planner accounting).

    "packed": the NF4 codes (numel / 2 bytes, padded by FSDP2 to a multiple of `shards` storage elements)
    on each rank; "state": the QuantState, whole on every rank: one uint8 absmax per 64 weights, one
    float32 nested absmax per 256 absmax, a float32 offset and the two code tables (16 + 256 float32).
    """
    itemsize = torch.empty((), dtype=storage_dtype).element_size()
    rows = math.ceil(numel / (2 * itemsize))
    blocks = math.ceil(numel / BLOCKSIZE)
    state = blocks + 4 * math.ceil(blocks / NESTED_BLOCKSIZE) + 4 + 4 * (16 + 256)
    return {"packed": math.ceil(rows / shards) * itemsize, "state": state}
