"""The smoke checks about processes: the environment report, two ranks on one GPU, NCCL's verdict on that,
and FSDP bf16 with a planted NaN that the health check must stop at, naming the step.

Two ranks on one GPU, decided from torch's and NCCL's rules: NCCL (since 2.5) refuses two ranks of one
communicator on the same device ("Duplicate GPU detected", ncclInvalidUsage, at the first collective),
and shardwise follows it: `Trainer(devices=2)` with one visible GPU is refused before any worker starts
(distributed/env.resolve_devices), so the Trainer's multi-rank CUDA paths (NCCL all-gather,
reduce-scatter) need two GPUs. What one GPU can check is the rest of the multi-process path: the fork
server forks two workers whose CUDA works (no CUDA context inherited from the server), both bind
cuda:0 (env.device_for with one visible GPU), and a gloo process group, the control plane, carries CUDA
tensors between them. `nccl_two_ranks_one_gpu` records what NCCL says to two ranks on one device on
this machine, so the claim is re-checked on every GPU the smoke test meets. The FSDP run then trains on
the GPU as one rank (the NCCL group of one, fully_shard, bf16 MixedPrecisionPolicy) inside a forked
worker, and with 2 GPUs or more, on 2 ranks; on a CPU (--dry) the same body runs on 2 gloo ranks.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Any, Dict, List

import torch

import shardwise
from shardwise.distributed.launch import WorkerFailedError
from shardwise.smoke.common import GPTModule, Skip, StepLosses, counting_data, gpt, quiet_trainer_kwargs, require_cuda

PACKAGES = (
    "torch",
    "deepspeed",
    "bitsandbytes",
    "transformers",
    "peft",
    "accelerate",
    "jsonargparse",
    "datasets",
    "safetensors",
    "triton",
)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def check_environment(dry: bool, limit_s: float) -> Dict[str, Any]:
    """Versions, the device as CUDA reports it, and that importing shardwise creates no CUDA context."""
    from shardwise.distributed import forkserver

    for module in forkserver.PRELOAD:  # what the fork server imports before it forks any worker
        __import__(module)
    data: Dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "versions": {p: _version(p) for p in PACKAGES},
        "shardwise": shardwise.__version__,
        "torch_cuda": torch.version.cuda,
        "start_method": forkserver.start_method(),
        "cuda_initialized_by_imports": torch.cuda.is_initialized(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "CUDA_VISIBLE_DEVICES",
                "DS_ACCELERATOR",
                "CUBLAS_WORKSPACE_CONFIG",
                "NCCL_DEBUG",
                "SHARDWISE_START_METHOD",
            )
        },
    }
    if data["cuda_initialized_by_imports"]:
        raise AssertionError("importing shardwise initialised CUDA: the fork server's workers would inherit a context")
    if dry:
        data["cuda_available"] = torch.cuda.is_available()
        data["detail"] = f"torch {torch.__version__}, CPU dry run, workers start by {data['start_method']}"
        return data
    require_cuda()
    props = torch.cuda.get_device_properties(0)
    data.update(
        devices=torch.cuda.device_count(),
        name=torch.cuda.get_device_name(0),
        capability=list(torch.cuda.get_device_capability(0)),
        memory_gib=round(props.total_memory / 2**30, 2),
        multiprocessors=props.multi_processor_count,
        nccl=".".join(map(str, torch.cuda.nccl.version())),
        bf16=torch.cuda.is_bf16_supported(),
        cudnn=torch.backends.cudnn.version(),
        flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
    )
    data["detail"] = (
        f"{data['name']} sm_{''.join(map(str, data['capability']))}, {data['memory_gib']} GiB, "
        f"torch {torch.__version__}, NCCL {data['nccl']}, deepspeed {data['versions']['deepspeed']}, "
        f"bitsandbytes {data['versions']['bitsandbytes']}"
    )
    return data


# ----------------------------------------------------------------------------- two ranks on one GPU
def _gloo_cuda_worker() -> Dict[str, Any]:
    """A forked rank: CUDA works, cuda:0 is its device, gloo moves CUDA tensors between the ranks."""
    import torch.distributed as dist

    from shardwise.distributed.env import detect_env, device_for

    env = detect_env()
    device = device_for("cuda", env.local_rank)
    torch.cuda.set_device(device)
    backend = "nccl" if torch.cuda.device_count() >= env.local_world_size else "gloo"
    dist.init_process_group(backend)
    x = torch.full((1 << 16,), float(env.global_rank + 1), device=device)
    dist.all_reduce(x)
    y = torch.arange(8, device=device, dtype=torch.float32) * (env.global_rank + 1)
    dist.broadcast(y, src=1)
    torch.cuda.synchronize()
    return {
        "rank": env.global_rank,
        "device": str(x.device),
        "backend": backend,
        "sum_ok": bool((x == sum(range(1, env.world_size + 1))).all()),
        "broadcast_ok": bool(torch.equal(y.cpu(), torch.arange(8, dtype=torch.float32) * 2)),
        "pid": os.getpid(),
    }


def check_launch_two_ranks(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    start = time.perf_counter()
    out = shardwise.launch(_gloo_cuda_worker, devices=2)
    seconds = time.perf_counter() - start
    if not all(r["sum_ok"] and r["broadcast_ok"] for r in out):
        raise AssertionError(f"collectives gave wrong values: {out}")
    if len({r["pid"] for r in out}) != 2:
        raise AssertionError(f"the two ranks are one process: {out}")
    return {
        "ranks": out,
        "launch_s": round(seconds, 2),
        "detail": f"2 forked ranks on {sorted({r['device'] for r in out})}, {out[0]['backend']} all_reduce and "
        f"broadcast of CUDA tensors correct, launch + run {seconds:.1f} s",
    }


def _nccl_worker() -> str:
    import torch.distributed as dist

    from shardwise.distributed.env import detect_env

    env = detect_env()
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        return f"accepted: all_reduce gave {x[0].item():g} on rank {env.global_rank}"
    except Exception as exc:  # noqa: BLE001 -- NCCL's refusal is the answer this check records
        return f"refused: {type(exc).__name__}: {exc}"


def check_nccl_same_gpu(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    if torch.cuda.device_count() > 1:
        raise Skip(f"{torch.cuda.device_count()} GPUs: two ranks get two devices")
    try:
        answers: List[str] = shardwise.launch(_nccl_worker, devices=2)
    except WorkerFailedError as exc:  # refused while the group was created
        answers = [f"refused: {exc}"]
    text = " | ".join(answers)
    if all(a.startswith("accepted") for a in answers):
        return {
            "answers": answers,
            "detail": "NCCL accepted two ranks on one GPU (unexpected for NCCL >= 2.5): "
            "shardwise still refuses Trainer(devices=2) on one GPU",
        }
    if "Duplicate GPU" not in text and "invalid usage" not in text.lower():
        raise AssertionError(f"NCCL failed otherwise than by refusing a duplicate GPU: {text[:800]}")
    return {
        "answers": answers,
        "detail": "NCCL refuses two ranks on one GPU (Duplicate GPU detected), as expected: "
        "the control plane on one GPU is gloo",
    }


# ----------------------------------------------------------------------------- FSDP bf16 + planted NaN
NAN_STEP = 3


def _fsdp_nan_worker(accelerator: str, devices: int) -> Dict[str, Any]:
    """FSDP bf16-mixed on the bundled GPT; the last rank's loss is NaN in step NAN_STEP: the run must stop there."""
    from shardwise import FSDPStrategy, Trainer
    from shardwise.health import NonFiniteError
    from shardwise.models import Block

    shardwise.seed_everything(0)
    config = gpt()
    recorder = StepLosses()
    trainer = Trainer(
        **quiet_trainer_kwargs(
            accelerator=accelerator,
            devices=devices,
            strategy=FSDPStrategy(auto_wrap_policy={Block}),
            precision="bf16-mixed",
            max_steps=NAN_STEP + 2,
            callbacks=[recorder],
            gradient_clip_val=1.0,
        )
    )
    module = GPTModule(config, nan_at=(NAN_STEP, devices - 1))
    error = ""
    try:
        trainer.fit(module, counting_data(config, batch_size=4))
    except NonFiniteError as exc:
        error = str(exc)
    param = next(trainer.model.parameters())
    local = param.to_local() if hasattr(param, "to_local") else param
    return {
        "rank": trainer.global_rank,
        "error": error,
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "param_device": local.device.type,
        "param_dtype": str(local.dtype),
    }


def check_fsdp_bf16_nan(dry: bool, limit_s: float) -> Dict[str, Any]:
    if dry:
        accelerator, devices = "cpu", 2
    else:
        require_cuda()
        accelerator, devices = "cuda", min(2, torch.cuda.device_count())
    start = time.perf_counter()
    out = shardwise.launch(_fsdp_nan_worker, accelerator, devices, devices=devices)
    seconds = time.perf_counter() - start
    planted = devices - 1
    for r in out:
        if not r["error"]:
            raise AssertionError(f"rank {r['rank']} trained through a NaN loss planted in step {NAN_STEP}: {r}")
        if f"step {NAN_STEP}" not in r["error"] or f"rank {planted}" not in r["error"]:
            raise AssertionError(
                f"rank {r['rank']}'s error does not name step {NAN_STEP} and rank {planted}: {r['error'][:600]}"
            )
        # The verdict is read one step late where no value is read anyway (trainer/nonfinite.py): step 3's
        # update may have been queued, nothing after it may be.
        if r["global_step"] > NAN_STEP or len(r["losses"]) < NAN_STEP - 1:
            raise AssertionError(f"rank {r['rank']} trained past the NaN step or lost the ones before it: {r}")
        if not all(v == v for v in r["losses"][: NAN_STEP - 1]):
            raise AssertionError(f"a NaN before the planted step: {r['losses']}")
        if r["param_device"] != accelerator or r["param_dtype"] != "torch.float32":
            raise AssertionError(f"FSDP bf16-mixed should keep fp32 shards on {accelerator}: {r}")
    return {
        "ranks": out,
        "seconds_launch_and_fit": round(seconds, 2),
        "detail": f"{devices} {accelerator} rank(s), FSDP bf16-mixed stopped at step {NAN_STEP} naming rank "
        f"{planted}: {out[0]['error'].splitlines()[0][:160]}",
    }
