"""Which GPU a rank takes, how NCCL is bound to it, and DeepSpeed's accelerator (issue 15).

No CUDA call is made: torch.cuda.is_available / device_count / set_device and
dist.init_process_group are patched, so the decisions run on this CPU machine.
- `srun --gpus-per-task=1` gives every rank one visible GPU: cuda:0, not
  cuda:LOCAL_RANK (which does not exist there);
- NCCL's process group gets `device_id` (eager init on the rank's GPU,
  subgroups split from it); gloo's does not;
- an inherited DS_ACCELERATOR=cpu while the model trains on CUDA is an error
  naming the variable, raised when the strategy is connected (before any
  worker starts); one this process set for an earlier CPU run is dropped.
"""

import os
import sys

import pytest
import torch
import torch.distributed as dist

from shardwise import DDPStrategy
from shardwise.distributed import faults
from shardwise.distributed.env import device_for
from shardwise.strategies import base


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


@pytest.mark.parametrize(
    "visible, local_rank, expected",
    [
        (1, 0, "cuda:0"),
        (1, 3, "cuda:0"),  # per-task binding: the one visible GPU
        (8, 3, "cuda:3"),
        (2, 1, "cuda:1"),  # every rank sees the node's GPUs
    ],
)
def test_device_for_picks_the_visible_gpu(monkeypatch, visible, local_rank, expected):
    fake_gpus(monkeypatch, visible)
    assert device_for("cuda", local_rank) == torch.device(expected)
    assert device_for("cpu", local_rank) == torch.device("cpu")


def test_more_ranks_than_visible_gpus_is_an_error_naming_both(monkeypatch):
    fake_gpus(monkeypatch, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=3 .* sees 2 GPUs .*CUDA_VISIBLE_DEVICES=4,5"):
        device_for("cuda", 3)


def _setup(monkeypatch, accelerator, local_rank, visible):
    fake_gpus(monkeypatch, visible)
    for name, value in {
        "RANK": str(local_rank),
        "WORLD_SIZE": "2",
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    # The rendezvous store (a real tcp:// client here, with no rank 0 serving): which address it was made for.
    monkeypatch.setattr(
        base, "generation_store", lambda env, timeout_s: calls.append(f"tcp://{env.master_addr}:{env.master_port}")
    )
    monkeypatch.setattr(faults, "install_worker", lambda **kwargs: None)
    monkeypatch.setattr(faults, "maybe_check_collectives", lambda *args: False)
    strategy = DDPStrategy()
    strategy.connect(accelerator)
    strategy.setup_environment()
    strategy._owns_process_group = False
    return strategy, calls


@pytest.mark.parametrize("visible, local_rank, expected", [(1, 1, "cuda:0"), (2, 1, "cuda:1")])
def test_nccl_process_group_is_bound_to_the_ranks_gpu(monkeypatch, visible, local_rank, expected):
    strategy, calls = _setup(monkeypatch, "cuda", local_rank, visible)
    assert strategy.root_device == torch.device(expected)
    store_address, kwargs = calls
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device(expected)
    assert store_address == "tcp://127.0.0.1:29999" and kwargs["rank"] == local_rank


def test_ddp_alone_makes_no_process_group(monkeypatch):
    # One process without a launcher: DDP has nothing to communicate (FSDP and DeepSpeed make a group of one).
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    strategy = DDPStrategy()
    strategy.connect("cpu")
    strategy.setup_environment()
    assert calls == [] and not strategy._owns_process_group


def test_gloo_process_group_has_no_device_id(monkeypatch):
    strategy, calls = _setup(monkeypatch, "cpu", 1, 0)
    assert calls[1]["backend"] == "gloo" and calls[1].get("device_id") is None


def test_inherited_ds_accelerator_cpu_with_a_cuda_model_is_an_error(monkeypatch):
    from shardwise.strategies import deepspeed as ds
    from shardwise.strategies import deepspeed_env

    monkeypatch.setattr(deepspeed_env, "_DS_ACCELERATOR_SET_HERE", False)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(ds.DeepSpeedConfigError, match=r"DS_ACCELERATOR='cpu'.*CUDA"):
        deepspeed_env.ensure_accelerator_env("cuda")
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ds.DeepSpeedConfigError, match="DS_ACCELERATOR"):
        ds.DeepSpeedStrategy(stage=2).connect("cuda")  # when the Trainer connects it, before any worker


def test_ds_accelerator_set_by_an_earlier_cpu_run_is_dropped_for_cuda(monkeypatch):
    from shardwise.strategies import deepspeed_env as ds

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(ds, "_DS_ACCELERATOR_SET_HERE", False)
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)  # as before DeepSpeed's first import
    ds.ensure_accelerator_env("cpu")
    assert ds._DS_ACCELERATOR_SET_HERE and os.environ["DS_ACCELERATOR"] == "cpu"
    ds.ensure_accelerator_env("cuda")
    assert "DS_ACCELERATOR" not in os.environ


def test_single_process_fsdp_on_a_gpu_gets_an_nccl_group_bound_to_it(monkeypatch):
    # One GPU, no launcher: FSDP's private world-of-one group must move CUDA tensors (gloo
    # cannot reduce-scatter them for the CUDA mesh FSDP2 shards over).
    from shardwise import FSDPStrategy
    from shardwise.strategies import fsdp
    from shardwise.strategies.mesh import Meshes

    fake_gpus(monkeypatch, 1)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 1)
    monkeypatch.setattr(fsdp.ParallelMesh, "build", lambda self, device_type: Meshes(fsdp=None))
    strategy = FSDPStrategy(timeout_s=42.0)
    strategy.connect("cuda")
    strategy.setup_environment()
    strategy._owns_process_group = False
    (kwargs,) = calls
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 0)
    assert (kwargs["rank"], kwargs["world_size"]) == (0, 1)
    assert kwargs["init_method"] is None and isinstance(kwargs["store"], dist.HashStore)  # no port, no agent
    assert kwargs["timeout"].total_seconds() == 42.0  # the strategy's timeout, as for a launched world


def test_device_memory_auto_leaves_the_memory_outside_the_allocator(monkeypatch):
    """'auto' is the device's total less the CUDA context and (with peers) NCCL's buffers, and says so."""
    import types

    from shardwise.plan import advice

    total = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=total))
    alone = advice.resolve_device_memory("auto", "cuda", world_size=1)
    with_peers = advice.resolve_device_memory("auto", "cuda", world_size=16)
    assert alone == total - advice.CUDA_CONTEXT_BYTES
    assert with_peers == alone - advice.NCCL_BYTES
    assert advice.resolve_device_memory("auto", "cpu", world_size=16) is None  # unknown: nothing is judged
    assert advice.resolve_device_memory("40GiB", "cuda", world_size=16) == 40 * 2**30  # a given size is kept
    note = advice._auto_note(16)
    assert "80.0 GiB" in note and "CUDA context" in note and "NCCL" in note


@pytest.mark.deepspeed
def test_a_one_process_deepspeed_fit_leaves_no_launcher_world_behind(monkeypatch):
    # DeepSpeed reads RANK / WORLD_SIZE / LOCAL_RANK even on one process, so the strategy exports them. A
    # child process started after the fit with this environment (a sweep's script, a test's subprocess)
    # must not read RANK=0 / WORLD_SIZE=1 as a launcher's world: its Trainer(devices=2) would refuse to start.
    pytest.importorskip("deepspeed")
    import subprocess

    from shardwise import Trainer
    from shardwise.demos.boring_classes import BoringModel
    from shardwise.distributed.env import detect_env

    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SHARDWISE_ENV_DEFAULTS", raising=False)
    trainer = Trainer(
        strategy="deepspeed", accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False
    )
    trainer.fit(BoringModel())
    assert {name: os.environ.get(name) for name in names} == dict(
        RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0"
    )
    assert detect_env() is None  # this process: no launcher
    child = "from shardwise.distributed.env import detect_env; print(detect_env())"
    out = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, env=dict(os.environ), check=True
    )
    assert out.stdout.strip() == "None", out  # a child with this environment: no launcher either
    with monkeypatch.context() as launcher:  # a launcher's own values over the ones exported: believed
        for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", LOCAL_RANK="0").items():
            launcher.setenv(name, value)  # its rank 0: RANK=0 as exported, the world not
        assert (detect_env().global_rank, detect_env().world_size) == (0, 2)
    trainer.strategy.teardown()
    assert [name for name in names + ("SHARDWISE_ENV_DEFAULTS",) if name in os.environ] == []  # as it was
