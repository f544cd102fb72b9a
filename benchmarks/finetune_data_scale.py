"""How `shardwise finetune`'s data preparation scales: peak memory, CPU time per million tokens, wall time with
1 and 2 processes, and the cache's size, on a generated chat data set (tagged format, a trained byte-level BPE
tokenizer of 16,000 tokens); beside it `datasets.map` with one process doing the same per-record work
(the chat rendered, tokenised with offsets, the assistant-token mask: build_cache's own encoder on the same
batches), the reference for CPU time, and `datasets.map` tokenising only the rendered text, the lower bound of
any such job. Each measurement runs in a fresh process, so its peak RSS (VmHWM, reset after the imports) is its
own; the preparation is `recipes/data.build_cache`, what the recipe runs on its preparing rank.

    python benchmarks/finetune_data_scale.py --conversations 300000 --small 30000
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

WORDS = [f"w{i}" for i in range(3000)]


def _rss_peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def write_chats(path: str, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    cum = list(itertools.accumulate(1 / (i + 1) for i in range(len(WORDS))))  # Zipf (the draws of weights=)

    def sentence(k: int) -> str:
        return " ".join(rng.choices(WORDS, cum_weights=cum, k=k))

    with open(path, "w") as f:
        for i in range(n):
            turns = [{"role": "system", "content": sentence(8)}]
            for _ in range(rng.randint(1, 3)):
                turns += [
                    {"role": "user", "content": sentence(rng.randint(10, 40))},
                    {"role": "assistant", "content": sentence(rng.randint(20, 80))},
                ]
            f.write(json.dumps({"messages": turns, "id": i}) + "\n")


def build_tokenizer(sample: str, out: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tags = ["<|endoftext|>", "<|system|>", "<|prompter|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(sample) as f:
        texts = [m["content"] for _, line in zip(range(2000), f) for m in json.loads(line)["messages"]]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16_000, special_tokens=tags))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def bench_prepare(jsonl: str, tokenizer: str, cache: str, num_proc: int) -> dict:
    from transformers import AutoTokenizer

    from shardwise.recipes import data as D

    shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    spec = D.DataSpec(path=jsonl, max_seq_len=2048, assistant_only_loss=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on: the preparation, not the imports
    t0, c0 = time.perf_counter(), _cpu()
    folder = os.path.join(cache, D.cache_key(spec, tok))
    summary = D.build_cache(spec, tok, folder, num_proc)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    tokens = summary["train"]["tokens"]
    size = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    return {
        "tool": f"build_cache num_proc={num_proc}",
        "tokens": tokens,
        "wall_s": wall,
        "cpu_s_per_Mtok": cpu / tokens * 1e6,
        "rss_mb": _rss_peak_mb(),
        "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "cache_bytes_per_token": size / tokens,
    }


def bench_map(jsonl: str, tokenizer: str, cache: str, job: str) -> dict:
    """datasets.map with one process. job "same": build_cache's per-record work on its batches of 512 (the
    chat rendered, tokenised with offsets, the assistant mask), written as input_ids and mask columns;
    job "text": only the rendered text tokenised (no offsets, no mask), the lower reference."""
    import datasets
    from transformers import AutoTokenizer

    from shardwise.recipes import data as D

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as each build_cache worker: CPU time like for like
    shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    spec = D.DataSpec(path=jsonl, max_seq_len=2048, assistant_only_loss=True)
    encoder = D.RecordEncoder(tok, "messages", "tags", spec)
    counted = [0]

    def same(batch: dict) -> dict:
        docs = encoder({"messages": batch["messages"]}, len(batch["messages"]), 0)
        counted[0] += sum(len(ids) for ids, _ in docs)
        return {"input_ids": [ids for ids, _ in docs], "mask": [flags.astype("uint8") for _, flags in docs]}

    def text(batch: dict) -> dict:
        ids = tok([D.record_text(m, "tags", tok) for m in batch["messages"]])["input_ids"]
        counted[0] += sum(len(x) for x in ids)
        return {"input_ids": ids}

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0, c0 = time.perf_counter(), _cpu()
    data = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache)
    data.map(same if job == "same" else text, batched=True, batch_size=512, remove_columns=data.column_names)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    tokens = counted[0]
    label = "render + tokenise + assistant mask" if job == "same" else "tokenise rendered text only"
    return {"tool": f"datasets.map num_proc=1 ({label})", "tokens": tokens, "wall_s": wall,
            "cpu_s_per_Mtok": cpu / tokens * 1e6, "rss_mb": _rss_peak_mb()}  # fmt: skip


def _fresh(argv: list) -> dict:
    done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=300_000)
    parser.add_argument("--small", type=int, default=30_000, help="the 1x of the 1x / 10x memory check")
    parser.add_argument("--map_conversations", type=int, default=None, help="datasets.map's set (default: all)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--one", nargs="*", help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args()
    if args.one:
        what, jsonl, tokenizer, cache, *rest = args.one
        row = (
            bench_map(jsonl, tokenizer, cache, rest[0])
            if what == "map"
            else bench_prepare(jsonl, tokenizer, cache, int(rest[0]))
        )
        print(json.dumps(row))
        return
    work = args.workdir or tempfile.mkdtemp(prefix="ft-data-scale-")
    os.makedirs(work, exist_ok=True)
    n_map = args.map_conversations or args.conversations
    sets = {n: os.path.join(work, f"chat-{n}.jsonl") for n in {args.conversations, args.small, n_map}}
    for n, path in sets.items():
        if not os.path.exists(path):
            write_chats(path, n)
    tokenizer = build_tokenizer(sets[args.conversations], os.path.join(work, "tok"))
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    rows = []
    cache = os.path.join(work, "cache")
    runs = [("prepare", n, procs) for n in (args.conversations, args.small) for procs in ("1", "2")]
    runs += [("map", n_map, "same"), ("map", n_map, "text")]
    for what, n, how in runs:
        row = _fresh(["--one", what, sets[n], tokenizer, cache if what == "prepare" else os.path.join(work, "hf"), how])
        rows.append({"conversations": n, "mb": os.path.getsize(sets[n]) / 2**20, **row})
        print(json.dumps(rows[-1]), flush=True)
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print("| conversations | MB | tool | tokens | wall s | CPU-s / M tokens | peak RSS MB | cache bytes / token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cache_b = f"{r['cache_bytes_per_token']:.2f}" if "cache_bytes_per_token" in r else "-"
        print(f"| {r['conversations']:,} | {r['mb']:.0f} | {r['tool']} | {r['tokens']:,} | {r['wall_s']:.1f} | "
              f"{r['cpu_s_per_Mtok']:.2f} | {r['rss_mb']:.0f} | {cache_b} |")  # fmt: skip


if __name__ == "__main__":
    main()
