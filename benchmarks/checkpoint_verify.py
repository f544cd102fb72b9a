"""What verifying a checkpoint costs: a 1 GB one-file checkpoint and a 1 GB sharded one, in one process.

    python benchmarks/checkpoint_verify.py [--gb 1.0] [--repeats 3] [--out BENCHMARKS.md]

A model of Linear(4096, 4096) layers (fp32, about --gb GB, no optimizer
state) is saved in both formats through the same functions a Trainer uses
(checkpoint/formats.py), then, --repeats times each (medians reported):

- save: torch.save + fsync of the model's state with the one-file trailer
  (hashed while torch.save writes) and without; the sharded save (DCP), which
  hashes its file after writing it;
- verify only: the one file's digest (64 MiB leaves on one thread per core)
  and the sharded directory's sha256s, beside hashlib's sha256 of the same
  file as the raw speed;
- load into the model, verified and with SHARDWISE_VERIFY_CHECKSUMS=0, with
  the file in the page cache (warm) and dropped from it first (cold:
  posix_fadvise DONTNEED, no root needed), with the bytes the process read
  through read() (rchar) and from the disk (read_bytes) during the load. A
  verified load that read the file twice would show about twice its size.

Prints a markdown table; with --out, replaces the section "#### Verification
cost" of that file.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import re
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Dict

import torch
from torch import nn

from shardwise.checkpoint import onefile
from shardwise.checkpoint.formats import load_model_and_optimizers, save_model_and_optimizers
from shardwise.checkpoint.integrity import VERIFY_ENV, verify_directory
from shardwise.checkpoint.layout import build_manifest, read_manifest, save_torch_durably

SECTION = "#### Verification cost"
MB = 1e6


def _io() -> Dict[str, int]:
    with open("/proc/self/io") as fh:
        return {k: int(v) for k, v in (line.split(":") for line in fh)}


def _drop_cache(path: str) -> None:
    """Drop the clean pages of `path` (every file under it) from the page cache: the next read is cold."""
    files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _timed(fn: Callable[[], Any], repeats: int, before: Callable[[], None] = lambda: None) -> Dict[str, float]:
    """Median wall and CPU seconds of `fn` and the median bytes read (rchar, read_bytes) while it ran."""
    seconds, cpu, rchar, disk = [], [], [], []
    for _ in range(repeats):
        before()
        io0, t0, c0 = _io(), time.perf_counter(), time.process_time()
        fn()
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        io1 = _io()
        rchar.append(io1["rchar"] - io0["rchar"])
        disk.append(io1["read_bytes"] - io0["read_bytes"])
    return {
        "s": statistics.median(seconds),
        "cpu": statistics.median(cpu),
        "rchar": statistics.median(rchar),
        "disk": statistics.median(disk),
    }


def measure(root: str, gb: float, repeats: int) -> Dict[str, Any]:
    layers = max(1, round(gb * 1e9 / (4096 * 4097 * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(layers)])
    state = {"shardwise": build_manifest("full", "single", 1, {}), "train_state": {"global_step": 0}}
    full, sharded = os.path.join(root, "one.ckpt"), os.path.join(root, "sharded.ckpt")
    plain = os.path.join(root, "plain.pt")
    out: Dict[str, Any] = {"layers": layers}
    body = {"state_dict": model.state_dict(), "optimizer_states": []}
    manifest = state["shardwise"]
    out["save plain torch.save"] = _timed(lambda: save_torch_durably(body, plain), repeats)
    out["save one file (trailer)"] = _timed(lambda: save_torch_durably(body, plain, manifest=manifest), repeats)
    os.unlink(plain)
    save_model_and_optimizers(model, [], full, state, "full")  # as a Trainer saves: what the loads read
    sharded_state = {**state, "shardwise": build_manifest("sharded", "single", 1, {})}
    out["save sharded"] = _timed(lambda: save_model_and_optimizers(model, [], sharded, sharded_state, "sharded"), 1)
    out["sizes"] = {"one file": _size(full), "sharded": _size(sharded)}
    trailer = onefile.read_trailer(full)
    manifest = read_manifest(sharded)
    shard = next(os.path.join(sharded, n) for n in os.listdir(sharded) if n.endswith(".distcp"))

    def sha256_of(path: str) -> None:
        with open(path, "rb") as fh:
            hashlib.file_digest(fh, "sha256")

    for label, path in (("one file", full), ("sharded", sharded)):
        for cache in ("warm", "cold"):
            drop = (lambda p=path: _drop_cache(p)) if cache == "cold" else (lambda: None)
            raw = full if label == "one file" else shard
            out[f"sha256 of the data, {label}, {cache}"] = _timed(lambda r=raw: sha256_of(r), repeats, drop)
            verify = (
                (lambda: onefile.verify(full, trailer))
                if label == "one file"
                else (lambda: verify_directory(sharded, manifest, verify=True))
            )
            out[f"verify only, {label}, {cache}"] = _timed(verify, repeats, drop)
            fmt = "full" if label == "one file" else "sharded"
            for flag in ("1", "0"):
                os.environ[VERIFY_ENV] = flag
                key = f"load {'verified' if flag == '1' else 'unverified'}, {label}, {cache}"
                out[key] = _timed(lambda p=path, f=fmt: load_model_and_optimizers(model, [], p, f), repeats, drop)
            os.environ.pop(VERIFY_ENV, None)
    return out


def render(r: Dict[str, Any]) -> str:
    sizes = r["sizes"]
    lines = [
        f"Model: {r['layers']} x Linear(4096, 4096) fp32, no optimizer state; one process; "
        f"one file {sizes['one file'] / MB:,.0f} MB, sharded {sizes['sharded'] / MB:,.0f} MB "
        f"({os.cpu_count()} CPU cores, one thread per core hashes the one file's 64 MiB leaves). "
        "Medians of the repeats; wall time, with the process's CPU time (all threads) beside it, steadier on a "
        "shared machine. read() = bytes read through read() calls (rchar), disk = bytes from the block device "
        "(read_bytes).",
        "",
        "| operation | one file | read(), disk | sharded (DCP) | read(), disk |",
        "|---|---|---|---|---|",
    ]

    def cell(key: str) -> str:
        m = r.get(key)
        return "-" if m is None else f"{m['s']:.2f} s (CPU {m['cpu']:.2f} s)"

    def io(key: str) -> str:
        m = r.get(key)
        return "-" if m is None else f"{m['rchar'] / MB:,.0f} MB, {m['disk'] / MB:,.0f} MB"

    rows = [
        ("save: torch.save + fsync, with the trailer (hashed as written)", "save one file (trailer)", "save sharded"),
        ("save: torch.save + fsync, no trailer", "save plain torch.save", None),
    ]
    for cache in ("warm", "cold"):
        rows += [
            (f"sha256 of the data file ({cache})", f"sha256 of the data, one file, {cache}",
             f"sha256 of the data, sharded, {cache}"),
            (f"verify only ({cache})", f"verify only, one file, {cache}", f"verify only, sharded, {cache}"),
            (f"load, verified ({cache})", f"load verified, one file, {cache}", f"load verified, sharded, {cache}"),
            (f"load, {VERIFY_ENV}=0 ({cache})", f"load unverified, one file, {cache}",
             f"load unverified, sharded, {cache}"),
        ]  # fmt: skip
    for label, one, shard in rows:
        lines.append(
            f"| {label} | {cell(one)} | {io(one) if 'load' in one else '-'} | "
            f"{cell(shard) if shard else '-'} | {io(shard) if shard and 'load' in shard else '-'} |"
        )
    return "\n".join(lines)


def write_section(path: str, body: str, command: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    date = datetime.date.today().isoformat()
    section = f"{SECTION}\n\nCommand: `{command}` ({date}, torch {torch.__version__}).\n\n{body}\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^##+ |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        anchor = re.search(r"^#### Chaos resume", text, re.M)  # beside the other checkpoint sections
        at = anchor.start() if anchor else len(text)
        text = text[:at] + section + "\n" + text[at:]
    with open(path, "w") as fh:
        fh.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description="what verifying a checkpoint costs")
    parser.add_argument("--gb", type=float, default=1.0, help="model (and so checkpoint) size in GB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="markdown file whose section to replace")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary dir)")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "no process group" and the opt-out's own notice
        with tempfile.TemporaryDirectory(prefix="shardwise-verify-", dir=args.dir) as root:
            results = measure(root, args.gb, args.repeats)
    body = render(results)
    print(body)
    if args.out:
        command = "python benchmarks/checkpoint_verify.py" + (f" --gb {args.gb}" if args.gb != 1.0 else "")
        write_section(args.out, body, f"{command} --repeats {args.repeats} --out {os.path.basename(args.out)}")


if __name__ == "__main__":
    main()
