"""A model is freed once the user drops it: nothing mixprec keeps about a model (its seat, its FP8 scale states,
its output cast, compensated residuals) holds it alive after its engine and regions are gone."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import mixprec

POLICIES = [
    "mixed_bf16",
    "fp8",
    "base=fp8,fp8=(scaling=blockwise)",
    "base=mixed_fp16,kernels=emulated",
    "base=mixed_bf16,output=fp16",
    "pure_bf16",
]


def _trained_once(policy: str, model: nn.Module) -> weakref.ref:
    optimizer = mixprec.AdamW(model.parameters()) if policy == "pure_bf16" else torch.optim.SGD(model.parameters())
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    x = torch.randn(8, 16)
    with mp.autocast():
        loss = model(x).float().square().mean()
    mp.backward(loss)
    mp.step()
    with torch.no_grad(), mixprec.autocast("fp8", model):  # and a one-off region of another policy
        model(x)
    return weakref.ref(model)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shape", ["a GEMM layer itself", "a Sequential"])
def test_a_model_trained_under_a_policy_is_freed_when_dropped(policy, shape):
    # A model that is itself a GEMM layer was kept forever by its FP8 state, which holds the layer
    model = nn.Linear(16, 16) if shape == "a GEMM layer itself" else nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    alive = _trained_once(policy, model)
    del model
    gc.collect()
    assert alive() is None


def test_a_copy_of_an_fp8_model_carries_its_scale_states():
    import copy

    policy = "base=fp8,fp8=(scaling=delayed)"  # scales from the amax history
    model = nn.Linear(16, 16)
    with mixprec.autocast(policy, model):  # a training forward (with gradients: an evaluation records nothing)
        model(torch.randn(8, 16) * 100)  # a large amax recorded: the next scale is smaller
    twin, fresh = copy.deepcopy(model), nn.Linear(16, 16)
    fresh.load_state_dict(model.state_dict())  # the same weights, no scale states
    x = torch.randn(8, 16) * 0.01  # small values: under the recorded scale many fall below e4m3's normal range
    outputs = []
    for each in (model, twin, fresh):
        with torch.no_grad(), mixprec.autocast(policy, each):
            outputs.append(each(x))
    original, copied, without = outputs
    assert torch.equal(copied, original) and not torch.equal(without, original)


def test_weights_replaced_after_one_off_regions_are_freed():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    for policy in ("fp8", "base=mixed_bf16,names=1", "mixed_bf16"):
        with torch.no_grad(), mixprec.autocast(policy, model):  # each kept for the next region of its policy
            model(torch.randn(8, 16))
    old = [weakref.ref(p) for p in model.parameters()]
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    gc.collect()
    assert all(ref() is None for ref in old)  # the kept regions held the parameters they were prepared with


class _CheckpointingRoot(nn.Sequential):
    """A root module with Hugging Face's checkpointing flag: the region keeps a list of such modules."""

    gradient_checkpointing = False


@pytest.mark.parametrize("policy", ["mixed_bf16", "fp8", "base=mixed_bf16,names=1", "base=mixed_fp16,bf16_names=1"])
def test_a_model_dropped_after_one_off_regions_is_freed_at_once(policy):
    # without the cycle collector, as `del model; torch.cuda.empty_cache()` relies on: the kept regions in the
    # model's __dict__ held the model (their region's model, their layout's first module)
    model = _CheckpointingRoot(nn.Linear(16, 32), nn.Linear(32, 4))
    for _ in range(2):
        with torch.no_grad(), mixprec.autocast(policy, model):
            model(torch.randn(8, 16))
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "policy", ["mixed_bf16", "mixed_fp16", "o2_bf16", "pure_bf16", "base=fp8,fp8=(scaling=delayed)", "fp32"]
)
def test_an_engine_dropped_with_its_model_frees_it_at_once(policy):
    # without the cycle collector: the engine held itself through its pending-gradient guard (a bound method of
    # the engine), so `del mp, model, optimizer; torch.cuda.empty_cache()` kept the weights until a collection
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = mixprec.AdamW(model.parameters()) if policy == "pure_bf16" else torch.optim.AdamW(model.parameters())
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for _ in range(2):
        with mp.autocast():
            loss = model(torch.randn(8, 16)).float().square().mean()
        mp.backward(loss)
        mp.clip_grad_norm_(1.0)
        mp.step()
        mp.step_scheduler(scheduler)
    mp.load_state_dict(mp.state_dict())
    alive = [weakref.ref(model), weakref.ref(mp)]
    gc.disable()
    try:
        del model, optimizer, mp, scheduler, loss
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()
