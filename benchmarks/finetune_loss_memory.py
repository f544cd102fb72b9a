"""The fine-tuning recipe's loss: tracked peak memory of one step, chunked cross-entropy vs the float32 copy.

The recipe (recipes/causal_lm.py) used to score the logits with
`F.cross_entropy(logits.float(), ...)`: a float32 copy of the whole logits,
kept alive (as its log-softmax) until backward, and float32 gradients of the
same size. It now calls `losses.chunked_cross_entropy(..., reduction="sum")`.
This script runs one recipe step -- `CausalLMModule.training_step` on a packed
batch, backward, the recipe's AdamW step -- on a Llama whose vocabulary
dominates (vocab 32000, hidden 64, 2 layers), once with the recipe's loss and
once with the former float32 loss (`float32_summed_loss` below, the removed
code), under `shardwise.memory.MemoryTracker` (live tensor storages, CPU), and
prints the peak of each and the two losses. BENCHMARKS.md, "Fine-tuning: the
loss without a float32 copy of the logits".

Usage: python benchmarks/finetune_loss_memory.py [--rows 4] [--seq 512] [--precision 32-true bf16-true]
"""

from __future__ import annotations

import argparse
import json
import types

import torch
import torch.nn.functional as F

MIB = 2**20


def float32_summed_loss(self, batch):
    """The recipe's loss before the chunked one (no sequence parallel here): a float32 copy of all logits."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    logits = self.model(**inputs, use_cache=False).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )


def build_model(vocab: int, hidden: int, layers: int, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype)


def packed_batch(rows: int, seq: int, vocab: int):
    """Blocks of two documents each (position ids restart), as the recipe's packing makes them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    half = seq // 2
    positions = torch.cat([torch.arange(half), torch.arange(seq - half)]).expand(rows, seq).contiguous()
    labels = ids.clone()
    labels[:, half] = -100  # a document's first token is not predicted from the previous one
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def one_step(loss_fn, precision: str, args) -> dict:
    from shardwise.memory import MemoryTracker
    from shardwise.recipes.causal_lm import CausalLMModule
    from shardwise.recipes.finetune import FinetuneConfig

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    module = CausalLMModule(FinetuneConfig(precision=precision, learning_rate=1e-4), None, 1)
    module.model = build_model(args.vocab, args.hidden, args.layers, dtype)
    module._summed_loss = types.MethodType(loss_fn, module)
    optimizer = module.configure_optimizers()["optimizer"]
    batch = packed_batch(args.rows, args.seq, args.vocab)
    with MemoryTracker().register(module, [optimizer]) as tracker:
        loss = module.training_step(batch, 0)
        value = float(loss.detach())
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    logits = args.rows * args.seq * args.vocab * (2 if dtype == torch.bfloat16 else 4)
    return dict(
        loss=value,
        peak_mib=tracker.peak_bytes / MIB,
        at_peak={k: round(v / MIB, 1) for k, v in tracker.peak_breakdown.items() if v},
        logits_mib=logits / MIB,
    )


def main() -> None:
    from shardwise.recipes.causal_lm import CausalLMModule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-true"])
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = {}
    for precision in args.precision:
        chunked = one_step(CausalLMModule._summed_loss, precision, args)
        old = one_step(float32_summed_loss, precision, args)
        out[precision] = dict(chunked=chunked, float32_copy=old)
        print(
            f"{precision}: logits {chunked['logits_mib']:.0f} MiB; peak tracked: chunked loss "
            f"{chunked['peak_mib']:.0f} MiB, float32 copy {old['peak_mib']:.0f} MiB "
            f"({chunked['peak_mib'] / old['peak_mib']:.2f}x); summed loss {chunked['loss']:.6f} vs {old['loss']:.6f} "
            f"(rel. diff {abs(chunked['loss'] - old['loss']) / abs(old['loss']):.1e})"
        )
        print(f"  at peak, chunked: {chunked['at_peak']}")
        print(f"  at peak, float32: {old['at_peak']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
