"""`shardwise inspect CKPT`: what a checkpoint holds, without loading it.

Prints the manifest (format, layout version, strategy, world size, epoch,
step, when and by which versions it was written), the files and their sizes,
the model's tensors (name, shape, dtype, size; the first --limit of them),
totals for model and optimizer state, and which trainer-state entries are
present (RNG states of how many ranks, schedulers, callbacks, extras), and
whether checksums were recorded. Reads metadata only -- JSON, DCP's
.metadata and pickled structure through the allow-lists of safety.py, never
a tensor and never code -- so it is instant even for a huge model and safe
on a file of unknown origin.
"""

from __future__ import annotations

from typing import Any, Dict, List

from shardwise.checkpoint.reader import TensorInfo, open_checkpoint


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} B"


def describe(path: str) -> Dict[str, Any]:
    """A JSON-friendly summary of the checkpoint at `path`."""
    reader = open_checkpoint(path, check_version=False)
    tensors: List[TensorInfo] = reader.tensors()
    optim = reader.optimizer_tensors()
    state = reader.trainer_state()
    extras = sorted(k for k in state if k not in ("shardwise",))
    return {
        "path": reader.path,
        "manifest": reader.manifest,
        "files": reader.files(),
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "bytes": t.nbytes}
            for t in tensors
        ],
        "model_params": sum(t.numel for t in tensors),
        "model_bytes": sum(t.nbytes for t in tensors),
        "optimizer_bytes": sum(t.nbytes for t in optim),
        "rng_ranks": len(state.get("rng_states") or []),
        "lr_schedulers": len(state.get("lr_schedulers") or []),
        "callbacks": sorted((state.get("callbacks") or {}).keys()),
        "trainer_state_keys": extras,
        "hyper_parameters": {k: repr(v) for k, v in (state.get("hyper_parameters") or {}).items()},
    }


def render(summary: Dict[str, Any], limit: int = 50) -> str:
    m = summary["manifest"]
    lines = [
        f"checkpoint   {summary['path']}",
        f"format       {m.get('checkpoint_format')} (layout version {m.get('format_version')}), written by "
        f"strategy {m.get('strategy')!r} on {m.get('world_size')} process(es)",
        f"progress     epoch {m.get('epoch')}, global step {m.get('global_step')}, batch {m.get('batch_idx')} "
        "of the epoch",
        f"written      {m.get('created')} (shardwise {m.get('shardwise_version')}, torch {m.get('torch_version')})",
        f"model        {summary['model_params']:,} parameters in {len(summary['tensors'])} tensors, "
        f"{_mb(summary['model_bytes'])}",
        f"optimizer    {_mb(summary['optimizer_bytes'])} of state",
        f"trainer      RNG states of {summary['rng_ranks']} rank(s), {summary['lr_schedulers']} LR scheduler(s), "
        f"callbacks: {', '.join(summary['callbacks']) or '-'}",
        f"             entries: {', '.join(summary['trainer_state_keys'])}",
    ]
    sums = m.get("checksums") or {}
    if sums:
        files = [k for k in sums if isinstance(sums[k], dict)]
        what = f"sha256 of {len(files)} file(s)" if files else "sha256 of the tensor data"
        lines.append(f"integrity    {what}, verified on load (SHARDWISE_VERIFY_CHECKSUMS=0 skips)")
    else:
        lines.append("integrity    no checksums in the manifest: nothing is verified on load")
    if summary["hyper_parameters"]:
        lines.append("hparams      " + ", ".join(f"{k}={v}" for k, v in summary["hyper_parameters"].items()))
    lines.append("files")
    for name, size in summary["files"]:
        lines.append(f"  {name:<40} {_mb(size):>14}")
    lines.append("tensors")
    width = max((len(t["name"]) for t in summary["tensors"][:limit]), default=10)
    for t in summary["tensors"][:limit]:
        lines.append(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<9} {_mb(t['bytes']):>12}")
    if len(summary["tensors"]) > limit:
        lines.append(f"  ... {len(summary['tensors']) - limit} more (--limit 0 lists all)")
    return "\n".join(lines)
