"""Host-RAM cost of loading a pretrained Hugging Face model into FSDP shards (issue 5).

The seed recipe's first problem: when every rank reads the full checkpoint,
host RAM per node is ranks x model size (2 TB for Llama-2-70B on 8 GPUs).
This script saves a random-weight Llama of a few hundred MB, then on N local
processes measures each rank's peak RSS growth (VmHWM after resetting it via
/proc/self/clear_refs) for:

  shardwise   the recipe's path: meta-device build, fully_shard with the
              model's _no_split_modules, then rank 0 streams the safetensors
              and sends each rank only its slices (recipes/hf_model.py);
  naive       every rank calls AutoModelForCausalLM.from_pretrained.

For shardwise two phases are reported. "loading" starts once the empty
shards exist: it is what reading and distributing the weights costs, the
CPU counterpart of the seed's "CPU peak memory during loading" (its shards
lived in GPU memory, so they never showed in host RAM). "set-up" also
counts the shards themselves, which on a CPU-only machine are host RAM
(model size / ranks per rank, whatever the loading method).

    python benchmarks/finetune_loading.py                  # ~670 MB model, 2 ranks
    python benchmarks/finetune_loading.py --hidden 2048 --layers 8 --nproc 4
    DS_ACCELERATOR=cpu python benchmarks/finetune_loading.py --strategy deepspeed_stage_3 --skip-naive
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))


def save_model(path: str, hidden: int, layers: int, vocab: int, intermediate: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if not os.path.exists(os.path.join(path, "config.json")):
        with torch.device("cpu"):
            model = LlamaForCausalLM(config)
        model.save_pretrained(path, max_shard_size="2GB")
        del model
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def shardwise_worker(path: str, strategy_name: str = "fsdp") -> dict:
    from shardwise.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig, _build_strategy, build_module
    from shardwise.recipes.hf_model import inspect_model_folder

    cfg = FinetuneConfig(
        model_path=path, precision="32-true", strategy=strategy_name, data=DataOptions(dataset="(unused)")
    )
    folder = inspect_model_folder(path)
    strategy = _build_strategy(cfg, folder)
    strategy.connect("cpu", "32-true", devices=int(os.environ["WORLD_SIZE"]))
    if hasattr(strategy, "configure_training"):
        strategy.configure_training(micro_batch_size=1)  # DeepSpeed's config needs a batch size
    strategy.setup_environment()
    import torch.distributed as dist

    dist.barrier()
    reset_peak_rss()
    start = current_rss_bytes()
    module = build_module(cfg, folder, total_steps=1)
    with strategy.module_init_context():
        module.configure_model()
    strategy.setup_module(module)  # shards allocated, then init_weights: rank-0 load + send
    report = module.load_report
    setup_peak = max(report.peak_before, report.rss_before + report.peak_growth) - start
    # This rank's own partition: a DTensor's local shard (FSDP) or a ZeRO-3 partition.
    local = sum(
        t.numel() * t.element_size()
        for t in (
            getattr(p, "_local_tensor", None) if hasattr(p, "_local_tensor") else getattr(p, "ds_tensor", p)
            for p in module.parameters()
        )
    )
    dist.barrier()
    return {
        "rank": dist.get_rank(),
        "loading_peak": report.peak_growth,
        "setup_peak": setup_peak,
        "shards": local,
        "bytes_read": report.bytes_read,
        "end_rss": peak_rss_bytes(),
    }


def naive_worker(path: str) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from shardwise.memory import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    dist.barrier()
    reset_peak_rss()
    start = current_rss_bytes()
    model = AutoModelForCausalLM.from_pretrained(path)
    # from_pretrained may leave weights as lazily mapped file pages; reading
    # each one (as moving it to a GPU would) makes the cost visible.
    for p in model.parameters():
        p.detach().abs().sum()
    peak = peak_rss_bytes() - start
    dist.barrier()
    del model
    return {"rank": dist.get_rank(), "loading_peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardwise-bench-loading"))
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument(
        "--strategy",
        default="fsdp",
        help="the recipe's strategy: fsdp (default) or deepspeed_stage_3, whose loader gathers "
        "one partitioned parameter at a time",
    )
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON too")
    args = parser.parse_args()

    from shardwise import launch
    from shardwise.memory import format_bytes

    path = os.path.join(args.workdir, f"llama-h{args.hidden}-l{args.layers}-v{args.vocab}")
    size = save_model(path, args.hidden, args.layers, args.vocab, args.intermediate)
    ours = sorted(launch(shardwise_worker, path, args.strategy, devices=args.nproc), key=lambda r: r["rank"])
    naive = [] if args.skip_naive else sorted(launch(naive_worker, path, devices=args.nproc), key=lambda r: r["rank"])

    print(
        f"model: Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab}, "
        f"safetensors {format_bytes(size)}; {args.nproc} processes; strategy {args.strategy}; "
        f"{datetime.date.today().isoformat()}"
    )
    print()
    print(
        "| rank | shardwise: loading peak growth | shardwise: set-up peak growth (incl. own shards) "
        "| own shards | naive from_pretrained per rank |"
    )
    print("|---|---|---|---|---|")
    for i, r in enumerate(ours):
        nv = format_bytes(naive[i]["loading_peak"]) if naive else "-"
        print(
            f"| {r['rank']} | {format_bytes(r['loading_peak'])} | {format_bytes(r['setup_peak'])} "
            f"| {format_bytes(r['shards'])} | {nv} |"
        )
    base = max(1, ours[0]["loading_peak"])
    others = [r["loading_peak"] / base for r in ours[1:]]
    print()
    print(
        f"loading: rank 1..{args.nproc - 1} peak growth / rank 0's = "
        + ", ".join(f"{x:.1%}" for x in others)
        + " (target < 25%)"
    )
    if args.json:
        print(json.dumps({"size": size, "shardwise": ours, "naive": naive}))


if __name__ == "__main__":
    main()
