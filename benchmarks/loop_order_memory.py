"""FSDP1 (as Lightning 2.1 ran it) vs FSDP2 (as shardwise runs it): per-phase peak tracked memory, CPU/gloo, 2 ranks.

Model: the demo Transformer of Lightning's FSDP guide (ninp 1024, nhid 4096, nhead 64, vocab 33278, seq 35, batch 1) at
NL encoder+decoder layer pairs; fp32; torch.optim.Adam (for-loop on CPU, as foreach=False); wrap policy
{TransformerEncoderLayer, TransformerDecoderLayer}. Memory = shardwise.memory.MemoryTracker (live tensor
storages), started once model and optimizer exist. BENCHMARKS.md, "Memory planner against published GPU figures".
Usage: python benchmarks/loop_order_memory.py NL CONFIG [CONFIG...]
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MIB = 2**20


def build(nl):
    from shardwise.models import Transformer

    torch.manual_seed(0)
    return Transformer(vocab_size=33278, nlayers=nl, nhid=4096, ninp=1024, nhead=64)


def wrap(model, config):
    policy = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
    if config.startswith("fsdp1"):
        from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        sharding = ShardingStrategy.SHARD_GRAD_OP if "sgo" in config else ShardingStrategy.FULL_SHARD
        kwargs = dict(use_orig_params="flat" not in config)
        if "nomp" not in config:  # Lightning 2.1's FSDPPrecision("32-true") with torch >= 2.0
            kwargs["mixed_precision"] = MixedPrecision(
                param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            )
        if "offload" in config:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        return FSDP(
            model,
            sharding_strategy=sharding,
            auto_wrap_policy=ModuleWrapPolicy(policy),
            device_id=torch.device("cpu"),
            **kwargs,
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    raf = "sgo" not in config
    for m in list(model.modules()):
        if type(m) in policy:
            fully_shard(m, mesh=mesh, reshard_after_forward=raf)
    fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return model


def worker(rank, nl, configs, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from shardwise.memory import MemoryTracker

    results = {}
    for config in configs:
        model = wrap(build(nl), config)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 33278, (1, 35), generator=g)
        y = torch.randint(0, 33278, (1, 35), generator=g)
        tr = MemoryTracker().register(model, [opt])
        rows = []
        with tr:
            for step in range(1, 4):
                # _L: Lightning's automatic optimization (Closure: training_step, zero_grad, backward, then
                # optimizer.step); otherwise shardwise's Trainer (forward, backward, step, zero_grad).
                order = ("fwd", "zero", "bwd", "opt") if config.endswith("_L") else ("fwd", "bwd", "opt", "zero")
                for phase in order:
                    tr.reset_peak()
                    start = tr.current_bytes
                    if phase == "fwd":
                        loss = F.nll_loss(model(x, y), y.view(-1))
                    elif phase == "bwd":
                        loss.backward()
                        del loss
                    elif phase == "opt":
                        opt.step()
                    else:
                        opt.zero_grad(set_to_none=True)
                    rows.append(
                        dict(
                            step=step,
                            phase=phase,
                            start=start / MIB,
                            peak=tr.peak_bytes / MIB,
                            end=tr.current_bytes / MIB,
                            at_peak={k: round(v / MIB, 1) for k, v in tr.peak_breakdown.items() if v},
                        )
                    )
        results[config] = dict(rows=rows, overall=max(r["peak"] for r in rows))
        del model, opt, tr
        dist.barrier()
    if rank == 0:
        json.dump(results, open(out, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    nl, configs = int(sys.argv[1]), sys.argv[2].split(",")
    out = sys.argv[3] if len(sys.argv) > 3 else "/tmp/pw/fsdp_mem.json"
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(worker, args=(nl, configs, port, out), nprocs=2)
    res = json.load(open(out))
    for config, r in res.items():
        print(f"== {config}: overall peak {r['overall']:.1f} MiB")
        for row in r["rows"]:
            print(
                f"  step{row['step']} {row['phase']:4s} start {row['start']:8.1f} peak {row['peak']:8.1f} "
                f"end {row['end']:8.1f}  at peak {row['at_peak']}"
            )
