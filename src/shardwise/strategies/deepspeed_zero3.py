"""ZeRO-3's set-up helpers: what zero.Init needs first, the dtype check of its partitions, their initialisation.

Under ZeRO-3 no rank ever holds the whole model: `deepspeed.zero.Init` builds
each parameter already partitioned. These functions make that build safe and
equal to the other strategies' (deepspeed.py calls them): `before_zero_init`
loads what must not first load inside zero.Init, `check_zero3_dtypes` refuses
partitions in another dtype than the precision asks for (DeepSpeed chooses it
itself on some CPUs), and `init_zero3_module` re-runs each module's init on
its gathered parameters under the same per-module seeds materialize.py uses,
so ZeRO-3 starts from DDP's weights.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from shardwise.seed import module_seed, rng_devices
from shardwise.strategies.materialize import find_reset_fn, reset_own


def before_zero_init() -> None:
    """Import torch._dynamo before `deepspeed.zero.Init` patches the tensor constructors.

    Dynamo registers a polyfill for `torch.Tensor.__new__` when it is first
    imported, and checks that the function it replaces has the polyfill's
    signature. Inside zero.Init that function is DeepSpeed's wrapper, so the
    first import of dynamo there (transformers 5.24 imports it while loading
    its modeling code, from `from_config`) fails with "Signature mismatch
    between get_new_tensor_fn_for_dtype.<locals>.new_tensor and tensor_pynew"
    on every rank. Imported here, dynamo sees torch's own constructor.
    """
    import torch._dynamo  # noqa: F401


def check_zero3_dtypes(root: nn.Module, expected: torch.dtype) -> None:
    """Refuse ZeRO-3 partitions whose dtype is not the one the precision asked for.

    A wrong dtype here is silent: training runs, losses look plausible, and the
    weights a user exports have lost precision. Parameters built outside
    zero.Init (no `ds_tensor`) are the module's own and are not checked.
    """
    wrong = [
        (name, p.ds_tensor.dtype)
        for name, p in root.named_parameters()
        if getattr(p, "ds_tensor", None) is not None
        and p.ds_tensor.is_floating_point()
        and p.ds_tensor.dtype != expected
    ]
    if wrong:
        import deepspeed

        name, dtype = wrong[0]
        raise RuntimeError(
            f"DeepSpeed ZeRO-3 built {len(wrong)} parameter partitions in {dtype} (first: {name!r}) but the "
            f"precision asks for {expected}. DeepSpeed {deepspeed.__version__} chose the dtype itself; set the "
            "precision through Trainer(precision=...) only (not zero.Init or a config's dtype), or report "
            "this with your DeepSpeed version."
        )


@torch.no_grad()
def init_zero3_module(root: nn.Module, seed: int) -> int:
    """Re-initialise parameters built under zero.Init exactly as materialize.py would for DDP.

    Each module with a reset_parameters() gets its parameters gathered, reset
    under torch.manual_seed(module_seed(seed, name)) -- the same draws DDP's
    meta-device materialisation makes on full-size tensors -- and re-sharded.
    Children first, as in eager construction. Parameters created outside
    zero.Init (no `ds_id`) keep their values, as DDP keeps real tensors.
    A TrainModule.init_weights hook replaces the pass. It runs with every
    parameter gathered (the whole model on each rank), unless the module sets
    `init_weights_partitioned = True`: then it runs on the partitions and
    writes them itself, into each parameter's `ds_tensor` (the fine-tuning
    recipe's loader does this) or one parameter at a time inside
    `deepspeed.zero.GatheredParameters([p], modifier_rank=0)`.
    Returns the number of modules initialised.
    """
    import deepspeed

    def zero_params(mod: nn.Module, recurse: bool) -> List[nn.Parameter]:
        return [p for p in mod.parameters(recurse=recurse) if hasattr(p, "ds_id")]

    hook = getattr(root, "init_weights", None)
    if callable(hook):
        if getattr(root, "init_weights_partitioned", False):
            hook()
        else:
            with deepspeed.zero.GatheredParameters(zero_params(root, True), modifier_rank=0):
                hook()
        return 1
    count = 0
    for fqn, mod in reversed(list(root.named_modules())):
        fn = find_reset_fn(mod)
        params = zero_params(mod, True) if fn is not None else []
        if not params:
            continue
        # A parent's init may touch its children's parameters (MultiheadAttention), so gather recursively.
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            with torch.random.fork_rng(devices=rng_devices()):
                torch.manual_seed(module_seed(seed, fqn))
                reset_own(mod, fn)  # on CPU copies when gathered on a GPU: the weights DDP/FSDP get
        count += 1
    return count
