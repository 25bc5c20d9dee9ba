"""A resume that loads the optimizer's state but not MixedPrecision's (the loss scale, the counters) is said,
once, before the first step; loading both, in either order, says nothing."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

SAID = r"the optimizer's state was loaded .* but this MixedPrecision's was not: the loss scale restarts at 65536"


def _run(policy: str = "mixed_fp16"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, mixprec.MixedPrecision(model, optimizer, policy)


def _step(mp, model, overflow: bool = False) -> None:
    with mp.autocast():
        loss = F.cross_entropy(model(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0]))
    mp.backward(loss * (float("inf") if overflow else 1.0))
    mp.step()


@pytest.fixture
def saved():
    model, optimizer, mp = _run()
    for overflow in (True, False, False):  # one overflow: the scale is 32768, not the initial 65536
        _step(mp, model, overflow)
    return model.state_dict(), optimizer.state_dict(), mp.state_dict()


def test_the_optimizer_loaded_without_mixed_precision_is_said_at_the_first_step(saved):
    weights, optimizer_state, _ = saved
    model, optimizer, mp = _run()
    model.load_state_dict(weights)
    optimizer.load_state_dict(optimizer_state)
    with pytest.warns(UserWarning, match=SAID + r".*mp.load_state_dict\(state\).*register_for_checkpointing\(mp\)"):
        _step(mp, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _step(mp, model)


@pytest.mark.parametrize("mixprec_first", [False, True])
def test_both_loaded_in_either_order_say_nothing_and_the_scale_is_the_saved_one(saved, mixprec_first):
    weights, optimizer_state, mixprec_state = saved
    model, optimizer, mp = _run()
    model.load_state_dict(weights)
    if mixprec_first:  # Lightning restores the precision plugin before the optimizers
        mp.load_state_dict(mixprec_state)
    optimizer.load_state_dict(optimizer_state)
    if not mixprec_first:  # Accelerate's load_state: the optimizers, then the registered objects
        mp.load_state_dict(mixprec_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(mp, model)
    assert mp.stats().scale == 32768.0


def test_a_fresh_optimizer_reloaded_or_a_load_mid_training_says_nothing(saved):
    _, optimizer_state, _ = saved
    model, optimizer, mp = _run()
    optimizer.load_state_dict(optimizer.state_dict())  # empty state: Accelerate's prepare() places it so
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(mp, model)
        optimizer.load_state_dict(optimizer_state)  # after an update: MixedPrecision's own state is live
        _step(mp, model)


def test_policies_without_a_loss_scale_have_nothing_to_lose(saved):
    _, optimizer_state, _ = saved
    model, optimizer, mp = _run("mixed_bf16")
    optimizer.load_state_dict(optimizer_state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(mp, model)
