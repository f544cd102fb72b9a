"""The check of every optimizer step: are its losses and gradients finite, and does it train anything?

One small all-reduce per step carries the verdicts: "some rank saw a NaN/inf",
"some rank was sent a preemption signal", "some rank holds gradients" and "one
of them is non-zero", so that every rank skips, stops or saves at the same step
without a second collective; for a module with `loss_weight` it also sums the
ranks' shares of the step's mean loss (weighting.py), which is then known
without a collective of its own. What happens to a non-finite step is
Trainer(non_finite=...): 'error' stops, naming the rank, the step and the
tensor; 'skip' drops the step (as GradScaler does); 'warn' reports it and takes
the step anyway. With fp16 loss scaling an inf gradient is the scaler's overflow
signal, so only the loss is checked then. A step whose gradients are all zero on
every rank (a loss multiplied by 0, LoRA adapters with A and B both zero, frozen
layers in the way) trains nothing, the silent failure of adapter training, and
is treated like a non-finite one (ZeroGradientError under 'error'), unless the
module's `loss_weight` sums to 0 over the step's global batch: a step with no
target at all (every label masked) has zero gradients by design.

No host synchronisation per step (issue 23). Turning a device value into a
Python number waits for every kernel queued before it, so a check read at its
own step would stall the CPU's run-ahead on a GPU at every step. Instead the
verdict's inputs are put on the device as one small vector (the step's losses
summed, one norm per gradient summed, the preemption vote, whether gradients
exist), summed over the ranks in stream order (NCCL does not block the host; on
CPU/gloo the all-reduce is left in flight and waited for when the verdict is
read, so no rank waits here for the slowest one), and copied with
`non_blocking=True` into a pinned host buffer behind a CUDA event; nothing is
read. The verdicts come from the sums on the host: a non-finite sum means some
rank saw a NaN/inf, a zero sum of norms that every gradient was zero. The check
is kept to a handful of operations, since on a small, overhead-bound step each
one shows. It is acted on at the next point that needs it,
which is always one of: step N+1's check, before its update (the event has long
completed: the device ran step N's backward while the host queued step N+1);
before a checkpoint is written (Trainer.save_checkpoint and ModelCheckpoint, so
no non-finite state ever becomes `last` or any saved checkpoint); before
validation and the epoch's end (they read values); at the end of fit. The same
schedule on every rank keeps their decisions in lock-step (the preemption vote
rides along and, with several ranks, is acted on one step later too: a signal
stops the run after the next step; one process reads its own flag at once). Where the step's values are read
anyway -- a log step (the loggers read that step's values after its update; the
first step is one) -- the verdict is read at its own step, before the update,
and non_finite='skip' always reads it there: it must decide before the update,
and making an arbitrary optimizer's update a no-op on the device is not possible
(zeroed gradients still move Adam's moments, momentum and weight decay), so
'skip' costs one wait per step and says so in the Trainer's docs. A verdict read
one step late means step N's update was applied in memory before the run stops;
the message says so ("found before step N+1's update"), names step N (not the
step it was found in), and states that nothing from step N on was saved or
logged. The message then describes what was kept from step N: its losses, and
one norm per gradient (the first non-finite one by parameter name), since the
gradients themselves are gone; a verdict read at its own step inspects the live
gradients and parameters as before (health.first_nonfinite). `agree` is the
immediate form, for callers that need the verdict at once.

Numbers in shardwise's messages follow one convention (issue 26): "step N"
is the optimizer step after which trainer.global_step reads N, the step the
loggers record its values at (the first is step 1), so a check made during
step N, before its update, finds trainer.global_step at N - 1 and says so;
"after step N" is where a rank is while trainer.global_step reads N;
"batch_idx i" is the index the batch hooks receive (0-based in the epoch),
and "epoch e" is trainer.current_epoch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import health
from shardwise.distributed import ops

# Positions in the agreed vector, each summed over the ranks: a sum of finite numbers is finite and a
# non-finite one makes it non-finite (NaN and inf propagate), norms are never negative (their sum is 0
# exactly when every one is), and a 0/1 flag's sum is positive exactly when some rank set it. So the
# per-rank values go into the all-reduce as they are and the verdicts are read from the sums on the host.
LOSSES, NORMS, SIGNALLED, HAS_GRADS, LOSS = range(5)


class ZeroGradientError(RuntimeError):
    """Every trainable gradient of an optimizer step was zero on every rank: the step would train nothing."""


class Verdict(NamedTuple):
    bad: bool  # some rank non-finite, or every gradient zero on every rank
    signalled: bool  # some rank was sent a preemption signal
    loss: Optional[float]  # the sum of the ranks' loss shares, when one was given
    zero_grads: bool  # gradients exist and every one of them is zero, on every rank


class GradNorms(NamedTuple):
    """This rank's gradients at a check: one norm each (on the device), where they sit in the list, counts."""

    norms: Optional[torch.Tensor]  # None when this rank holds no gradient element
    positions: List[int]  # the index in strategy.gradients(model) of each norm
    tensors: int  # gradient tensors held (empty shards included)
    elements: int


def grad_norms(grads: List[Optional[torch.Tensor]]) -> GradNorms:
    """One norm per non-empty local gradient, concatenated on the first gradient's device (no host read).

    Per step on every rank: kept to one pass over the list and one foreach call in the usual case (every
    gradient on one device), since on an overhead-bound step each Python-level operation shows."""
    held = [(i, g.to_local() if isinstance(g, DTensor) else g) for i, g in enumerate(grads) if g is not None]
    sizes = [t.numel() for _, t in held]
    elements = sum(sizes)
    if not elements:
        return GradNorms(None, [], len(held), 0)
    if not all(sizes):  # empty shards (FSDP on a rank holding none of a parameter) have no norm
        held = [item for item, size in zip(held, sizes) if size]
    home = held[0][1].device
    try:  # mixed dtypes are promoted by stack; mixed devices (partial offload) raise here
        groups = [held]
        norms = torch.stack(torch._foreach_norm([t for _, t in held]))
    except RuntimeError:
        by_device: Dict[Any, List[Tuple[int, torch.Tensor]]] = {}
        for i, t in held:
            by_device.setdefault(t.device, []).append((i, t))
        groups = list(by_device.values())
        norms = torch.cat([torch.stack(torch._foreach_norm([t for _, t in g])).float().to(home) for g in groups])
    positions = [i for group in groups for i, _ in group]
    return GradNorms(norms.float(), positions, len(sizes), elements)


def step_vector(
    strategy: Any,
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    signalled: bool,
    loss_share: Optional[torch.Tensor] = None,
    step_weight: Optional[torch.Tensor] = None,
    wait: bool = True,
    gradients: bool = True,
) -> Tuple[torch.Tensor, GradNorms, Any]:
    """The step's values as one float vector on the device, all-reduced (summed) over the ranks; nothing is read.

    Returns (vector, norms, work): `work` is the all-reduce still in flight when `wait` is False and the
    vector is a CPU tensor (gloo), else None; the vector holds the sums only once `work.wait()` returned.
    On a GPU the all-reduce is ordered on the device's stream, so it never blocks the host (work is None).
    `step_weight`: the step's global loss weight (trainer.step_weight). A step whose weight is 0 has
    nothing to learn from (every label masked): its gradients are zero by design, which is not a failure.
    `gradients=False` leaves them out (non_finite='off': only the preemption vote is agreed on).
    """
    grads = grad_norms(strategy.gradients(model)) if gradients else GradNorms(None, [], 0, 0)
    if losses:
        device = losses[0][1].device
    else:
        device = grads.norms.device if grads.norms is not None else strategy.root_device
    # Few small operations: on an overhead-bound step each costs as much as a small kernel.
    if not losses:
        loss_sum = torch.zeros((), device=device)
    elif len(losses) == 1:
        loss_sum = losses[0][1].detach().float().reshape(())
    else:
        loss_sum = torch.stack([t.detach().float().reshape(()).to(device) for _, t in losses]).sum()
    total = grads.norms.sum().to(device) if grads.norms is not None else torch.zeros((), device=device)
    has_grads = _flag(grads.norms is not None, device)
    if step_weight is not None:
        has_grads = has_grads * (step_weight.to(device) > 0).float()
    values = [loss_sum, total, _flag(signalled, device), has_grads]
    if loss_share is not None:
        values.append(loss_share.detach().float().reshape(()).to(device))
    vector = torch.stack(values)
    work = None
    if strategy.world_size > 1:
        vector, work = _all_reduce_sum(vector, wait)
    return vector, grads, work


# 0-dim 0/1 tensors per device, made once: Python numbers become device values by a fill, not a
# host-to-device copy (which would wait), and torch.stack copies them, so one of each serves every step.
_FLAGS: Dict[Tuple[torch.device, bool], torch.Tensor] = {}


def _flag(value: bool, device: torch.device) -> torch.Tensor:
    key = (torch.device(device), bool(value))
    flag = _FLAGS.get(key)
    if flag is None:
        flag = _FLAGS[key] = torch.full((), float(value), device=device)
    return flag


def _all_reduce_sum(vector: torch.Tensor, wait: bool) -> Tuple[torch.Tensor, Any]:
    """Sum `vector` over every rank (the world, as strategy.reduce); on gloo, unless `wait`, return the Work
    in flight instead of waiting for the slowest rank here."""
    if ops.collective_device() != vector.device:  # e.g. a CPU vector on an NCCL group: the helper moves it
        return ops.reduce(vector, "sum"), None
    work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, async_op=True)
    if wait or vector.device.type != "cpu":
        work.wait()  # on a GPU: the current stream waits for the collective, the host does not
        return vector, None
    return vector, work


def _verdict(numbers: List[float], with_loss: bool, check_grads: bool = True) -> Verdict:
    zero = numbers[HAS_GRADS] > 0 and numbers[NORMS] == 0  # NaN is not 0: a NaN gradient is not "zero"
    bad = not math.isfinite(numbers[LOSSES]) or (check_grads and not math.isfinite(numbers[NORMS]))
    return Verdict(bad or zero, numbers[SIGNALLED] > 0, numbers[LOSS] if with_loss else None, zero)


def _checks_grads(strategy: Any) -> bool:
    # With fp16 loss scaling (torch's GradScaler, or DeepSpeed's own scaler) an inf gradient is the
    # scaler's overflow signal, not an error: the scaler skips that step.
    return getattr(strategy, "grad_scaler", None) is None and not getattr(strategy, "scales_fp16_loss", False)


def agree(
    strategy: Any,
    model: nn.Module,
    losses: List[Tuple[int, torch.Tensor]],
    signalled: bool,
    loss_share: Optional[torch.Tensor] = None,
) -> Verdict:
    """The verdicts of this step, read at once (one host read): whether any rank saw a non-finite loss or
    gradient or every rank's gradients are all zero; whether any rank was signalled; the summed shares."""
    vector, _, _ = step_vector(strategy, model, losses, signalled, loss_share)
    return _verdict(vector.tolist(), loss_share is not None, _checks_grads(strategy))


class Pending(NamedTuple):
    step: int
    epoch: int
    losses: List[Tuple[int, torch.Tensor]]
    grads: GradNorms
    event: Any  # a CUDA event after the copy to the host buffer, else None
    with_loss: bool
    check_grads: bool  # False under fp16 loss scaling: an inf gradient is the scaler's business
    work: Any = None  # the all-reduce still in flight (gloo), waited for when the verdict is read
    vector: Optional[torch.Tensor] = None  # what that all-reduce sums into, copied to the host buffer after


class StepCheck:
    """The Trainer's check of each optimizer step, read when needed (see the module docstring)."""

    def __init__(self, mode: str, preemption: Any = None) -> None:
        self.mode = mode
        self.preemption = preemption
        self.pending: Optional[Pending] = None
        self.read_at_own_step: List[int] = []  # steps whose verdict was read before their update (tests)
        self._host: Optional[torch.Tensor] = None
        self._numbers: Any = None  # a numpy view of _host: read without a torch call, it is host memory

    def check(self, trainer: Any, losses: List[Tuple[int, torch.Tensor]]) -> bool:
        """At optimizer step N, before its update: act on a verdict still unread, start step N's, and read it
        now where it is read anyway or needed now (a log step, non_finite='skip'). False: skip the update.
        Under non_finite='off' only the ranks' preemption vote is summed (no losses, no gradients), with the
        same schedule: read a step later, never a host read of its own at every step."""
        strategy = trainer.strategy
        votes = self.preemption is not None and strategy.world_size > 1  # one process reads its own flag
        if self.mode == "off" and not (votes and self.preemption.flag is not None):
            return True  # nothing to agree on: no check, and no signal handler (or one process)
        if self.pending is None and votes:
            # The last vote was read and acted on at its own step; the next one rides in this step's vector.
            # Nothing new to agree on now (the same on every rank): no all-reduce of its own (preemption.py).
            self.preemption.agreed = False
        self.resolve(trainer, f"before step {trainer.global_step + 1}'s update")
        step = trainer.global_step + 1
        weighting = trainer.weighting
        share = weighting.local_loss if weighting is not None else None
        signalled = self.preemption is not None and self.preemption.signalled
        weight = weighting.total if weighting is not None else None
        now = self.mode == "skip" or step == 1 or step % trainer.log_every_n_steps == 0
        if self.mode == "off":  # the vote alone; the loss weighting reads its own sums when due (weighting.py)
            losses, share, weight, now = [], None, None, False
        # A step's values may be read by anyone once logged (weighting's step_loss goes to the metrics):
        # then the sums must be complete before the check returns; otherwise they are awaited a step later.
        vector, grads, work = step_vector(
            strategy,
            trainer.model,
            losses,
            signalled,
            share,
            weight,
            wait=now or share is not None,
            gradients=self.mode != "off",
        )
        if weighting is not None and share is not None:
            weighting.step_loss = vector[LOSS]  # a device value: the loggers read it when due
        event = self._to_host(vector, copy=work is None)
        in_flight = vector if work is not None else None
        self.pending = Pending(
            step,
            trainer.current_epoch,
            losses,
            grads,
            event,
            share is not None,
            _checks_grads(strategy),
            work,
            in_flight,
        )
        if now:
            self.read_at_own_step.append(step)
            return self.resolve(trainer, None) or self.mode != "skip"
        return True

    def _to_host(self, vector: torch.Tensor, copy: bool = True) -> Any:
        if self._host is None or self._host.shape != vector.shape:
            self._host = torch.empty(vector.shape, dtype=torch.float32, pin_memory=vector.is_cuda)
            self._numbers = self._host.numpy()
        if not copy:  # a CPU all-reduce in flight: copied once it has completed (resolve)
            return None
        self._host.copy_(vector, non_blocking=True)
        if not vector.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def resolve(self, trainer: Any, where: Optional[str] = "before a checkpoint is written") -> bool:
        """Act on the verdict not yet read, waiting for it if it is not there yet; whether that step was sound.

        where: when it is read, for the message ("before step 7's update"); None: at its own step, before
        its update (then the live gradients are inspected, and 'error' says the step was not taken).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        if pending.work is not None:
            pending.work.wait()  # on CPU: long done unless a rank is a whole step behind
            self._host.copy_(pending.vector)
        if pending.event is not None:
            pending.event.synchronize()
        verdict = _verdict(self._numbers.tolist(), pending.with_loss, pending.check_grads)
        if self.preemption is not None and trainer.strategy.world_size > 1:  # one process reads its own flag
            self.preemption.agreed = verdict.signalled
        if not verdict.bad:
            return True
        if trainer.nonfinite_step is None:
            trainer.nonfinite_step = pending.step
        report(trainer.model, pending, self.mode, verdict.zero_grads, where, trainer.global_step)
        return False


def _zero_grads_here(grads: GradNorms) -> str:
    return f"{grads.tensors} gradient tensor(s), {grads.elements:,} element(s) held here, all zero"


def _kept_nonfinite(model: nn.Module, pending: Pending) -> Optional[str]:
    """What a late verdict can still name on this rank: a step's loss, else the first gradient whose norm
    was not finite (by parameter name when the gradients were one per trainable parameter)."""
    for batch_idx, loss in pending.losses:
        value = float(loss)
        if not math.isfinite(value):
            return f"the loss of batch_idx {batch_idx} ({value})"
    if pending.grads.norms is None:
        return None
    norms = pending.grads.norms.tolist()
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    for position, norm in sorted(zip(pending.grads.positions, norms)):
        if not math.isfinite(norm):
            if len(names) == pending.grads.tensors:
                return f"the gradient of {names[position]} (its norm is {norm})"
            return f"gradient tensor {position} of {pending.grads.tensors} held here (its norm is {norm})"
    return None


def report(
    model: nn.Module,
    pending: Pending,
    mode: str,
    zero_grads: bool,
    where: Optional[str],
    global_step: int,
) -> None:
    """Name what was non-finite (or that every gradient was zero) on which rank (collective), then raise
    (mode 'error') or warn. where None: read at its own step, before its update."""
    step, epoch = pending.step, pending.epoch
    if where is None:
        taken = f"The step was not taken (trainer.global_step stays {step - 1})"
    else:
        taken = (
            f"Found {where}: the check reads each step's verdict one step later so that the run never waits "
            f"for the device, so the optimizer had already been asked to take step {step}'s update "
            f"(trainer.global_step is {global_step}), but nothing from step {step} on was saved or sent to the "
            "loggers"
        )
    if zero_grads:
        reports = ops.all_gather_object(_zero_grads_here(pending.grads))
        what = "; ".join(f"rank {r}: {text}" for r, text in enumerate(reports))
        causes = (
            "The loss does not depend on any trainable parameter: it was multiplied by 0, no token of the "
            "step had a label (all -100), the layers between the loss and the trainable parameters are frozen, "
            "or LoRA adapters whose A and B are both zero (PEFT's init_lora_weights=True keeps A random)."
        )
        message = f"Every trainable gradient is zero at optimizer step {step} (epoch {epoch}): {what}."
        if mode == "error":
            raise ZeroGradientError(
                f"{message} {taken}: nothing would be trained. {causes} "
                "Trainer(non_finite='skip') skips such steps, 'warn' only reports them."
            )
        action = "skipped (no update)" if mode == "skip" else "taken anyway (non_finite='warn')"
        warnings.warn(f"{message} The step was {action}. {causes}", stacklevel=3)
        return
    if where is None:
        # param.grad first; an engine keeping gradients elsewhere (DeepSpeed ZeRO-2/3) by the kept norms.
        found = health.first_nonfinite(model, [(i, float(t)) for i, t in pending.losses])
        found = found or _kept_nonfinite(model, pending)
    else:
        found = _kept_nonfinite(model, pending)
    reports = ops.all_gather_object(found)
    named = [f"rank {r}: {what}" for r, what in enumerate(reports) if what]
    what = "; ".join(named) or "a non-finite value on another rank"
    if mode == "error":
        raise health.NonFiniteError(
            f"Non-finite values at optimizer step {step} (epoch {epoch}): {what}. {taken}"
            f"{' and nothing after the last checkpoint was saved' if where is None else ''}. "
            "Lower the learning rate, clip gradients "
            "(gradient_clip_val), check the data of that batch, or use bf16 instead of fp16; "
            "Trainer(non_finite='skip') skips such steps (checking before each update), 'warn' only reports them."
        )
    action = "skipped (no update)" if mode == "skip" else "taken anyway (non_finite='warn')"
    warnings.warn(f"Non-finite values at optimizer step {step}: {what}. The step was {action}.", stacklevel=3)
