"""The recipe's rank-0 load and its export move shards on the collective device (issue 15).

Under FSDP `cpu_offload=True` and ZeRO-3 offload the local shards are CPU
tensors while the group is NCCL's, which moves only CUDA tensors. Before the
fix, hf_model sent/received/broadcast each slice on the shard's own device
(`_comm_device(t) == t.device`) and export called `DTensor.full_tensor()` on
CPU shards; now each slice goes through a staging copy on
`ops.collective_device()`. On 2 gloo processes tests/helpers/strict_device.py makes
send / recv / broadcast / DTensor.full_tensor refuse anything not on
"cuda:0" (the fakes hold CPU data), as NCCL would; on CPU every shard is a
CPU tensor, exactly as under offload on a GPU.

- the whole recipe (FSDP, cpu_offload=True, clipping on, learning rate 0):
  rank-0 load, one step, export; the exported folder equals the source;
- ZeRO-3 partitions (parameters carrying DeepSpeed's ds_* attributes,
  CPU partitions as under offload_param) filled by `_place_zero3`.
"""

import os

import pytest
import torch

import shardwise

from helpers.strict_device import strict_cuda_collectives


def run_recipe(model_dir, data, out):
    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig, finetune

    cfg = FinetuneConfig(
        model_path=model_dir,
        max_steps=1,
        precision="32-true",
        devices=2,
        strategy="fsdp",
        cpu_offload=True,
        learning_rate=0.0,
        max_grad_norm=1.0,
        output_dir=out,
        seed=3,
        enable_progress_bar=False,
        data=DataOptions(dataset=data, max_seq_len=32, packing=True, per_device_train_batch_size=2),
    )
    with strict_cuda_collectives() as calls:
        result = finetune(cfg)
    return result.output_dir, dict(calls)


def run_both(full_tensors, recipe_args):
    """One worker: the ZeRO-3 placement (its own process group, destroyed after), then the recipe (a group of
    its own); each only when its test is selected."""
    zero3 = run_zero3_partitions(full_tensors) if full_tensors is not None else None
    return zero3, run_recipe(*recipe_args) if recipe_args is not None else None


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """Both tests' runs in one launch of 2 ranks (start-up costs more than these runs)."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    full = recipe_args = None
    if "test_zero3_offload_partitions_arrive_through_the_collective_device" in selected:
        torch.manual_seed(0)
        full = [torch.randn(5, 3), torch.randn(7)]
    if "test_fsdp_offload_recipe_loads_and_exports_through_the_collective_device" in selected:
        from helpers.hf import build_model_folder, chat_records, write_jsonl

        root = tmp_path_factory.mktemp("offload")
        records = chat_records(32)
        model_dir = build_model_folder(str(root / "tiny-llama"), records)
        recipe_args = (model_dir, write_jsonl(str(root / "chat.jsonl"), records), str(root / "out"))
    ranks = shardwise.launch(run_both, full, recipe_args, devices=2)
    return {
        "zero3": (full, [zero3 for zero3, _ in ranks]),
        "recipe": (recipe_args and recipe_args[0], [recipe for _, recipe in ranks]),
    }


def test_fsdp_offload_recipe_loads_and_exports_through_the_collective_device(two_ranks):
    from safetensors.torch import load_file

    model_dir, ranks = two_ranks["recipe"]
    out, calls = ranks[0]
    # rank 0 sent slices, rank 1 received them, export gathered every tensor, clipping reduced its norm:
    # all on (fake) cuda:0.
    assert calls.get("send", 0) > 0 and ranks[1][1].get("recv", 0) > 0, (calls, ranks[1][1])
    assert calls.get("full_tensor", 0) > 0, calls
    source = load_file(os.path.join(model_dir, "model.safetensors"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert set(exported) == set(source)
    for key, value in source.items():  # learning rate 0: what was loaded is what comes out
        assert torch.equal(exported[key], value), key


def run_zero3_partitions(full_tensors):
    from shardwise.recipes import hf_model

    torch.distributed.init_process_group("gloo")  # shardwise.launch set the env:// variables
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    params = []
    for full in full_tensors:
        n = -(-full.numel() // world)
        param = torch.nn.Parameter(torch.empty(0))
        # What deepspeed.zero.Init leaves on a parameter (offload_param: the partition is on the host).
        param.ds_id, param.ds_numel, param.ds_shape = len(params), full.numel(), full.shape
        param.ds_process_group = torch.distributed.group.WORLD
        param.ds_tensor = torch.full((n,), float("nan"))
        params.append(param)
    scratch = hf_model._Scratch()
    with strict_cuda_collectives() as calls:
        for param, full in zip(params, full_tensors):
            hf_model._place(param, full if rank == 0 else None, rank, scratch)
    torch.distributed.destroy_process_group()
    return [p.ds_tensor.clone() for p in params], dict(calls)


def test_zero3_offload_partitions_arrive_through_the_collective_device(two_ranks):
    full, ranks = two_ranks["zero3"]
    assert ranks[0][1].get("send", 0) == 2 and ranks[1][1].get("recv", 0) == 2, ranks
    for i, tensor in enumerate(full):
        flat = tensor.reshape(-1)
        n = -(-flat.numel() // 2)
        assert torch.equal(ranks[0][0][i], flat[:n])
        assert torch.equal(ranks[1][0][i][: flat.numel() - n], flat[n:])
