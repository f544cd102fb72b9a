"""One run of `shardwise check`: the user's module under the public Trainer, watched by a callback.

`run_job` is what every process runs -- the one-process reference in the
calling process, each of the N ranks in a worker started by
`shardwise.launch` -- so both sides build the module, the loader and the
Trainer by the same code, from the same seed, in fp32 on the CPU. The
`Recorder` callback (public hooks only) keeps what the comparison needs:
- per micro-batch: the optimizer step it belongs to, the loss training_step
  returned, the module's `loss_weight(batch)` if it defines one, and a content
  hash of every sample in the batch (which rows each rank trained on);
- the parameters and buffers at the start and after the last step, gathered to
  full tensors (FSDP2's DTensors with `full_tensor()`, ZeRO-3 through the
  strategy's model_state_dict). Rank 0 returns them whole; every rank returns
  a digest of each tensor and its own buffers, so differences across ranks
  show without N copies of the model.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.distributed import context
from shardwise.fqn import canonical_name
from shardwise.scaling.target import CheckSetupError, DataSource, ModuleSource, samples_available
from shardwise.seed import seed_everything
from shardwise.step import loss_of
from shardwise.trainer import Trainer

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


@dataclass
class Job:
    """One side of the comparison: which module, data, strategy and world, and the batch multiple."""

    module: ModuleSource
    data: DataSource
    strategy: Any
    devices: int
    accumulate: int
    scale: int  # samples per batch = micro-batch x scale (the reference: accumulation x devices)
    steps: int
    seed: int
    root_dir: str


@dataclass
class MicroBatch:
    step: int  # the optimizer step (0-based) this micro-batch belongs to
    index: int  # batch_idx in the epoch
    loss: Optional[float]
    weight: Optional[float]  # loss_weight(batch), when the module defines it
    samples: List[str]  # a content hash per sample, in batch order


@dataclass
class RankRecord:
    rank: int
    world_size: int
    micro_batch_size: int
    dataset_size: Optional[int]
    seconds: float
    micro: List[MicroBatch] = field(default_factory=list)
    param_names: List[str] = field(default_factory=list)
    initial: Dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: full parameters and buffers
    final: Dict[str, torch.Tensor] = field(default_factory=dict)
    initial_digests: Dict[str, str] = field(default_factory=dict)  # every rank
    final_digests: Dict[str, str] = field(default_factory=dict)
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)  # every rank: its own, after the last step
    dropout: List[str] = field(default_factory=list)  # modules that drop at random (p > 0)


def digest(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8).numpy()
    return hashlib.sha1(data.tobytes() + f"{t.dtype}{tuple(t.shape)}".encode()).hexdigest()


def _leaves(batch: Any) -> List[Any]:
    """The tensors and per-sample lists in a collated batch, in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [leaf for key in sorted(batch, key=str) for leaf in _leaves(batch[key])]
    if is_dataclass(batch) and not isinstance(batch, type):
        return _leaves(vars(batch))
    if isinstance(batch, (list, tuple)):
        if batch and all(isinstance(x, (str, bytes, int, float, bool)) for x in batch):
            return [list(batch)]  # default_collate keeps strings as a list, one per sample
        return [leaf for item in batch for leaf in _leaves(item)]
    return []


def sample_hashes(batch: Any) -> List[str]:
    """A hash of each sample's content: row i of every tensor (and item i of every list) in the batch."""
    leaves = _leaves(batch)
    sizes = [(leaf.shape[0] if leaf.dim() else -1) if isinstance(leaf, torch.Tensor) else len(leaf) for leaf in leaves]
    count = max(set(sizes), key=sizes.count) if sizes else 0  # the batch dimension most leaves share
    hashes = []
    for i in range(count):
        h = hashlib.sha1()
        for leaf, size in zip(leaves, sizes):
            if size != count:
                continue  # not per sample (a scalar or a shared tensor)
            item = leaf[i]
            h.update(digest(item).encode() if isinstance(item, torch.Tensor) else repr(item).encode())
        hashes.append(h.hexdigest())
    return hashes


def full_state(trainer: Any) -> "tuple[Dict[str, torch.Tensor], List[str]]":
    """Every parameter and buffer as a full CPU tensor (collective under FSDP / ZeRO-3: all ranks call it)."""
    strategy, module = trainer.strategy, trainer.module
    out: Dict[str, torch.Tensor] = {}
    for name, t in strategy.model_state_dict(trainer.model).items():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[canonical_name(name)] = t.detach().to("cpu", copy=True)
    for name, b in module.named_buffers():  # non-persistent buffers are not in the state dict
        out.setdefault(canonical_name(name), b.detach().to("cpu", copy=True))
    return out, sorted(canonical_name(n) for n, _ in module.named_parameters())


class Recorder:
    """Callback: losses, weights and sample hashes per micro-batch; full weights at the start and the end."""

    def __init__(self) -> None:
        self.micro: List[MicroBatch] = []
        self.initial: Dict[str, torch.Tensor] = {}
        self.final: Dict[str, torch.Tensor] = {}
        self.param_names: List[str] = []
        self.buffers: Dict[str, torch.Tensor] = {}
        self.dropout: List[str] = []
        self._pending: Optional[MicroBatch] = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.initial, self.param_names = full_state(trainer)
        self.dropout = [
            name or type(m).__name__
            for name, m in module.named_modules()
            if (isinstance(m, _DROPOUTS) and m.p > 0) or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
        ]

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        weight_fn = getattr(module, "loss_weight", None)
        weight = float(weight_fn(batch)) if callable(weight_fn) else None
        self._pending = MicroBatch(trainer.global_step, batch_idx, None, weight, sample_hashes(batch))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        pending, self._pending = self._pending, None
        if pending is None:  # the batch was skipped before its step (on_train_batch_start returned -1)
            return
        loss = loss_of(outputs)
        pending.loss = None if loss is None else float(loss.detach().float())
        self.micro.append(pending)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.final, _ = full_state(trainer)
        self.buffers = {canonical_name(n): b.detach().to("cpu", copy=True) for n, b in module.named_buffers()}

    def record(self, rank: int, world_size: int, micro_batch_size: int, size: Optional[int], seconds: float):
        keep = rank == 0
        return RankRecord(
            rank=rank,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            dataset_size=size,
            seconds=seconds,
            micro=self.micro,
            param_names=self.param_names,
            initial=self.initial if keep else {},
            final=self.final if keep else {},
            initial_digests={k: digest(v) for k, v in self.initial.items()},
            final_digests={k: digest(v) for k, v in self.final.items()},
            buffers=self.buffers,
            dropout=self.dropout,
        )


def run_job(job: Job) -> RankRecord:
    """Build the module and its loader from the seed and train `job.steps` optimizer steps (every process)."""
    seed_everything(job.seed)
    module = job.module.build()
    loader, micro = job.data.loader(module, job.scale)
    size, needed = samples_available(loader), job.steps * micro * job.scale * job.accumulate * job.devices
    if size is not None and size < needed:
        raise CheckSetupError(
            f"The dataset has {size} samples; {job.steps} steps of a global batch of {needed // job.steps} need "
            f"{needed} (the check stays inside one epoch). Use fewer --steps, a smaller --batch_size or more data."
        )
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=job.devices,
        strategy=job.strategy,
        precision="32-true",
        max_steps=job.steps,
        accumulate_grad_batches=job.accumulate,
        limit_val_batches=0,
        callbacks=[recorder],
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=job.root_dir,
    )
    started = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - started
    strategy = trainer.strategy
    return recorder.record(strategy.global_rank, strategy.world_size, micro, size, seconds)


def run_here(job: Job) -> RankRecord:
    """run_job in this process, leaving its random generators and launch context as they were."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(), torch.get_num_threads())
    try:
        with context.using(context.current().replace(seed=job.seed)):
            return run_job(job)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        torch.set_num_threads(states[3])
