"""Manual optimization as in Lightning (issue 24, item 4): a small GAN with two optimizers.

`automatic_optimization = False`, `self.optimizers()`, `self.manual_backward(loss)`, `opt.step()`,
`opt.zero_grad()`, `self.toggle_optimizer`. The GAN trains on one device exactly as a hand-written
PyTorch loop does; under DDP and FSDP (two processes) it follows the one-device run on the same
global batch, and every rank ends with the same weights. Several optimizers in automatic mode, and
what manual mode cannot honour, are refused with the fix.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise
from shardwise import FSDPStrategy, TrainModule
from shardwise.health import NonFiniteError

from helpers.selection import selected_params
from helpers.trainers import quiet_trainer as _trainer

STEPS = 6  # batches; each takes one discriminator and one generator step


class Generator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


class Discriminator(nn.Sequential):
    def __init__(self):
        super().__init__(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))


def gan_data(n=48):
    """(real sample, noise) pairs: the noise comes with the batch, so every layout draws the same."""
    g = torch.Generator().manual_seed(0)
    real = torch.randn(n, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
    return TensorDataset(real, torch.randn(n, 4, generator=g))


def gan_losses(generator, discriminator, real, noise):
    fake = generator(noise)
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    d_loss = F.binary_cross_entropy_with_logits(discriminator(real), ones) + F.binary_cross_entropy_with_logits(
        discriminator(fake.detach()), zeros
    )
    return fake, ones, d_loss


class GAN(TrainModule):
    def __init__(self, toggle=False):
        super().__init__()
        self.automatic_optimization = False
        self.generator, self.discriminator = Generator(), Discriminator()
        self.toggle = toggle
        self.history = []

    def training_step(self, batch, batch_idx):
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        _, ones, d_loss = gan_losses(self.generator, self.discriminator, real, noise)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        if self.toggle:
            self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(noise)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        if self.toggle:
            self.untoggle_optimizer(opt_g)
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})
        self.history.append((d_loss.item(), g_loss.item()))

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=0.01),
            torch.optim.Adam(self.discriminator.parameters(), lr=0.01),
        )


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def hand_written(module, toggle=False, batch_size=8, steps=STEPS):
    """The same GAN trained by a plain PyTorch loop (toggle: the discriminator is frozen for the
    generator's backward, so its gradients do not carry into the next discriminator step)."""
    opt_g, opt_d = module.configure_optimizers()
    history = []
    for i, (real, noise) in enumerate(DataLoader(gan_data(), batch_size=batch_size)):
        if i == steps:
            break
        _, ones, d_loss = gan_losses(module.generator, module.discriminator, real, noise)
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        module.discriminator.requires_grad_(not toggle)
        g_loss = F.binary_cross_entropy_with_logits(module.discriminator(module.generator(noise)), ones)
        g_loss.backward()
        module.discriminator.requires_grad_(True)
        opt_g.step()
        opt_g.zero_grad()
        history.append((d_loss.item(), g_loss.item()))
    return history


@pytest.mark.parametrize("toggle", [False, True], ids=["plain", "toggle_optimizer"])
def test_gan_trains_like_a_hand_written_loop(toggle):
    shardwise.seed_everything(0)
    module = GAN(toggle=toggle)
    reference = copy.deepcopy(module)
    before = _state(module)
    trainer = _trainer(max_epochs=1, limit_train_batches=STEPS)
    trainer.fit(module, DataLoader(gan_data(), batch_size=8))
    expected = hand_written(reference, toggle)
    torch.testing.assert_close(torch.tensor(module.history), torch.tensor(expected), rtol=1e-5, atol=1e-6)
    for name, value in _state(module).items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)
        assert not torch.equal(value, before[name]), f"{name} did not change"
    assert trainer.global_step == 2 * STEPS  # one per optimizer step, as Lightning counts
    assert {"d_loss", "g_loss"} <= set(trainer.callback_metrics)
    assert all(p.requires_grad for p in module.parameters())  # untoggled


def test_max_steps_counts_optimizer_steps():
    trainer = _trainer(max_steps=4)
    trainer.fit(GAN(), DataLoader(gan_data(), batch_size=8))
    assert trainer.global_step == 4 and len(trainer.module.history) == 2


def test_optimizers_and_lr_schedulers_in_automatic_mode():
    seen = {}

    class Auto(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            opt, sched = self.optimizers(), self.lr_schedulers()
            seen["lr"] = opt.param_groups[0]["lr"]
            seen["raw"] = self.optimizers(use_pl_optimizer=False)
            seen["sched"] = sched
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1)]

    trainer = _trainer(max_steps=1)
    trainer.fit(Auto(), DataLoader(gan_data(), batch_size=8))
    assert seen["lr"] == 0.5
    assert seen["raw"] is trainer.strategy.optimizers[0]
    assert isinstance(seen["sched"], torch.optim.lr_scheduler.StepLR)


def test_several_optimizers_in_automatic_mode_are_refused():
    class TwoAuto(GAN):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = True

    with pytest.raises(ValueError, match=r"returned 2 optimizers.*self.automatic_optimization = False"):
        _trainer(max_steps=1).fit(TwoAuto(), DataLoader(gan_data(), batch_size=8))


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(accumulate_grad_batches=2), "accumulate_grad_batches=2"),
        (dict(gradient_clip_val=1.0), r"gradient_clip_val=1.0 \(call `self.clip_gradients"),
    ],
)
def test_manual_mode_refuses_what_the_loop_would_do(option, match):
    with pytest.raises(ValueError, match=match):
        _trainer(max_steps=1, **option).fit(GAN(), DataLoader(gan_data(), batch_size=8))


def test_manual_backward_in_automatic_mode_is_refused():
    class Wrong(TrainModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            self.manual_backward(self.net(batch[0]).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(RuntimeError, match="manual_backward.*automatic_optimization = False"):
        _trainer(max_steps=1).fit(Wrong(), DataLoader(gan_data(), batch_size=8))


def test_clip_gradients_and_non_finite_in_manual_mode():
    class Clipped(GAN):
        def training_step(self, batch, batch_idx):
            opt_g, opt_d = self.optimizers()
            real, noise = batch
            loss = self.discriminator(real).sum() * 1e3
            self.manual_backward(loss)
            self.norm = float(self.clip_gradients(opt_d, gradient_clip_val=0.1))
            total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.discriminator.parameters()]))
            self.clipped = float(total)
            opt_d.step()
            opt_d.zero_grad()

    module = Clipped()
    _trainer(max_steps=1).fit(module, DataLoader(gan_data(), batch_size=8))
    assert module.norm > 1.0 and module.clipped == pytest.approx(0.1, rel=1e-4)

    class Exploding(GAN):
        def training_step(self, batch, batch_idx):
            _, opt_d = self.optimizers()
            self.manual_backward(self.discriminator(batch[0]).sum() * float("inf"))
            opt_d.step()

    with pytest.raises(NonFiniteError, match="optimizer step 1"):
        _trainer(max_steps=1).fit(Exploding(), DataLoader(gan_data(), batch_size=8))


# ------------------------------------------------------------------ two processes
def gan_run(strategy_name, world, steps):
    """One worker: the GAN on `world` ranks with the global batch 8; returns its history and weights."""
    shardwise.seed_everything(0)
    module = GAN()
    strategy = strategy_name
    if strategy_name == "fsdp":  # each network its own FSDP unit: each call gathers its own shards
        strategy = FSDPStrategy(auto_wrap_policy={Generator, Discriminator})
    trainer = _trainer(devices=world, strategy=strategy, max_epochs=1, limit_train_batches=steps)
    trainer.fit(module, DataLoader(gan_data(), batch_size=8 // world))
    state = trainer.strategy.model_state_dict(trainer.model) if strategy_name != "fsdp" else None
    if strategy_name == "fsdp":
        from torch.distributed.tensor import DTensor

        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()
        }
    return module.history, {k: v.clone() for k, v in state.items()}, trainer.global_step


def gan_runs(strategy_names, world, steps):
    """One worker: gan_run for each strategy in turn, in the same processes."""
    return {name: gan_run(name, world, steps) for name in strategy_names}


@pytest.fixture(scope="module")
def gan_on_two_ranks(request):
    """The one-device reference and the selected strategies of test_gan_trains_under_two_processes_like_one,
    one after another in one launch of 2 ranks (start-up costs more than these runs)."""
    names = selected_params(request, "strategy", ["test_gan_trains_under_two_processes_like_one"])
    reference = shardwise.launch(gan_run, "single", 1, STEPS, devices=1)[0]
    ranks = shardwise.launch(gan_runs, names, 2, STEPS, devices=2)
    return reference, {name: [rank[name] for rank in ranks] for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gan_trains_under_two_processes_like_one(strategy, gan_on_two_ranks):
    (reference, ref_state, _), by_strategy = gan_on_two_ranks
    ranks = by_strategy[strategy]
    for history, state, global_step in ranks:
        assert global_step == 2 * STEPS
        # The losses logged per rank are of each rank's half; the weights, from averaged gradients,
        # follow the one-device run on the whole batch.
        assert all(torch.isfinite(torch.tensor(h)).all() for h in history)
        assert len({round(d, 6) for d, _ in history}) > 1, history
        for name, value in state.items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-5, msg=f"{strategy}: {name}")
    first, second = ranks[0][1], ranks[1][1]
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0)
    assert reference[-1] != reference[0]


def test_fsdp_root_unit_parameters_are_refused_in_manual_mode():
    # The root unit gathers once per training_step: a second forward after a step would use stale weights.
    # strategy="fsdp" without a policy makes each network a unit of its own in manual mode (Lightning's GAN
    # example runs so); a parameter on the TrainModule itself stays in the root unit and is refused.
    class WithRootParameter(GAN):
        def __init__(self):
            super().__init__()
            self.temperature = torch.nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match=r"root unit.*auto_wrap_policy=\{Discriminator, Generator\}"):
        _trainer(strategy="fsdp", max_steps=1).fit(WithRootParameter(), DataLoader(gan_data(), batch_size=8))
    for strategy in ("fsdp", FSDPStrategy(auto_wrap_policy={Generator, Discriminator})):
        trainer = _trainer(strategy=strategy, max_steps=2)
        trainer.fit(GAN(), DataLoader(gan_data(), batch_size=8))
        assert trainer.global_step == 2


def test_lr_schedulers_are_the_users_to_step_in_manual_mode():
    class Scheduled(GAN):
        def configure_optimizers(self):
            opt_g, opt_d = super().configure_optimizers()
            return [opt_g, opt_d], [
                torch.optim.lr_scheduler.StepLR(opt_g, 1, 0.5),
                {"scheduler": torch.optim.lr_scheduler.StepLR(opt_d, 1, 0.5), "interval": "step"},
            ]

        def on_train_epoch_end(self):
            sched_g, _ = self.lr_schedulers()
            sched_g.step()  # the generator's, once an epoch; the discriminator's is never stepped

    trainer = _trainer(max_epochs=2, limit_train_batches=2)
    trainer.fit(Scheduled(), DataLoader(gan_data(), batch_size=8))
    opt_g, opt_d = trainer.strategy.optimizers
    assert opt_g.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2)
    assert opt_d.param_groups[0]["lr"] == pytest.approx(0.01)  # not stepped by the loop


class ManualRegression(TrainModule):
    """One optimizer, stepped by hand: what DeepSpeed (one optimizer per engine) can run manually."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt = self.optimizers()
        loss = F.mse_loss(self.net(real), real.sum(1, keepdim=True))
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def manual_regression(strategy):
    shardwise.seed_everything(0)
    module = ManualRegression()
    trainer = _trainer(strategy=strategy, max_steps=4)
    trainer.fit(module, DataLoader(gan_data(), batch_size=8))
    return {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()}, trainer.global_step


def manual_regressions(strategies):
    return [manual_regression(strategy) for strategy in strategies]


@pytest.mark.slow
@pytest.mark.deepspeed
def test_manual_optimization_under_deepspeed():
    pytest.importorskip("deepspeed")
    # Both in one process, the reference first: a fresh process each would only add start-up.
    (reference, _), (state, steps) = shardwise.launch(manual_regressions, ["single", "deepspeed_stage_2"], devices=1)[0]
    assert steps == 4
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
