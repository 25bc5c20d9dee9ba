"""MixedPrecision + DynamicLossScaler against torch.autocast + torch.amp.GradScaler, step by step."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

STEPS = 40
INJECT = {3: float("inf"), 4: float("inf"), 9: float("nan"), 17: float("inf"), 18: float("nan"), 30: float("inf")}


def model_and_data(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(STEPS, 8, 16)
    y = torch.randint(0, 4, (STEPS, 8))
    return model, x, y


def loss_of(model, x, y, step):
    loss = F.cross_entropy(model(x), y)
    return loss * INJECT[step] if step in INJECT else loss


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("clip", [False, True])
def test_scale_skips_and_parameters_equal_gradscaler(optimizer_name, clip):
    reference, x, y = model_and_data()
    ours = copy.deepcopy(reference)

    def make_optimizer(model):
        if optimizer_name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    ref_opt, our_opt = make_optimizer(reference), make_optimizer(ours)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    mp = mixprec.MixedPrecision(
        ours, our_opt, "mixed_fp16", mixprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=4, max_scale=None)
    )
    scales = []
    for step in range(STEPS):
        # The same fp16 compute as mixprec's (emulated on CPUs without fp16 units): this test is about
        # scaling, skipping and updating, which GradScaler and the optimizer do on the reference side.
        with mixprec.autocast("mixed_fp16", reference):
            ref_loss = loss_of(reference, x[step], y[step], step)
        grad_scaler.scale(ref_loss).backward()
        if clip:
            grad_scaler.unscale_(ref_opt)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        before = grad_scaler.get_scale()
        grad_scaler.step(ref_opt)
        grad_scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        ref_applied = grad_scaler.get_scale() >= before  # GradScaler backs off exactly on skipped steps

        with mp.autocast():
            our_loss = loss_of(ours, x[step], y[step], step)
        mp.backward(our_loss)
        if clip:
            our_norm = mp.clip_grad_norm_(1.0)
            assert torch.equal(our_norm, ref_norm) or (our_norm.isnan() and ref_norm.isnan()), step
        applied = bool(mp.step())

        assert applied == ref_applied == (step not in INJECT), step
        assert mp.stats().scale == grad_scaler.get_scale(), step
        for a, b in zip(reference.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ after step {step}"
        scales.append(grad_scaler.get_scale())

        if step == STEPS // 2:  # a round trip of both states mid-run changes nothing
            mp.load_state_dict(copy.deepcopy(mp.state_dict()))
            grad_scaler.load_state_dict(copy.deepcopy(grad_scaler.state_dict()))

    changes = list(itertools.pairwise(scales))
    assert any(b > a for a, b in changes) and any(b < a for a, b in changes)  # the run both grew and backed off
    stats = mp.stats()
    assert stats.skipped_steps == len(INJECT)
    assert stats.steps == STEPS and stats.applied_steps == STEPS - len(INJECT)
    assert stats.recent_overflow_steps == tuple(sorted(INJECT))


def test_scaler_decisions_equal_gradscaler_for_odd_factors():
    """Non-power-of-two factors: the fp64 products must round like GradScaler's kernel."""
    param = nn.Parameter(torch.ones(3))
    grad_scaler = torch.amp.GradScaler(
        "cpu", init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2
    )
    ours = mixprec.DynamicLossScaler(
        init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=2, max_scale=None
    )
    optimizer = torch.optim.SGD([param], lr=0.0)
    pattern = [0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0] * 5
    for step, bad in enumerate(pattern):
        loss = (param * (float("inf") if bad else 1.0)).sum()
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        optimizer.zero_grad()
        grad = [torch.full((3,), float("inf") if bad else 1.0) * ours.get_scale()]
        ours.update(ours.unscale_(grad))
        assert ours.get_scale() == grad_scaler.get_scale(), step
