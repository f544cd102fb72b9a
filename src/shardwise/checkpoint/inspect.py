"""`shardwise inspect CKPT`: what a checkpoint holds, and whether every file of it is intact.

First it verifies (unless --no-verify): a one-file checkpoint's digest over
every byte (onefile.py), a directory's manifest seal and each recorded
file's sha256, and whether the checkpoint belongs to the run whose directory
it sits in (layout.foreign_reason). Each file is reported ok, damaged,
missing, from another run, or unrecorded (present but not in the manifest,
e.g. DeepSpeed's universal/ conversion, written after the save); anything
but ok and unrecorded makes the summary not ok, and the command exits 1.
Nothing is unpickled before that verdict, and nothing of a damaged
checkpoint is unpickled at all. An intact one is then described: the
manifest (format, layout version, strategy, world size, epoch, step, when
and by which versions), the files and sizes, the model's tensors (the first
--limit of them), totals for model and optimizer state, and the trainer
state's entries, whose copy of the manifest must agree with it; an adapter
checkpoint (LoRA, checkpoint/adapters.py) says so, with its adapter, the
share of the model it trains and the base it needs. Only JSON,
pickled structure (never tensor bytes) and DCP's .metadata are read, through
the allow-lists of safety.py: safe on a file of unknown origin, and apart
from the hashing instant for a huge model.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from shardwise.checkpoint import layout, onefile
from shardwise.checkpoint.errors import CheckpointError
from shardwise.checkpoint.integrity import (
    MANIFEST_NAME,
    PART_PREFIX,
    check_agreement,
    check_file,
    parallel_map,
    recorded_checksums,
)
from shardwise.checkpoint.reader import TensorInfo, open_checkpoint, resolve_cli_path

PROBLEMS = ("damaged", "missing", "from another run")


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} B"


def _entry(name: str, size: Optional[int], status: str, detail: str = "") -> Dict[str, Any]:
    return {"name": name, "bytes": size, "status": status, "detail": detail}


def _status_of(problem: Optional[str]) -> str:
    if not problem:
        return "ok"
    return "missing" if "is missing" in problem else "damaged"


def _verify_file(path: str, manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    trailer = onefile.read_trailer(path)
    problem = None
    try:
        if trailer is None:  # read_manifest refuses such files unless asked not to verify
            raise CheckpointError(f"{path} carries no checksum trailer.")
        onefile.verify(path, trailer)
    except CheckpointError as exc:
        problem = str(exc)
    return [_entry(os.path.basename(path), os.path.getsize(path), _status_of(problem), problem or "")]


def _verify_directory(path: str, manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    sums = recorded_checksums(path, manifest)
    names = sorted(sums)
    problems = parallel_map(lambda rel: check_file(path, rel, sums[rel]), names)
    entries = [_entry(MANIFEST_NAME, os.path.getsize(os.path.join(path, MANIFEST_NAME)), "ok")]
    for rel, problem in zip(names, problems):
        file = os.path.join(path, rel)
        size = os.path.getsize(file) if os.path.exists(file) else None
        entries.append(_entry(rel, size, _status_of(problem), problem or ""))
    for root, _, files in os.walk(path):
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in sums and rel != MANIFEST_NAME and not name.startswith(PART_PREFIX):
                entries.append(
                    _entry(rel, os.path.getsize(os.path.join(root, name)), "unrecorded", "not in the manifest")
                )
    return entries


def verify(path: str, manifest: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One entry per file of the checkpoint at `path`: name, bytes, status, detail (see the docstring)."""
    entries = (_verify_file if os.path.isfile(path) else _verify_directory)(path, manifest)
    foreign = layout.foreign_reason(path)
    if foreign:
        first = entries[0]
        if first["status"] == "ok":
            first["status"] = "from another run"
        first["detail"] = (first["detail"] + " " if first["detail"] else "") + f"From another run: {foreign}."
    return entries


def _listed(reader: Any) -> List[Dict[str, Any]]:
    return [_entry(name, size, "not verified") for name, size in reader.files()]


def describe(path: str, verify_files: bool = True) -> Dict[str, Any]:
    """A JSON-friendly summary of the checkpoint at `path`; `summary["ok"]` is the verdict."""
    path = resolve_cli_path(path)
    # The manifest alone (JSON, or a one-file trailer; sealed), then every file, then the rest.
    manifest = layout.read_manifest(path, verify=verify_files)
    entries = verify(path, manifest) if verify_files else []
    summary: Dict[str, Any] = {
        "path": path,
        "manifest": manifest,
        "verified": verify_files,
        "files": entries,
        "run_id": manifest.get("run_id"),
    }
    if any(e["status"] in PROBLEMS for e in entries):
        summary["ok"] = False
        return summary  # nothing of a damaged checkpoint is unpickled
    reader = open_checkpoint(path, check_version=False, verify=False)  # verified above (or not wanted)
    state = reader.trainer_state()
    if verify_files:
        try:
            check_agreement(f"{path} ({MANIFEST_NAME if os.path.isdir(path) else 'trailer'})", manifest, state)
        except CheckpointError as exc:
            entries[0].update(status="damaged", detail=str(exc))
            summary["ok"] = False
            return summary
    tensors: List[TensorInfo] = reader.tensors()
    optim = reader.optimizer_tensors()
    summary.update(
        ok=True,
        files=entries or _listed(reader),
        tensors=[
            {"name": t.name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "bytes": t.nbytes}
            for t in tensors
        ],
        model_params=sum(t.numel for t in tensors),
        model_bytes=sum(t.nbytes for t in tensors),
        optimizer_bytes=sum(t.nbytes for t in optim),
        rng_ranks=len(state.get("rng_states") or []),
        lr_schedulers=len(state.get("lr_schedulers") or []),
        callbacks=sorted((state.get("callbacks") or {}).keys()),
        trainer_state_keys=sorted(k for k in state if k not in ("shardwise",)),
        hyper_parameters={k: repr(v) for k, v in (state.get("hyper_parameters") or {}).items()},
    )
    return summary


def problems(summary: Dict[str, Any]) -> List[str]:
    """One line per file that is not ok: 'name: status: detail'."""
    return [f"{e['name']}: {e['status']}: {e['detail']}" for e in summary["files"] if e["status"] in PROBLEMS]


def _integrity_line(summary: Dict[str, Any]) -> str:
    files = summary["files"]
    if not summary["verified"]:
        return "not verified (--no-verify)"
    bad = [e for e in files if e["status"] in PROBLEMS]
    if bad:
        counts: Dict[str, int] = {}
        for e in bad:
            counts[e["status"]] = counts.get(e["status"], 0) + 1
        return "NOT OK: " + ", ".join(f"{n} {status}" for status, n in counts.items()) + f" of {len(files)} file(s)"
    if os.path.isfile(summary["path"]):
        return "ok: the sha256 of every byte (and the manifest's seal) match what was recorded"
    checked = sum(1 for e in files if e["status"] == "ok") - 1
    return f"ok: the manifest's seal and the sha256 of its {checked} recorded file(s) match"


def adapter_line(adapter: Dict[str, Any]) -> str:
    """`LoRA r=16 alpha=32 on q_proj, v_proj: the trainable weights only (...), base <folder>`."""
    names = {"LORA": "LoRA"}
    kinds = [
        f"{names.get(c.get('peft_type'), c.get('peft_type'))} r={c.get('r')} alpha={c.get('lora_alpha')} on "
        + (
            ", ".join(c["target_modules"])
            if isinstance(c.get("target_modules"), list)
            else str(c.get("target_modules"))
        )
        for c in (adapter.get("peft_config") or {}).values()
    ]
    trainable, total = adapter.get("trainable_parameters", 0), adapter.get("total_parameters", 0)
    share = f"{100.0 * trainable / total:.2f}%" if total else "?"
    return (
        f"{'; '.join(kinds) or 'adapter layers'}: the trainable weights only ({trainable:,} of {total:,} "
        f"parameters, {share}); resumes on base {adapter.get('base', {}).get('name_or_path') or '(built in code)'}"
    )


def render(summary: Dict[str, Any], limit: int = 50) -> str:
    m = summary["manifest"]
    lines = [
        f"checkpoint   {summary['path']}",
        f"format       {m.get('checkpoint_format')} (layout version {m.get('format_version')}), written by "
        f"strategy {m.get('strategy')!r}{f' ({lay})' if (lay := m.get('layout')) else ''} on {m.get('world_size')} "
        "process(es)",
        f"progress     epoch {m.get('epoch')}, global step {m.get('global_step')}, {m.get('batch_idx')} "
        "batch(es) of the epoch done",
        f"written      {m.get('created')} (shardwise {m.get('shardwise_version')}, torch {m.get('torch_version')}), "
        f"run {m.get('run_id') or '-'}",
        f"integrity    {_integrity_line(summary)}",
    ]
    if summary["ok"]:
        lines += [
            f"model        {summary['model_params']:,} parameters in {len(summary['tensors'])} tensors, "
            f"{_mb(summary['model_bytes'])}",
            f"optimizer    {_mb(summary['optimizer_bytes'])} of state",
            *([f"adapter      {adapter_line(m['adapter'])}"] if m.get("adapter") else []),
            f"trainer      RNG states of {summary['rng_ranks']} rank(s), {summary['lr_schedulers']} LR "
            f"scheduler(s), callbacks: {', '.join(summary['callbacks']) or '-'}",
            f"             entries: {', '.join(summary['trainer_state_keys'])}",
        ]
        if summary["hyper_parameters"]:
            lines.append("hparams      " + ", ".join(f"{k}={v}" for k, v in summary["hyper_parameters"].items()))
    lines.append("files")
    names = max((len(e["name"]) for e in summary["files"]), default=0)
    for e in summary["files"]:
        size = _mb(e["bytes"]) if e["bytes"] is not None else "-"
        lines.append(f"  {e['name']:<{max(40, names)}} {size:>14}  {e['status']}")
    for line in problems(summary):
        lines.append(f"  ! {line}")
    if not summary["ok"]:
        lines.append("not read further: the checkpoint is not intact")
        return "\n".join(lines)
    lines.append("tensors")
    width = max((len(t["name"]) for t in summary["tensors"][:limit]), default=10)
    for t in summary["tensors"][:limit]:
        lines.append(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']:<9} {_mb(t['bytes']):>12}")
    if len(summary["tensors"]) > limit:
        lines.append(f"  ... {len(summary['tensors']) - limit} more (--limit 0 lists all)")
    return "\n".join(lines)
