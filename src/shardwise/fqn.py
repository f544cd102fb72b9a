"""A parameter's or module's name as the user's model spells it, whatever wraps it.

Activation checkpointing, torch.compile and FSDP1 insert a wrapper module, which puts
`_checkpoint_wrapped_module.`, `_orig_mod.` or `_fsdp_wrapped_module.` into every name below it.
Several layers need the unwrapped name: the sharding-invariant initialisation seeds each module
from it (seed.module_seed), adapter checkpoints and the LoRA export key PEFT's files by it
(checkpoint/adapters.py, recipes/), the Hugging Face export and the scaling check match tensors by
it. It lives here, below all of them, so none has to import the engines to strip a prefix.
"""

from __future__ import annotations

# Wrapper names that must not change a module's identity (and so its seed).
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(fqn: str) -> str:
    """`fqn` without the wrappers' prefixes (a wrapper at the end of the name included)."""
    for prefix in WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn.replace("_checkpoint_wrapped_module", "").rstrip(".")
