"""The fine-tuning recipe's TrainModule: a pretrained Hugging Face causal LM under the Trainer.

The model is built on the meta device in `configure_model` (the strategy
shards it and allocates only the local shards), then `init_weights` streams
the pretrained weights from global rank 0 into those shards (hf_model.py).
The training loss is normalised over the GLOBAL batch: `training_step`
returns the cross-entropy summed over the micro-batch's target tokens
(labels other than -100, after the shift to the next token) and
`loss_weight` counts them, so the Trainer divides by the target tokens of
the whole optimizer step -- every micro-batch on every rank -- and the step
is the same for any batch size, accumulation and number of ranks, packed or
not (trainer/weighting.py). Averaging per micro-batch instead weighed a
3-token answer as much as a 40-token one. The module keeps the global mean
loss of every optimizer step (`history`, the same value the Trainer logs as
train_loss) and of every evaluation (`eval_history`, also per target token),
read back to the host only at log lines; checkpoints carry both, so a resumed
run's history keeps the steps before the resume. Optimizer and schedule are
the Hugging Face Trainer's: AdamW without decay on biases and norms, linear
warm-up, then cosine / linear / constant; it holds only the parameters that
require gradients, so with LoRA (`lora_r` > 0: PEFT wraps the meta model in
`configure_model`, adapters/lora.py) the frozen base weights have no
optimizer state under any strategy.

Under sequence parallel (the strategy's `sp_mesh`) every rank of an sp group
receives the same full batch and keeps its slice of the sequence
(sequence_parallel_hf.split_batch): the labels move to the next token
before the split, the model runs the slice with the whole sequence's
document boundaries, and `training_step` and `loss_weight` count the slice
only, so over the sp group each target token is counted once and the step
is the one-device step. Validation sums the slices over
the sp group and reports the same eval_loss and val_loss as one device.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, List, Union

import torch
import torch.nn.functional as F

from shardwise.adapters.converters import build_converters, convert_model, post_optimizer_step
from shardwise.adapters.lora import count_parameters, describe_parameters, init_lora_weights
from shardwise.distributed import ops
from shardwise.losses import chunked_cross_entropy
from shardwise.module import TrainModule, attached_trainer
from shardwise.recipes import hf_model
from shardwise.recipes.moe import attach_expert_load, moe_facts, router_aux, sp_router_mask
from shardwise.strategies.sequence_parallel_hf import split_batch

HISTORY_KEY = "finetune_history"  # the module's losses so far, in every checkpoint's trainer state


def lr_lambda(total_steps: int, warmup_steps: int, kind: str):
    """Multiplier of the peak learning rate at optimizer step `s` (linear warm-up, then `kind`)."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


class CausalLMModule(TrainModule):
    """A pretrained causal LM: built on meta, weights streamed from rank 0, loss per global target token."""

    # Under ZeRO-3 the loader writes the partitions itself (hf_model._place);
    # the strategy must not gather the whole model for it.
    init_weights_partitioned = True
    log_prefix = "finetune"  # the recipe's name in its printed lines (recipes/pretrain.py says "pretrain")

    def __init__(self, cfg: Any, folder: Any, total_steps: Union[int, Callable[[], int]]) -> None:
        """`cfg`: the FinetuneConfig; `folder`: an hf_model.ModelFolder; `total_steps`: the schedule's
        length, or a function that says it once the data is set up (configure_optimizers calls it)."""
        super().__init__()
        self.cfg, self.folder, self.total_steps = cfg, folder, total_steps
        self.model = None
        self.history: List[Dict[str, float]] = []
        self.eval_history: List[Dict[str, float]] = []
        self.load_report: Any = None
        self.parameter_counts: Dict[str, int] = {}  # full-size trainable / total elements
        self.converters: List[Any] = []  # adapters/converters.py: applied in configure_model, hooked per step
        # An MoE model's router losses join the training loss (recipes/moe.py); None for a dense model.
        config = getattr(folder, "config", None)  # no folder: a module built around a model given to it
        self.moe = None if config is None else moe_facts(config, getattr(cfg, "router_aux_loss_coef", None))
        self._window: List[torch.Tensor] = []
        # (step, lr, this rank's share of the step's mean loss on the device) until the next log line:
        # reading a loss back to the host every step would stall the device queue.
        self._unsynced: List[Any] = []
        self._eval_sum = torch.zeros(2)
        self._lr = cfg.learning_rate
        self._t0 = time.time()

    def configure_model(self) -> None:
        if self.model is None:
            model = hf_model.build_meta_model(self.folder, self.cfg.attn_implementation)
            # QLoRA's NF4 base, then LoRA, on the meta model before the strategy shards it: the frozen
            # base weights and the adapters are sharded together, unit by unit (mixed requires_grad per
            # unit). The strategy's plan is read here (QLoRA only) because strategy="auto" is known only now.
            self.converters = build_converters(self.cfg, lambda: self.trainer.strategy.parallel_plan)
            self.model = convert_model(model, self.converters)
            attach_expert_load(self.model, self.moe)  # an MoE model's tokens per expert, logged by the Trainer
            trainable, total = count_parameters(self.model)
            self.parameter_counts = {"trainable": trainable, "total": total}

    def init_weights(self) -> None:
        # Called by the strategy after the shards are allocated (materialize.py):
        # rank 0 reads, every rank receives its slices; then the computed buffers,
        # then the LoRA matrices (not in the checkpoint), seeded the same on every rank.
        self.load_report = hf_model.load_rank0_and_distribute(self.model, self.folder.path, self.folder.weight_files)
        hf_model.recompute_buffers(self.model)
        init_lora_weights(self.model, self.cfg.seed)

    def _sp_mesh(self) -> Any:
        """The strategy's sequence-parallel mesh, or None (no sp, or no Trainer attached)."""
        trainer = attached_trainer(self)
        return getattr(trainer.strategy, "sp_mesh", None) if trainer is not None else None

    def _sp_split(self, batch: Dict[str, torch.Tensor]) -> Any:
        """Under sp: (this rank's model inputs, its slice's next-token targets); else None."""
        mesh = self._sp_mesh()
        return None if mesh is None else split_batch(batch, mesh.get_local_rank(), mesh.size())

    def loss_weight(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Target tokens: the positions whose next token has a label (the Trainer sums these per step).
        Under sp, only this rank's slice's: the Trainer sums them over every rank, the sp ranks included."""
        split = self._sp_split(batch)
        if split is not None:
            return (split[1] != -100).sum()
        return (batch["labels"][:, 1:] != -100).sum()

    def count_tokens(self, batch: Dict[str, torch.Tensor]) -> Any:
        """Tokens trained on, for tokens/s and MFU (callbacks/throughput.py): padding (attention 0) is not;
        a packed block has none. Under sp the whole sample's, as every rank of the group counts it (the
        monitor counts a sequence-parallel group once). A device sum, read back only at log steps."""
        mask = batch.get("attention_mask")
        return mask.sum() if mask is not None else batch["input_ids"].numel()

    def _loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The model's own loss: the mean over the batch's target tokens."""
        # No KV cache; without one, position ids that restart per document
        # become a block-diagonal mask (data.py).
        return self.model(**batch, use_cache=False).loss

    def _summed_loss(self, batch: Dict[str, torch.Tensor], router: bool = False) -> torch.Tensor:
        """Cross-entropy of each token's prediction of the next, summed over the target tokens
        (under sp: over this rank's slice of the sequence); `router`: plus an MoE model's router losses."""
        split = self._sp_split(batch)
        if split is not None:
            inputs, targets = split
        else:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            # The model's own shift, without copying the logits: the labels move left by one instead.
            targets = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        router = router and self.moe is not None
        outputs = self.model(**inputs, use_cache=False, **({"output_router_logits": True} if router else {}))
        # Chunk by chunk in float32, with no float32 copy of the logits kept for backward (losses.py):
        # at a 128k vocabulary that copy and its gradient outweighed the logits themselves.
        loss = chunked_cross_entropy(outputs.logits, targets, ignore_index=-100, reduction="sum")
        mask = sp_router_mask(batch, self._sp_mesh()) if router and split is not None else None  # sp: padding
        aux = router_aux(self.model, outputs, inputs, self.moe, mask) if router else None
        return loss if aux is None else loss + aux

    def on_train_start(self) -> None:
        self._t0 = time.time()
        if self.trainer.is_global_zero and self.parameter_counts:
            counts = self.parameter_counts
            kind = f"LoRA r={self.cfg.lora_r}" if self.cfg.lora_r else "full fine-tuning"
            print(f"[finetune] {kind}: {describe_parameters(counts['trainable'], counts['total'])}", flush=True)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Summed: the Trainer divides by the step's global target tokens and logs the mean as train_loss.
        return self._summed_loss(batch, router=True)

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        mesh = self._sp_mesh()
        if mesh is not None:
            self._sp_validation_step(batch, mesh)
            return
        loss, tokens = self._loss(batch).detach().float(), self.loss_weight(batch)
        self._eval_sum = self._eval_sum.to(loss.device)
        self._eval_sum += torch.stack([loss * tokens, tokens.to(loss.dtype)])  # eval_loss: per target token
        # The epoch's val_loss too: each batch's mean weighted by its target tokens, across ranks.
        self.log("val_loss", loss, sync_dist=True, batch_size=max(int(tokens), 1))

    def _sp_validation_step(self, batch: Dict[str, torch.Tensor], mesh: Any) -> None:
        """validation_step under sp: each rank scores its slice; the sp group's sum is the batch's."""
        summed, tokens = self._summed_loss(batch).detach().float(), self.loss_weight(batch)
        pair = torch.stack([summed, tokens.to(summed.dtype)])
        self._eval_sum = self._eval_sum.to(pair.device)
        self._eval_sum += pair  # the slices: over all ranks, each target token once
        # val_loss: the whole batch's mean weighted by its target tokens, as on one device. Every sp rank
        # logs the same pair, which weighs each batch sp times in the cross-rank mean: the mean is unchanged.
        torch.distributed.all_reduce(pair, group=mesh.get_group())
        whole = int(pair[1])
        self.log("val_loss", pair[0] / max(whole, 1), sync_dist=True, batch_size=max(whole, 1))

    def on_validation_epoch_start(self) -> None:
        self._eval_sum = torch.zeros(2)

    def on_validation_epoch_end(self) -> None:
        total = ops.reduce(self._eval_sum.clone(), "sum")
        if total[1] > 0:
            entry = {"step": self.trainer.global_step, "eval_loss": float(total[0] / total[1])}
            self.eval_history.append(entry)
            if self.trainer.is_global_zero:
                print(f"[{self.log_prefix}] step {entry['step']}: eval_loss {entry['eval_loss']:.4f}", flush=True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if not self._window:
            self._lr = self.trainer.optimizers[0].param_groups[0]["lr"]

    def configure_callbacks(self) -> Any:
        # Before the checkpoint callbacks, which the Trainer runs last: a step's checkpoint holds its entry and
        # what the converters' hooks did after it.
        return [StepRecorder(), ConverterSteps()]

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # Every rank saves together (collective), so the sync is too; the steps so far, the current one included.
        self._sync_history()
        checkpoint[HISTORY_KEY] = {
            "history": list(self.history),
            "eval_history": list(self.eval_history),
            "model_path": os.path.abspath(self.folder.path),  # `shardwise convert` takes its config from there
        }

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        # A resumed run continues after the checkpoint's step: its history starts with the saved steps.
        saved = checkpoint.get(HISTORY_KEY) or {}
        self.history = list(saved.get("history", []))
        self.eval_history = list(saved.get("eval_history", []))
        self._unsynced, self._window = [], []

    def record_step_output(self, outputs: Any) -> None:
        """A micro-batch's summed loss; at the step's last one, the step's entry (StepRecorder calls it)."""
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._window.append(loss.detach().float())
        if not self.trainer.is_last_microbatch:
            return
        step, tokens = self.trainer.global_step, self.trainer.step_weight  # the step's global target tokens
        share = torch.stack(self._window).sum() / tokens.clamp_min(1).to(self._window[0].device)
        self._unsynced.append((step, self._lr, share.float()))
        self._window = []
        if step % self.cfg.logging_steps == 0 or step == 1:
            self._sync_history()
            entry = self.history[-1]
            if self.trainer.is_global_zero:
                rate = step / max(1e-9, time.time() - self._t0)
                print(
                    f"[{self.log_prefix}] step {step}: loss {entry['loss']:.4f} lr {entry['lr']:.3g} "
                    f"({rate:.2f} steps/s)",
                    flush=True,
                )

    def on_train_end(self) -> None:
        self._sync_history()

    def _sync_history(self) -> None:
        """Move the losses since the last log line into history: one all-reduce, one host read.

        Each rank holds its summed losses of the step over the step's global target tokens;
        their sum over ranks is the loss of the whole global batch per target token, the same
        for any world size and layout. Every rank calls this at the same steps (log steps and
        the end of training), so the collectives match.
        """
        if not self._unsynced:
            return
        means = ops.reduce(torch.stack([m for _, _, m in self._unsynced]), "sum").tolist()
        self.history.extend(
            {"step": step, "loss": loss, "lr": lr} for (step, lr, _), loss in zip(self._unsynced, means)
        )
        self._unsynced = []

    def configure_optimizers(self) -> Any:
        cfg = self.cfg
        decay, no_decay = [], []
        for p in self.parameters():
            if p.requires_grad:
                # Biases and norm weights (1-D) are not decayed, as in the Hugging Face Trainer.
                # A ZeRO-3 partition is flat: judge by the parameter's full shape.
                (decay if len(hf_model.full_shape(p)) >= 2 else no_decay).append(p)
        # No empty group: DeepSpeed drops those, and the LR scheduler would then
        # have more learning rates than the engine's optimizer has groups.
        groups = [
            g
            for g in (
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            )
            if g["params"]
        ]
        kwargs = dict(lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
        on_cuda = self.device.type == "cuda"
        if cfg.optim == "paged_adamw_32bit":
            import bitsandbytes as bnb

            optimizer = bnb.optim.PagedAdamW32bit(groups, **kwargs)
        else:
            fused = on_cuda and cfg.optim in ("adamw", "adamw_torch_fused")
            optimizer = torch.optim.AdamW(groups, fused=fused or None, **kwargs)
        total = self.total_steps() if callable(self.total_steps) else self.total_steps
        warmup = math.ceil(total * cfg.warmup_ratio)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, warmup, cfg.lr_scheduler_type))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StepRecorder:
    """Hands each micro-batch's loss to the module at on_train_batch_end, as a callback: the module's own hook
    runs after the callbacks', so a checkpoint saved at step S (ModelCheckpoint, last of the callbacks) did
    not yet hold step S, and a run resumed from it never had that step in its history."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        module.record_step_output(outputs)


class ConverterSteps:
    """Runs the model converters' post_optimizer_step (adapters/converters.py) once per optimizer step, at the
    end of the step's last micro-batch; LoRA and QLoRA define none, a converter with per-step state does."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.is_last_microbatch:
            post_optimizer_step(module.model, module.converters)


def build_module(cfg: Any, folder: Any, total_steps: Union[int, Callable[[], int]]) -> CausalLMModule:
    """The recipe's TrainModule for `cfg` (a FinetuneConfig) and the model `folder`."""
    return CausalLMModule(cfg, folder, total_steps)
