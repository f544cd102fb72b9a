"""The corpus pipeline's speed and memory: `shardwise.corpus.prepare` against `datasets.map`, and the packed
mixture's loader against what one H100 consumes.

    python benchmarks/data_pipeline.py --mb 8 --scale 10 --out /tmp/data-bench

1. Tokenisation: a generated JSON-lines corpus (Zipf-distributed pseudo-words, documents of 50-500 words) of
   `--mb` MB and of `--scale` times that, tokenised by a byte-level BPE tokenizer (16k vocabulary, trained
   here on a sample, so nothing is downloaded) with prepare at 1 and 2 processes and with datasets.map
   (batched, the same tokenizer, num_proc 1 and 2, writing its Arrow cache). Reported: tokens/s, CPU seconds
   per million tokens, and peak RSS (VmHWM) of the preparing process and of its largest worker.
2. Loading: PackedMixture over two prepared corpora (weights 0.7 / 0.3), seq_len 2048, batch 8 per rank,
   through a DataLoader (num_workers 0), read for `--seconds`: tokens/s per rank, against the ~12,000
   tokens/s an 8B model trains on one H100 (about 40% MFU), and the process's peak RSS.
3. Interrupting: `shardwise prepare` on the large corpus (2 processes) stopped with Ctrl-C at about 40% of the
   uninterrupted run's wall time and started again: chunks finished before the interruption, the re-run's wall
   time, and whether the shards equal the uninterrupted run's byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time


def _rss_peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _children_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _cpu() -> float:
    self_, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return self_.ru_utime + self_.ru_stime + kids.ru_utime + kids.ru_stime


def write_corpus(path: str, mb: float, seed: int = 0) -> int:
    import numpy as np

    vocab = random.Random(0)  # one language for every corpus (the tokenizer is trained on the first)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = np.array(["".join(vocab.choice(letters) for _ in range(vocab.randint(2, 9))) for _ in range(20_000)])
    zipf = 1 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    rng = np.random.default_rng(seed)
    docs = 0
    with open(path, "w") as f:
        while f.tell() < mb * 1e6:  # a block of documents at a time: numpy draws the words
            lengths = rng.integers(50, 501, size=2000)
            picked = words[rng.choice(len(words), size=int(lengths.sum()), p=zipf)]
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            f.writelines(
                '{"text": "' + " ".join(picked[bounds[i] : bounds[i + 1]]) + '"}\n' for i in range(len(lengths))
            )
            docs += len(lengths)
    return docs


def build_tokenizer(sample: str, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(sample) as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(2000), f)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16_000, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)
    return out


def bench_prepare(jsonl: str, tokenizer: str, out: str, num_proc: int) -> dict:
    from shardwise.corpus import prepare

    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.perf_counter(), _cpu()
    index = prepare([jsonl], out, tokenizer, num_proc=num_proc, chunk_bytes=4 * 2**20, progress=False)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    tokens = index["tokens"]
    return {
        "tool": f"prepare num_proc={num_proc}",
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "cpu_s_per_Mtok": cpu / tokens * 1e6,
        "rss_mb": _rss_peak_mb(),
        "worker_rss_mb": _children_peak_mb(),
        "disk_bytes_per_token": sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)) / tokens,
    }


def bench_map(jsonl: str, tokenizer: str, cache: str, num_proc: int) -> dict:
    import datasets
    from transformers import AutoTokenizer

    shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    t0, c0 = time.perf_counter(), _cpu()
    data = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache)
    mapped = data.map(
        lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]},
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["text"],
    )
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    import pyarrow.compute as pc  # counted from the Arrow column after the clock: no Python list per document

    tokens = int(pc.sum(pc.list_value_length(mapped.data.column("input_ids"))).as_py())
    return {
        "tool": f"datasets.map num_proc={num_proc}",
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "cpu_s_per_Mtok": cpu / tokens * 1e6,
        "rss_mb": _rss_peak_mb(),
        "worker_rss_mb": _children_peak_mb(),
        "disk_bytes_per_token": None,
    }


def bench_loader(corpora: dict, seconds: float) -> dict:
    from torch.utils.data import DataLoader

    from shardwise.corpus import PackedMixture

    mixture = PackedMixture(corpora, seq_len=2048, seed=0, dp_rank=0, dp_size=1)
    loader = DataLoader(mixture, batch_size=8)
    tokens, t0 = 0, time.perf_counter()
    for batch in loader:
        tokens += batch["input_ids"].numel()
        if time.perf_counter() - t0 > seconds:
            break
    rate = tokens / (time.perf_counter() - t0)
    return {"tool": "PackedMixture loader", "tokens_per_s": rate, "vs_h100_8b": rate / 12_000, "rss_mb": _rss_peak_mb()}


def _digest(folder: str) -> str:
    """One hash over every shard file of a prepared corpus (names and bytes), index and plan left out."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith((".tokens", ".starts.npy")):
            h.update(name.encode())
            with open(os.path.join(folder, name), "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()


def bench_interrupt(path: str, tokenizer: str, out: str, reference: str, after_s: float) -> dict:
    """`shardwise prepare` as a user runs it, interrupted (Ctrl-C) after `after_s`, then run again."""
    import signal

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardwise.cli", "prepare", path, "--out", out, "--tokenizer", tokenizer]
    cmd += ["--num_proc", "2", "--chunk_mb", "4"]  # the chunks of the in-process runs: the same shard files
    t0 = time.perf_counter()
    first = subprocess.Popen(  # SIGINT not ignored, even when this script runs as a background job
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(after_s)
    first.send_signal(signal.SIGINT)
    first.communicate()
    first_wall = time.perf_counter() - t0
    listed = os.listdir(out) if os.path.isdir(out) else []  # a very early Ctrl-C: nothing written yet
    done = [n for n in listed if n.endswith(".json") and n not in ("index.json", "plan.json")]
    t0 = time.perf_counter()
    again = subprocess.run(cmd, capture_output=True, text=True)
    again_wall = time.perf_counter() - t0
    with open(os.path.join(out, "plan.json")) as f:
        chunks = len(json.load(f)["chunks"])
    same = _digest(out) == _digest(reference)
    return {
        "tool": "shardwise prepare, Ctrl-C then again",
        "first_exit": first.returncode,
        "interrupted_after_s": round(first_wall, 1),
        "chunks_done_then": len(done),
        "chunks": chunks,
        "rerun_exit": again.returncode,
        "rerun_wall_s": round(again_wall, 1),
        "shards_equal_uninterrupted": same,
        "rerun_said": again.stdout.strip().splitlines()[-1:] or again.stderr.strip().splitlines()[-1:],
    }


def _fresh(argv: list) -> dict:
    """One measurement in a fresh process, so that its peak RSS is its own (imports included)."""
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
    row = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        tool, path, tokenizer, where, n = sys.argv[2:7]
        print(json.dumps((bench_prepare if tool == "prepare" else bench_map)(path, tokenizer, where, int(n))))
        return
    if sys.argv[1:2] == ["--interrupt"]:
        path, tokenizer, where, reference, after = sys.argv[2:7]
        print(json.dumps(bench_interrupt(path, tokenizer, where, reference, float(after))))
        return
    if sys.argv[1:2] == ["--loader"]:
        print(json.dumps(bench_loader(json.loads(sys.argv[2]), float(sys.argv[3]))))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=8.0)
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--out", default="/tmp/shardwise-data-bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    small, large = os.path.join(args.out, "small.jsonl"), os.path.join(args.out, "large.jsonl")
    write_corpus(small, args.mb, seed=0)
    write_corpus(large, args.mb * args.scale, seed=1)
    tokenizer = build_tokenizer(small, os.path.join(args.out, "tokenizer"))
    for name, path in (("1x", small), (f"{args.scale}x", large)):
        for tool in ("prepare", "map"):
            for n in (1, 2):
                where = os.path.join(args.out, f"{tool}-{name}-{n}")
                rows.append({"corpus": name, **_fresh(["--one", tool, path, tokenizer, where, str(n)])})
    corpora = {"large": (os.path.join(args.out, f"prepare-{args.scale}x-2"), 0.7),
               "small": (os.path.join(args.out, "prepare-1x-2"), 0.3)}  # fmt: skip
    rows.append(_fresh(["--loader", json.dumps(corpora), str(args.seconds)]))
    full = next(r for r in rows if r.get("corpus") == f"{args.scale}x" and r["tool"] == "prepare num_proc=2")
    after = 0.4 * full["tokens"] / full["tokens_per_s"]  # Ctrl-C at about 40% of the uninterrupted run's wall
    where = os.path.join(args.out, f"prepare-{args.scale}x-interrupted")
    _fresh(["--interrupt", large, tokenizer, where, corpora["large"][0], str(after)])
    print(f"cores available: {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
