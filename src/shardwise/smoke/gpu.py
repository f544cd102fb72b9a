"""The smoke checks that need one CUDA device: QLoRA's codes, DeepSpeed offload, compile + MFU + TF32, the SDPA
kernels, 16-mixed, the profiler's dump, determinism, then a subset of tests/gpu.

Each goes through shardwise's public entry points (the fine-tuning recipe, the Trainer and its strategies,
`shardwise.flops`) on the bundled GPT or a tiny random Llama built here, and raises on the first broken
promise; what it measured comes back as its data. Sizes are small: the point is that the GPU path runs
and keeps its promises, not speed (the benchmarks/ scripts measure that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Dict, List

import torch

import shardwise
from shardwise.smoke.common import (
    GPTModule,
    Skip,
    SmokeFailure,
    StepLosses,
    counting_data,
    finite,
    gpt,
    quiet_trainer_kwargs,
    require,
    require_cuda,
)

# The device every check trains on. Only a development aid sets it to "cpu" (with require_cuda bypassed),
# to run the bodies' API calls on a machine without a GPU; their CUDA-only assertions then fail, as they should.
ACCELERATOR = "cuda"


def _trainer(**kwargs: Any) -> Any:
    from shardwise import Trainer

    return Trainer(**quiet_trainer_kwargs(accelerator=ACCELERATOR, devices=1, **kwargs))


# ----------------------------------------------------------------------------- QLoRA
_WORDS = "what colour is the sky sea sun grass snow coal ? red blue yellow green white black . yes , are you sure"


def _model_folder(path: str) -> str:
    """A random-weight Llama and a word-level tokenizer saved as a Hugging Face folder (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "<|endoftext|>", "<|system|>", "<|prompter|>", "<|assistant|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([_WORDS], trainers.WordLevelTrainer(special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|endoftext|>",
        model_max_length=128,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _chat(path: str, n: int = 64) -> str:
    colours = {"sky": "blue", "sea": "blue", "sun": "yellow", "grass": "green", "snow": "white", "coal": "black"}
    with open(path, "w") as fh:
        for i in range(n):
            thing = list(colours)[i % len(colours)]
            messages = [
                {"role": "user", "content": f"what colour is the {thing} ?"},
                {"role": "assistant", "content": f"the {thing} is {colours[thing]} ."},
            ]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return path


def _qlora_facts(module: Any) -> Dict[str, Any]:
    """after_fit: each 4-bit layer's packed codes against quantising its checkpoint weight again, and the adapters."""
    import bitsandbytes as bnb
    from safetensors.torch import load_file

    from shardwise.adapters.lora import base_weight_name
    from shardwise.adapters.quantize import quantize_weight

    weights = load_file(os.path.join(module.folder.path, "model.safetensors"))
    layers = [(n, m) for n, m in module.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    unchanged, devices = [], set()
    for name, m in layers:
        held = m.weight.full_tensor() if hasattr(m.weight, "full_tensor") else m.weight.data
        devices.add(held.device.type)
        full = weights[base_weight_name(name + ".weight")]
        # Quantised where the loader may have done it (host or GPU): training must leave them bit for bit.
        candidates = []
        for device in dict.fromkeys((held.device, torch.device("cpu"))):
            try:
                candidates.append(quantize_weight(full.to(device), m)[0])
            except (RuntimeError, NotImplementedError):  # bitsandbytes without kernels for that device
                pass
        unchanged.append(
            any(
                c.numel() == held.numel()
                and torch.equal(c.view(torch.uint8).cpu(), held.reshape(c.shape).view(torch.uint8).cpu())
                for c in candidates
            )
        )
    lora_b = [p for n, p in module.model.named_parameters() if "lora_B" in n]
    return {
        "layers": len(layers),
        "codes_unchanged": unchanged,
        "code_devices": sorted(devices),
        "code_dtype": str(layers[0][1].weight.dtype) if layers else None,
        "lora_b_trained": bool(lora_b) and all(float(p.detach().float().abs().sum()) > 0 for p in lora_b),
        "frozen_with_grad": [
            n for n, p in module.model.named_parameters() if not p.requires_grad and p.grad is not None
        ],
    }


def check_qlora(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    require("bitsandbytes")
    from shardwise.recipes.data import DataOptions
    from shardwise.recipes.finetune import FinetuneConfig, finetune

    with tempfile.TemporaryDirectory(prefix="smoke-qlora-") as root:
        config = FinetuneConfig(
            model_path=_model_folder(os.path.join(root, "model")),
            max_steps=4,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            precision="bf16-mixed",
            devices=1,
            accelerator=ACCELERATOR,
            strategy="fsdp",
            logging_steps=100,
            seed=5,
            lora_r=8,
            lora_alpha=16,
            lora_target_modules=["all-linear"],
            load_in_4bit=True,
            output_dir=os.path.join(root, "out"),
            data=DataOptions(
                dataset=_chat(os.path.join(root, "chat.jsonl")),
                max_seq_len=64,
                packing=True,
                per_device_train_batch_size=2,
                eval_split_ratio=0.0,
                cache_dir=os.path.join(root, "cache"),
            ),
        )
        result = finetune(config, after_fit=_qlora_facts)
    facts, losses = result.extra, [s["loss"] for s in result.losses]
    if not facts["layers"] or not all(facts["codes_unchanged"]):
        raise AssertionError(f"4-bit codes changed by training or loading (per layer: {facts['codes_unchanged']})")
    if facts["code_devices"] != [ACCELERATOR] or facts["frozen_with_grad"] or not facts["lora_b_trained"]:
        raise AssertionError(f"4-bit base off the GPU, frozen weights with gradients, or adapters untrained: {facts}")
    if not finite(losses):
        raise AssertionError(f"non-finite QLoRA losses: {losses}")
    return {
        **facts,
        "losses": losses,
        "detail": f"{facts['layers']} NF4 layers on {ACCELERATOR}, codes bit-identical after {len(losses)} steps, "
        f"LoRA trained, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
    }


# ----------------------------------------------------------------------------- DeepSpeed offload
class _GradientProbe:
    """Before each optimizer step: the gradients the strategy holds (DeepSpeed's partitions), finite or not."""

    def __init__(self) -> None:
        self.seen: List[Dict[str, Any]] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        grads = [g for g in trainer.strategy.gradients(trainer.model) if g is not None]
        self.seen.append(
            {
                "tensors": len(grads),
                "finite": all(bool(torch.isfinite(g).all()) for g in grads),
                "devices": sorted({g.device.type for g in grads}),
                "norm": float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])))
                if grads
                else 0.0,
            }
        )


def _ds_run(name: str, config: Any) -> Dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    shardwise.seed_everything(0)
    probe, recorder = _GradientProbe(), StepLosses()
    trainer = _trainer(strategy=name, precision="bf16-mixed", max_steps=3, callbacks=[probe, recorder])
    start = time.perf_counter()
    trainer.fit(GPTModule(config, lr=1e-3), counting_data(config, rows=32, batch_size=4))
    return {
        "peak_mib": round((torch.cuda.max_memory_allocated() - before) / 2**20, 1),
        "grads": probe.seen,
        "losses": recorder.losses,
        "seconds": round(time.perf_counter() - start, 1),
    }


def check_deepspeed_offload(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    require("deepspeed")
    config = gpt(vocab_size=8192, block_size=128, n_layer=4, n_head=8, n_embd=512)
    offload = _ds_run("deepspeed_stage_2_offload", config)  # first: its cpu_adam JIT build is the slow, risky part
    plain = _ds_run("deepspeed_stage_2", config)
    for name, run in (("offload", offload), ("plain", plain)):
        if len(run["grads"]) != 3 or not all(g["finite"] and g["tensors"] and g["norm"] > 0 for g in run["grads"]):
            raise AssertionError(f"ZeRO-2 {name}: gradients missing, zero or not finite: {run['grads']}")
        if not finite(run["losses"]):
            raise AssertionError(f"ZeRO-2 {name}: non-finite losses {run['losses']}")
    if offload["grads"][0]["devices"] != ["cpu"]:
        raise AssertionError(f"offloaded ZeRO-2 should step on gradients in host memory: {offload['grads'][0]}")
    delta = plain["peak_mib"] - offload["peak_mib"]
    params = sum(p for k, p in config.param_counts().items() if k != "per_block")
    expected = params * 12 / 2**20  # fp32 master weights + Adam's two moments no longer on the GPU
    if delta < 0.5 * expected:
        raise AssertionError(f"offload saved {delta:.0f} MiB of GPU memory, expected about {expected:.0f} MiB")
    return {
        "offload": offload,
        "plain": plain,
        "saved_mib": round(delta, 1),
        "expected_mib": round(expected, 1),
        "detail": f"ZeRO-2 offload: finite gradients on the host, GPU peak {offload['peak_mib']} MiB vs "
        f"{plain['peak_mib']} MiB ({delta:.0f} MiB saved, ~{expected:.0f} expected); first run "
        f"{offload['seconds']} s with the cpu_adam build",
    }


# ----------------------------------------------------------------------------- compile + MFU + TF32
def check_compile_mfu_tf32(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    from shardwise import flops

    device = torch.device("cuda", 0)
    kinds, before = {}, torch.get_float32_matmul_precision()
    try:
        for setting in ("highest", "high"):
            torch.set_float32_matmul_precision(setting)
            kinds[setting] = [flops.number_kind("32-true"), flops.device_peak(device, "32-true")[0]]
        return _compiled_fit(kinds)  # with TF32 on: MFU against the TF32 peak
    finally:
        torch.set_float32_matmul_precision(before)  # a process-wide setting (the pytest run goes on)


def _compiled_fit(kinds: Dict[str, Any]) -> Dict[str, Any]:
    from shardwise.callbacks.throughput import ThroughputMonitor
    from shardwise.models import Block
    from shardwise.strategies.compile import is_compiled

    if kinds["highest"][0] != "fp32" or kinds["high"][0] != "tf32":
        raise AssertionError(f"float32 matmul precision 'highest' / 'high' should read fp32 / tf32: {kinds}")
    config = gpt(vocab_size=4096, block_size=256, n_layer=4, n_head=8, n_embd=512)
    shardwise.seed_everything(0)
    recorder = StepLosses()
    trainer = _trainer(
        strategy="single", precision="32-true", max_steps=12, compile=True, log_every_n_steps=4, callbacks=[recorder]
    )
    start = time.perf_counter()
    trainer.fit(GPTModule(config), counting_data(config, rows=192, batch_size=16))
    seconds = time.perf_counter() - start
    monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
    blocks = [m for m in trainer.model.modules() if isinstance(m, Block) or is_compiled(m)]
    compiled = sum(is_compiled(m) for m in blocks)
    mfu = monitor.last.get("throughput/mfu")
    if not compiled:
        raise AssertionError("Trainer(compile=True) compiled no block")
    if mfu is None or not 0 < mfu < 1:
        raise AssertionError(f"MFU should be in (0, 1) against {monitor.peak_source!r}: {monitor.last}")
    if not finite(recorder.losses) or recorder.losses[-1] >= recorder.losses[0]:
        raise AssertionError(f"compiled training did not learn: {recorder.losses}")
    return {
        "number_kinds": kinds,
        "throughput": monitor.last,
        "peak_source": monitor.peak_source,
        "compiled_modules": compiled,
        "fit_s": round(seconds, 1),
        "losses": recorder.losses,
        "detail": f"{compiled} compiled module(s), TF32 read as tf32 ({kinds['high'][1]} TFLOP/s peak), "
        f"MFU {mfu:.3f}, {monitor.last.get('throughput/tokens_per_sec', 0):.0f} tokens/s, "
        f"fit {seconds:.0f} s",
    }


# ----------------------------------------------------------------------------- SDPA kernels
# The op SDPA dispatched to names its backend unambiguously (aten::_scaled_dot_product_cudnn_attention,
# ..._flash_attention, ..._efficient_attention); kernel names do not (cuDNN's may contain "flash").
_FAMILIES = (("cudnn", "cudnn"), ("flash", "flash"), ("efficient", "efficient"), ("math", "math"))


def _attention_ops(model: Any, idx: torch.Tensor, position_ids: Any) -> Dict[str, List[str]]:
    """The attention ops (host side) and the GPU kernels of one forward and backward of `model`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(idx, position_ids=position_ids).float().sum().backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    ops = sorted(n for n in names if n.startswith("aten::") and "scaled_dot_product" in n)
    words = ("flash", "fmha", "cudnn", "attention", "sdpa", "softmax")
    kernels = sorted(n for n in names if not n.startswith("aten::") and any(w in n.lower() for w in words))
    return {"ops": ops, "kernels": [k[:160] for k in kernels]}


def _family(ops: List[str]) -> str:
    dispatched = [op for op in ops if op != "aten::scaled_dot_product_attention"]
    for key, family in _FAMILIES:
        if any(key in op for op in dispatched):
            return family
    return "math"  # the composite path: matmuls and a softmax, no fused op


def check_sdpa_kernels(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    from shardwise.models import GPT

    config = gpt(vocab_size=1024, block_size=256, n_layer=1, n_head=8, n_embd=512)
    model = GPT(config).cuda()
    idx = torch.randint(0, config.vocab_size, (4, 256), device="cuda")
    packed = torch.cat([torch.arange(100), torch.arange(156)]).expand(4, -1).cuda()  # two documents per row
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx)  # warm-up: kernel choice and lazy loading out of the profile
    found = {"causal": _attention_ops(model, idx, None), "document_mask": _attention_ops(model, idx, packed)}
    families = {case: _family(f["ops"]) for case, f in found.items()}
    if families["causal"] == "math":
        raise AssertionError(f"causal bf16 attention fell back to the math path: {found['causal']}")
    return {
        "found": found,
        "families": families,
        "flags": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        },
        "detail": f"causal: {families['causal']}, with a document mask: {families['document_mask']}",
    }


# ----------------------------------------------------------------------------- 16-mixed
def check_fp16_mixed(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    config = gpt()
    shardwise.seed_everything(0)
    recorder = StepLosses()
    trainer = _trainer(
        strategy="single", precision="16-mixed", max_steps=10, callbacks=[recorder], gradient_clip_val=1.0
    )
    trainer.fit(GPTModule(config), counting_data(config, rows=80))
    scaler = trainer.strategy.grad_scaler
    if scaler is None:
        raise AssertionError("16-mixed on CUDA should train with a GradScaler")
    scale = float(scaler.get_scale())
    if trainer.global_step != 10 or not finite(recorder.losses) or recorder.losses[-1] >= recorder.losses[0]:
        raise AssertionError(f"16-mixed did not train: steps {trainer.global_step}, losses {recorder.losses}")
    return {
        "losses": recorder.losses,
        "scale": scale,
        "detail": f"10 steps, loss {recorder.losses[0]:.3f} -> {recorder.losses[-1]:.3f}, loss scale {scale:g}",
    }


# ----------------------------------------------------------------------------- profile dump
def check_profile_dump(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    from shardwise.callbacks.profiling import ProfileSteps

    config = gpt(n_layer=4, n_embd=256, block_size=128)
    times, files = {}, {}
    with tempfile.TemporaryDirectory(prefix="smoke-profile-") as root:
        for label, steps in (("plain", None), ("profiled", (2, 3))):
            shardwise.seed_everything(0)
            trainer = _trainer(
                strategy="single", precision="bf16-mixed", max_steps=5, profile_steps=steps, default_root_dir=root
            )
            start = time.perf_counter()
            trainer.fit(GPTModule(config), counting_data(config, rows=40, batch_size=8))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[label] = time.perf_counter() - start
            if steps:
                profiler = next(c for c in trainer.callbacks if isinstance(c, ProfileSteps))
                files = {k: (os.path.basename(p), os.path.getsize(p)) for k, p in profiler.files.items()}
    if set(files) != {"trace", "memory"} or not all(size > 0 for _, size in files.values()):
        raise AssertionError(f"expected a trace and a CUDA memory snapshot, got {files}")
    overhead = times["profiled"] - times["plain"]
    return {
        "fit_s": {k: round(v, 2) for k, v in times.items()},
        "files": files,
        "overhead_s": round(overhead, 2),
        "detail": f"trace {files['trace'][1] / 2**20:.1f} MiB + memory snapshot {files['memory'][1] / 2**20:.1f} "
        f"MiB; profiling 2 steps cost {overhead:.1f} s over a {times['plain']:.1f} s run",
    }


# ----------------------------------------------------------------------------- deterministic
def _deterministic_losses(config: Any, caught: List[str]) -> List[float]:
    shardwise.seed_everything(0)
    recorder = StepLosses()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer = _trainer(
            strategy="single", precision="32-true", max_steps=6, deterministic=True, callbacks=[recorder]
        )
        trainer.fit(GPTModule(config), counting_data(config, rows=48))
    caught += [str(w.message).splitlines()[0][:200] for w in seen if "determinis" in str(w.message).lower()]
    return recorder.losses


def check_deterministic(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    config = gpt(n_layer=2, n_embd=128, block_size=64)
    caught: List[str] = []
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        runs = [_deterministic_losses(config, caught) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])  # process-wide: restored for what runs next
    if runs[0] != runs[1] or not finite(runs[0]):
        raise AssertionError(f"deterministic=True gave different losses: {runs}")
    return {
        "losses": runs[0],
        "warnings": sorted(set(caught)),
        "detail": f"two runs bit-identical over {len(runs[0])} steps; {len(set(caught))} distinct "
        f"determinism warning(s)",
    }


# ----------------------------------------------------------------------------- the GPU test suite
# The subset the smoke test runs, riskiest first: the recipe and the strategies' parity failed on the first
# GPU (an H200, 2026-11-28) for causes not yet read, then the multi-rank engines on CUDA, checkpoints moving
# between the GPU and the CPU, the planner against CUDA's allocator. test_one_gpu_paths_gpu.py is the checks
# above, already run. The whole output of a failed run is kept in the check's data ("output").
PYTEST_SUBSET = (
    "test_recipe_gpu.py",
    "test_parity_gpu.py",
    "test_fsdp_gpu.py",
    "test_deepspeed_gpu.py",
    "test_checkpoint_moves_gpu.py",
    "test_collator_planner_gpu.py",
)


def check_pytest_gpu(dry: bool, limit_s: float) -> Dict[str, Any]:
    require_cuda()
    tests = os.path.join(os.getcwd(), "tests", "gpu")
    if not os.path.isdir(tests):
        raise Skip(f"no {tests}: run from the repository root")
    files = [os.path.join(tests, name) for name in PYTEST_SUBSET]
    command = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-rfE", "--durations=5"]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=max(10.0, limit_s - 10))
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise AssertionError(f"pytest tests/gpu ran past {limit_s - 10:.0f} s; so far: {out[-1500:]}") from None
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    if proc.returncode not in (0, 5):
        # Every traceback, not a tail: the first GPU run lost four failures' causes to a 2,500-character tail.
        raise SmokeFailure(f"pytest tests/gpu: {summary}\n{proc.stdout[-2500:]}", {"output": proc.stdout[-400_000:]})
    return {"summary": summary, "output_tail": proc.stdout[-1500:], "detail": summary.strip("= ")}
