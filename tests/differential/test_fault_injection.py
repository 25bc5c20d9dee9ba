"""Fault injection: inf and NaN gradients at random steps, in random layers, under every fp16 policy.

Every injected step must be skipped with the weights, the master weights and the optimizer state
bit-identical before and after it; the statistics must count each kind; and the run, given as many
applied updates as the clean FP32 run, must end at the FP32 run's loss.
"""

import logging
import random

import pytest
import torch
from torch import nn

import mixprec
import mixprec.app

APPLIED = 200  # updates every run applies
RATE = 0.15  # chance of an injected fault per step


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096 + 512, 16, generator=generator)
    noisy = x + 0.7 * torch.randn(x.shape, generator=generator)  # labels from noisy inputs: a loss floor
    y = (noisy[:, :4].sum(1) > 0).long() + (noisy[:, 4:8].sum(1) > 0).long()
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))


def _snapshot(engine: mixprec.MixedPrecision) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in engine.model.parameters()]
    if engine.masters is not None:
        tensors += [m.clone() for m in engine.masters.state()]
    for state in engine.optimizer.state.values():
        tensors += [v.clone() for v in state.values() if torch.is_tensor(v)]
    return tensors


def _run(policy: str, inject: bool, seed: int = 0):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # max_scale keeps the scale below where these gradients overflow on their own, so that every skip
    # is an injected one; a short growth interval lets the scale recover from the injected back-offs
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=4, max_scale=2.0**12)
    engine = mixprec.MixedPrecision(model, optimizer, policy, scaler if "fp16" in policy else None)
    x, y = _data()
    rng = random.Random(seed)
    layers = [p for p in model.parameters()]
    injected = {"inf": 0, "nan": 0}
    applied = step = 0
    while applied < APPLIED:
        batch = slice(64 * (applied % 64), 64 * (applied % 64 + 1))  # a skipped step's batch comes again
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        engine.backward(loss)
        kind = rng.choice(["inf", "nan"]) if inject and rng.random() < RATE else None
        if kind is not None:
            grad = rng.choice(layers).grad
            # .data: a fault in the gradient, past the watch for edits of scaled gradients
            grad.data.view(-1)[rng.randrange(grad.numel())] = float(kind)
            injected[kind] += 1
            before = _snapshot(engine)
        result = engine.step()
        if kind is not None:
            assert not result, f"step {step}: an injected {kind} was applied"
            after = _snapshot(engine)
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), f"step {step} changed state"
        else:
            assert result, f"step {step}: a clean step was skipped"
            applied += 1
        step += 1
    with torch.no_grad(), engine.autocast():  # on 512 held-out samples
        final = nn.functional.cross_entropy(model(x[4096:]), y[4096:]).item()
    return engine.stats(), injected, final


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_fp16"])
def test_injected_faults_are_skipped_without_a_trace_and_counted(policy):
    stats, injected, final = _run(policy, inject=True)
    faults = injected["inf"] + injected["nan"]
    assert faults >= 20 and injected["inf"] and injected["nan"]
    assert stats.skipped_steps == faults and stats.applied_steps == APPLIED
    assert (stats.inf_steps, stats.nan_steps) == (injected["inf"], injected["nan"])
    _, _, reference = _run("fp32", inject=False)
    _, _, clean = _run(policy, inject=False)
    # the faults cost nothing: the faulted run ends where the clean run of its policy ends (the only
    # difference is the loss scale the faults lowered), and both within 1% of FP32's held-out loss
    assert final == pytest.approx(clean, rel=1e-4)
    assert final == pytest.approx(reference, rel=0.01)


class _ExplodingGradient(torch.autograd.Function):
    """Identity forward; a backward whose gradient is infinite at every loss scale."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class _Exploding(nn.Module):
    def forward(self, x):
        return _ExplodingGradient.apply(x)


def test_a_model_that_overflows_at_every_scale_reaches_the_floor_safely(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), _Exploding(), nn.GELU(), nn.Linear(32, 3))
    initial = [p.detach().clone() for p in model.parameters()]
    x, y = _data()
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 640, 64)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = mixprec.app.TrainData(batches, None, nn.functional.cross_entropy)
    trainer = mixprec.app.Trainer(model, optimizer, data, "mixed_fp16", run=mixprec.app.RunOptions(progress=False))
    result = trainer.fit(steps=60)  # returns: a bounded number of attempts, every one skipped
    stats = result.stats
    assert result.steps == 60 and stats.skipped_steps == 60 and stats.applied_steps == 0
    assert stats.inf_steps + stats.nan_steps == 60
    # the dynamic scaler halves from 2**16 on every overflow, 40 times, and stops at its hard floor 2**-24
    # (GradScaler would reach 0 after about 166, from where no growth could bring it back)
    assert stats.scale == 2.0**-24 and trainer.mp.scalers[0].is_floor(stats.scale)
    assert "does not come from loss scaling" in stats.diagnosis and "mixprec doctor" in stats.diagnosis
    assert all(torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    assert not optimizer.state  # the optimizer never stepped: no moments were created


def test_a_collapsed_scale_recovers_and_the_underflow_is_counted(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 3))
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "mixed_fp16")
    x, y = _data()
    losses = []
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for step in range(50 + 300):
            with mp.autocast():
                loss = nn.functional.cross_entropy(model(x[:64]), y[:64])
            losses.append(loss.item())
            mp.backward(loss * float("inf") if step < 50 else loss)  # 50 overflows: the scale collapses
            mp.step()
            if step == 49:
                assert mp.stats().scale == 2.0**-24  # the hard floor
            if step == 50 + 24:
                assert mp.stats().scale == 1.0  # x2 per clean step: back to 1 in 24 clean steps
    stats = mp.stats()
    assert stats.skipped_steps == 50 and stats.applied_steps == 300
    assert 0 < stats.underflow_steps < 24  # the first clean steps at tiny scales: zero gradients, counted
    assert any(r.message.startswith("Gradient underflow at step 50") for r in caplog.records)
    assert losses[-1] < 0.5 * losses[50]  # training resumed (without recovery it stays where it was)
