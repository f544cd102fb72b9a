"""GPU first contact, part 1 (issue 36): what a first run on a GPU cluster hits, checked on this CPU machine.

No CUDA call is made: torch.cuda functions are patched where a decision reads them.
- one GPU per task (`srun --gpus-per-task=1`, a CUDA_VISIBLE_DEVICES per rank): Trainer(devices=8) under
  the launcher is accepted, and DeepSpeed is given LOCAL_RANK = the visible GPU's index while shardwise
  keeps the node-local rank;
- TF32 switched on the torch >= 2.9 way does not break the throughput monitor's precision lookup;
- the peak table names more GPUs, and a GPU it does not name is said once instead of a silent no-MFU;
- deterministic=True sets CUBLAS_WORKSPACE_CONFIG before CUDA starts, unless the user set it;
- a launched worker honours OMP_NUM_THREADS and hands back CPU tensors;
- the planner's first batch is drawn on the rank's own GPU; the recipe pins its batches on CUDA;
- memory snapshots record Python stacks unless C++ ones are asked for.
"""

import collections
import os
import types
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise import Trainer, flops
from shardwise.callbacks.profiling import ProfileSteps
from shardwise.distributed import env as env_module
from shardwise.distributed.env import detect_env, device_for, resolve_devices
from shardwise.distributed.launch import host_result
from shardwise.plan.advice import check_before_fit
from shardwise.recipes.data import DataOptions, FinetuneData, PreparedData
from shardwise.strategies.deepspeed_env import apply_rank_env, ensure_accelerator_env


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)  # the old switch as it was (this also sets the new one) ...
    torch.backends.cuda.matmul.fp32_precision = "none"  # ... which is cleared: the old one decides, as at start
    torch.backends.fp32_precision = "none"


@pytest.mark.parametrize(
    "switch, kind",
    [
        (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), "tf32"),
        (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), "fp32"),
        (lambda: setattr(torch.backends, "fp32_precision", "tf32"), "tf32"),  # the global switch, inherited
        (lambda: torch.set_float32_matmul_precision("high"), "tf32"),  # the old switch still counts
        (lambda: None, "fp32"),  # torch's default: IEEE float32
    ],
)
def test_tf32_set_the_new_way_is_read_without_raising(restore_matmul_precision, switch, kind):
    switch()
    assert flops.number_kind("32-true") == kind
    assert flops.number_kind("bf16-mixed") == "bf16"


def test_peak_table_names_more_gpus():
    assert flops.lookup_peak("NVIDIA GH200 480GB", "bf16") == ("GH200", 989.5)
    assert flops.lookup_peak("NVIDIA H800", "tf32") == ("H800 SXM", 494.5)
    assert flops.lookup_peak("NVIDIA H800 PCIe", "bf16") == ("H800 PCIe", 756.5)
    assert flops.lookup_peak("NVIDIA A800-SXM4-80GB", "fp16") == ("A800", 312.0)
    assert flops.lookup_peak("NVIDIA A10", "bf16") == ("A10", 125.0)
    assert flops.lookup_peak("NVIDIA A10G", "bf16")[0] == "A10G"  # not the A10 entry
    assert flops.lookup_peak("NVIDIA L40S", "fp32") == ("L40S", 91.6)
    assert flops.lookup_peak("NVIDIA L4", "bf16") == ("L4", 121.0)  # not the L40S entry
    assert flops.lookup_peak("NVIDIA H200", "bf16") == ("H200", 989.5)  # not GH200


def test_a_gpu_missing_from_the_table_is_named_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Imaginary X9")
    monkeypatch.setattr(flops, "_WARNED", set())
    with pytest.warns(UserWarning, match=r"'NVIDIA Imaginary X9' is not in .*peak_tflops"):
        peak, source = flops.device_peak(torch.device("cuda", 0), "bf16-mixed")
    assert peak is None and "NVIDIA Imaginary X9" in source
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second fit of the process: said already
        assert flops.device_peak(torch.device("cuda", 0), "bf16-mixed")[0] is None
        assert flops.device_peak(torch.device("cuda", 0), "bf16-mixed", 100.0)[0] == 100.0  # a given peak: silent


# ------------------------------------------------------------------ one GPU per task
def _srun_task(monkeypatch, local_rank, visible, tasks=8):
    """This process as task `local_rank` of `srun --ntasks-per-node=tasks`, seeing `visible` GPUs."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so what apply_rank_env sets is undone after the test
        monkeypatch.delenv(name)
    for name, value in {
        "SLURM_NTASKS": str(tasks),
        "SLURM_PROCID": str(local_rank),
        "SLURM_LOCALID": str(local_rank),
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "gpu001",
        "CUDA_VISIBLE_DEVICES": str(local_rank) if visible == 1 else ",".join(map(str, range(visible))),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(env_module, "_LOCAL_RANK_IS_DEVICE", None, raising=False)


def test_one_gpu_per_task_is_accepted_under_the_launcher(monkeypatch):
    _srun_task(monkeypatch, local_rank=3, visible=1)
    assert resolve_devices(8, "cuda") == 8
    assert device_for("cuda", detect_env().local_rank) == torch.device("cuda", 0)
    trainer = Trainer(accelerator="cuda", devices=8, strategy="ddp")  # raised "this machine has 1 CUDA device(s)"
    assert trainer.devices == 8 and Trainer(accelerator="cuda", devices="auto").devices == 8


def test_visible_gpus_that_cannot_serve_every_local_rank_stay_an_error(monkeypatch):
    _srun_task(monkeypatch, local_rank=3, visible=2)
    with pytest.raises(ValueError, match=r"devices=8 .* sees 2 CUDA devices .*gpus-per-task=1"):
        resolve_devices(8, "cuda")
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ValueError, match=r"devices=8 but this machine has 2 CUDA device"):  # no launcher
        resolve_devices(8, "cuda")


def test_deepspeed_gets_the_visible_gpu_as_local_rank_and_shardwise_keeps_the_node_rank(monkeypatch):
    ensure_accelerator_env("cpu")  # DeepSpeed imported as the rest of the suite imports it (no CUDA here)
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    _srun_task(monkeypatch, local_rank=3, visible=1)
    env = detect_env()
    device = device_for("cuda", env.local_rank)
    apply_rank_env(env, device)
    # What DeepSpeed's engine and zero.Init read for their device: the one this task sees.
    assert os.environ["LOCAL_RANK"] == "0"
    assert os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "8"
    assert CUDA_Accelerator().device_name(os.environ["LOCAL_RANK"]) == "cuda:0"
    # shardwise still knows this is the node's fourth process (e.g. not the one that builds a cache).
    after = detect_env()
    assert (after.local_rank, after.global_rank, after.local_world_size) == (3, 3, 8)
    # Every rank sees every GPU: LOCAL_RANK stays the node-local rank, which is the device.
    _srun_task(monkeypatch, local_rank=3, visible=8)
    apply_rank_env(detect_env(), device_for("cuda", 3))
    assert os.environ["LOCAL_RANK"] == "3" and detect_env().local_rank == 3


# ------------------------------------------------------------------ launch(fn)'s results
def test_launched_workers_hand_back_host_tensors():
    """A CUDA tensor would cross to the launcher as an IPC handle into a worker that exits at once."""
    with FakeTensorMode(allow_non_fake_inputs=True):  # CUDA tensors as metadata: no GPU needed
        on_gpu = torch.ones(3, device="cuda", requires_grad=True)
    on_host = torch.arange(4)
    Pair = collections.namedtuple("Pair", "gpu host")
    result = {"loss": on_gpu, "rows": [Pair(on_gpu, on_host)], "step": 7, "name": "run"}
    moved = host_result(result)
    assert moved["loss"].device.type == "cpu" and moved["loss"].requires_grad
    assert isinstance(moved["rows"][0], Pair) and moved["rows"][0].gpu.device.type == "cpu"
    assert moved["rows"][0].host is on_host  # host tensors are not copied
    assert (moved["step"], moved["name"]) == (7, "run")
    plain = {"x": on_host}
    assert host_result(plain) is plain  # nothing on a device: the result as it was


# ------------------------------------------------------------------ deterministic=True
def test_deterministic_sets_the_cublas_workspace_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    Trainer(accelerator="cpu", devices=1, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # in this process: inherited by later workers
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    Trainer(accelerator="cpu", devices=1, deterministic=True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    Trainer(accelerator="cpu", devices=1)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # only deterministic runs ask for it


# ------------------------------------------------------------------ the planner's first batch
class _FirstBatch(torch.utils.data.Dataset):
    """Records which GPU was current when the planner drew its example batch, then stops the fit there."""

    def __init__(self, current):
        self.current, self.seen = current, []

    def __len__(self):
        return 4

    def __getitem__(self, index):
        self.seen.append(self.current[-1] if self.current else None)
        raise _Drawn()


class _Drawn(Exception):
    pass


def test_the_planner_draws_its_example_batch_on_the_ranks_own_gpu(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(env_module, "_LOCAL_RANK_IS_DEVICE", None, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(torch.device(device)))
    dataset = _FirstBatch(current)
    trainer = types.SimpleNamespace(
        devices=2,
        num_nodes=1,
        accelerator="cuda",
        device_memory="80GiB",
        strategy=types.SimpleNamespace(is_auto=True),  # strategy="auto": every rank plans
        accumulate_grad_batches=1,
    )
    with pytest.raises(_Drawn):
        check_before_fit(trainer, None, torch.utils.data.DataLoader(dataset, batch_size=2))
    # pin_memory pins on the current device: it must be this rank's (cuda:1), not the default GPU 0.
    assert dataset.seen == [torch.device("cuda", 1)]


# ------------------------------------------------------------------ the recipe's loaders
@pytest.mark.parametrize("pin", [True, False])
def test_the_recipe_pins_its_batches_for_cuda(pin):
    data = FinetuneData(DataOptions(), spec=None, tokenizer=None, cache_dir="", evaluate=True, pin_memory=pin)
    examples = [torch.arange(4) for _ in range(4)]
    data.prepared = PreparedData(train=examples, eval=examples, collate=None, summary={}, folder="")
    # Pinned batches make move_to_device's copies to the GPU asynchronous (no host wait per micro-batch).
    assert data.train_dataloader().pin_memory is pin and data.val_dataloader().pin_memory is pin


# ------------------------------------------------------------------ memory snapshots
@pytest.mark.filterwarnings("ignore:CUDA is not available, disabling CUDA profiling")
def test_memory_snapshots_record_python_stacks_unless_cpp_ones_are_asked_for(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append(kw))
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cuda", 0)))
    for asked, expected in ((None, "python"), ("all", "all")):
        profile = ProfileSteps(1, 2) if asked is None else ProfileSteps(1, 2, memory_stacks=asked)
        profile._begin(trainer)  # the profiler starts (CPU activity here) and the allocator's history
        profile._discard()
        assert calls[-2]["stacks"] == expected and calls[-1] == {"enabled": None}
    with pytest.raises(ValueError, match="memory_stacks='cpp'.*'python'.*'all'"):
        ProfileSteps(1, 2, memory_stacks="cpp")
