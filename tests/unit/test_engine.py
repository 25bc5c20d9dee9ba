import copy
import dataclasses
import logging
import math
import typing

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

PRESETS = ["fp32", "mixed_bf16", "mixed_fp16", "o2_bf16", "o2_fp16", "pure_bf16"]


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.GELU(), nn.Linear(24, 5))


def make_optimizer(model, policy, **kwargs):
    if policy == "pure_bf16":
        return mixprec.AdamW(model.parameters(), lr=1e-2, **kwargs)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **kwargs)


def batch(seed, n=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def train_step(mp, model, seed, poison=None, clip=None):
    """One step; ``poison`` (inf or NaN) is added to the last layer's weight gradient."""
    x, y = batch(seed)
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    last = [p for p in model.parameters() if p.dim() == 2][-1]
    hook = last.register_hook(lambda grad: grad + poison) if poison is not None else None
    mp.backward(loss)
    if hook is not None:
        hook.remove()
    if clip is not None:
        mp.clip_grad_norm_(clip)
    return mp.step(), loss.detach()


def snapshot(mp, model):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.clone() for m in mp.masters.state()] if mp.masters else [],
        "optimizer": copy.deepcopy(mp.optimizer.state_dict()),
    }


def assert_bit_identical(a, b):
    for x, y in zip(a["params"] + a["masters"], b["params"] + b["masters"], strict=True):
        assert torch.equal(x, y)
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name in state_a[key]:
            assert torch.equal(torch.as_tensor(state_a[key][name]), torch.as_tensor(state_b[key][name])), name


@pytest.mark.parametrize("policy", PRESETS)
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_skipped_step_leaves_everything_bit_identical(policy, poison):
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    for seed in range(3):
        assert train_step(mp, model, seed)
    before = snapshot(mp, model)
    result, _ = train_step(mp, model, 99, poison=poison, clip=1.0)
    assert not result and not result.applied
    assert_bit_identical(before, snapshot(mp, model))
    assert all(p.grad is None for p in model.parameters())
    assert train_step(mp, model, 4)  # and training goes on
    stats = mp.stats()
    assert (stats.steps, stats.skipped_steps) == (5, 1)
    assert (stats.inf_steps, stats.nan_steps) == ((1, 0) if poison == float("inf") else (0, 1))
    assert stats.recent_overflow_steps == (3,)


@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_unscaled_policies_skip_and_tell_inf_from_nan_on_every_device(policy, device):
    # off the CPU with a fused optimizer nothing waits for the host: the check's one read (each gradient's max
    # magnitude) flags the step for the optimizer and tells inf from NaN for the statistics
    torch.manual_seed(0)
    model = make_model().to(device)
    fused = {"fused": True} if device != "cpu" else {}
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **fused), policy)
    x, y = (t.to(device) for t in batch(0))
    last = [p for p in model.parameters() if p.dim() == 2][-1]
    for poison in (None, float("inf"), None, float("nan"), None):
        before = [p.detach().clone() for p in model.parameters()]
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        hook = last.register_hook(lambda grad, poison=poison: grad + poison) if poison is not None else None
        mp.backward(loss)
        if hook is not None:
            hook.remove()
        mp.step()
        moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert moved == (poison is None)
    stats = mp.stats()
    assert (stats.steps, stats.skipped_steps, stats.inf_steps, stats.nan_steps) == (5, 2, 1, 1)


@pytest.mark.parametrize(
    ("policy", "scaler"),
    [
        ("fp32", mixprec.NoOpLossScaler),
        ("mixed_bf16", mixprec.NoOpLossScaler),
        ("pure_bf16", mixprec.NoOpLossScaler),
        ("mixed_fp16", mixprec.DynamicLossScaler),
        ("o2_fp16", mixprec.DynamicLossScaler),
    ],
)
def test_default_scaler_per_policy(policy, scaler):
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    assert type(mp.scalers[0]) is scaler
    assert mp.stats().scale == (2.0**16 if scaler is mixprec.DynamicLossScaler else 1.0)


def test_o2_wires_fp32_masters_into_the_users_optimizer():
    model = make_model()
    original = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "lr": 1e-3}, {"params": [*model[1].parameters(), *model[3].parameters()]}],
        lr=5e-3,
        weight_decay=0.1,
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    mp = mixprec.MixedPrecision(model, optimizer, "o2_bf16")
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    group_params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in group_params)
    masters = mp.masters.state()
    assert len(masters) == 4 and torch.equal(masters[0], original[0])  # exact FP32 values, not their rounding
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 5e-3]
    train_step(mp, model, 0)
    mp.step_scheduler(scheduler)
    assert [g["lr"] for g in optimizer.param_groups] == [5e-4, 2.5e-3]
    assert torch.equal(model[0].weight, mp.masters.state()[0].to(torch.bfloat16))  # copied back after the step


def test_weights_loaded_into_the_model_after_the_masters_were_made_are_refused_not_overwritten():
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, "o2_bf16"), "o2_bf16")
    model.load_state_dict(make_model(seed=1).state_dict())  # rounded into the bf16 parameters; masters: seed 0
    loaded = [p.detach().clone() for p in model.parameters()]
    x, y = batch(0)
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=r"4 of the model's 4 torch.bfloat16 parameters \(first: '0.weight'\) no "):
        mp.step()  # the LayerNorm's 2 stay FP32 under o2: their values were taken, no master to disagree with
    assert all(torch.equal(a, b) for a, b in zip(loaded, model.parameters(), strict=True))


def test_pure_bf16_requires_a_compensated_optimizer():
    model = make_model()
    with pytest.raises(ValueError, match=r"plain AdamW would round small updates away.*mixprec\.AdamW"):
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "pure_bf16")


@pytest.mark.parametrize("policy", ["fp32", "mixed_bf16", "mixed_fp16", "o2_fp16"])
def test_accumulation_equals_one_large_batch(policy):
    big_model, small_model = make_model(), make_model()
    big = mixprec.MixedPrecision(big_model, torch.optim.SGD(big_model.parameters(), lr=0.1), policy)
    small = mixprec.MixedPrecision(
        small_model, torch.optim.SGD(small_model.parameters(), lr=0.1), policy, accumulation_steps=4
    )
    x, y = batch(0, n=32)
    with big.autocast():
        big.backward(F.cross_entropy(big_model(x), y))
    assert big.step()
    results = []
    for chunk in range(4):
        assert small.at_update_boundary == (chunk == 3)
        with small.autocast():
            small.backward(F.cross_entropy(small_model(x[chunk * 8 : (chunk + 1) * 8]), y[chunk * 8 : (chunk + 1) * 8]))
        results.append(small.step())
    assert [r.update_step for r in results] == [False, False, False, True] and results[-1]
    tolerance = {"fp32": 1e-6, "mixed_bf16": 2e-2, "mixed_fp16": 2e-3, "o2_fp16": 2e-3}[policy]
    for a, b in zip(big_model.parameters(), small_model.parameters(), strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance)
    assert small.stats().steps == 1


def test_accumulate_in_fp32_keeps_fp32_gradient_buffers():
    model = make_model()
    mp = mixprec.MixedPrecision(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16", accumulation_steps=2, accumulate_in_fp32=True
    )
    x, y = batch(0)
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    assert model[0].weight.grad is None
    assert mp.masters.masters[0].grad.dtype == torch.float32
    assert mp.stats().bytes_per_param.grads == 4.0
    # what an example prints: the parts say why this o2 run holds 2 bytes a parameter more than one without sums
    assert str(mp.stats().bytes_per_param) == "9.8 bytes/param: 2.2 weights + 4 gradients + 3.6 masters + 0 optimizer"
    mp.step()
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    assert mp.step()


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_fp16", "o2_bf16", "pure_bf16"])
def test_clip_returns_the_true_unscaled_norm(policy):
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    x, y = batch(0)
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    mp.unscale_()
    grads = [p.grad for g in mp.optimizer.param_groups for p in g["params"] if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    before = [g.clone() for g in grads]
    assert mp.clip_grad_norm_(math.inf).item() == pytest.approx(expected.item(), rel=1e-6)  # measured only
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
    norm = mp.clip_grad_norm_(0.01)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    clipped = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    assert clipped.item() == pytest.approx(0.01, rel=1e-2 if policy == "pure_bf16" else 1e-5)


def test_call_order_errors_say_which_call_and_why():
    model = make_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16")
    x, y = batch(0)
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\)"):
        mp.step()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) before backward\(\)"):
        mp.unscale_()
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    mp.unscale_()
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called since the last step\(\)"):
        mp.unscale_()
    with pytest.raises(RuntimeError, match=r"backward\(\) after unscale_\(\)"):
        mp.backward(loss)
    mp.step()
    with pytest.raises(RuntimeError, match=r"step\(\) called twice"):
        mp.step()
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    loss.backward()  # another framework's backward (fabric.backward under Fabric's mixed precision)
    with pytest.raises(RuntimeError, match=r"another backward .* Call mp\.backward\(loss\) .* precision='32-true'"):
        mp.step()
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    mp.step()
    with pytest.raises(RuntimeError, match=r"backward\(\) after step\(\) without a new forward pass"):
        mp.backward(loss)


def test_clip_in_the_middle_of_accumulation_is_refused():
    model = make_model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32", accumulation_steps=2)
    x, y = batch(0)
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match=r"micro-batch 1 of 2.*at_update_boundary"):
        mp.clip_grad_norm_(1.0)


def test_state_dict_round_trips_every_field():
    model = make_model()
    mp = mixprec.MixedPrecision(
        model,
        torch.optim.AdamW(model.parameters()),
        "o2_fp16",
        mixprec.DynamicLossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2),
    )
    for seed in range(5):
        train_step(mp, model, seed, poison=float("inf") if seed in (1, 2) else None)
    state = mp.state_dict()
    assert set(state) == {"policy", "scalers", "masters", "counters", "micro_step", "accumulation_steps", "fp8"}
    assert state["fp8"] == {}  # no FP8 recipe in this policy
    assert state["counters"] == {
        "steps": 5,
        "skipped_steps": 2,
        "inf_steps": 2,
        "nan_steps": 0,
        "underflow_steps": 0,
        "recent_overflow_steps": [1, 2],
        "diagnosis": None,
        "diagnosis_floor": None,
    }
    fresh_model = make_model(seed=7)
    fresh = mixprec.MixedPrecision(
        fresh_model,
        torch.optim.AdamW(fresh_model.parameters()),
        "o2_fp16",
        mixprec.DynamicLossScaler(init_scale=2.0**8, growth_interval=2, hysteresis=2),
    )
    fresh.load_state_dict(copy.deepcopy(state))
    again = fresh.state_dict()
    assert again["scalers"] == state["scalers"] and again["counters"] == state["counters"]
    for a, b in zip(again["masters"], state["masters"], strict=True):
        assert torch.equal(a, b)
    for index in (0, 3):  # the lowered layers: their fp16 copies follow the restored masters
        assert torch.equal(fresh_model[index].weight, model[index].weight)
        assert torch.equal(fresh_model[index].bias, model[index].bias)
    assert dataclasses.replace(fresh.stats(), bytes_per_param=None) == dataclasses.replace(
        mp.stats(), bytes_per_param=None
    )  # the optimizer's own state is the optimizer's to save


def test_state_from_another_policy_is_refused():
    model = make_model()
    state = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16").state_dict()
    other = make_model()
    mp = mixprec.MixedPrecision(other, torch.optim.SGD(other.parameters(), lr=0.1), "mixed_fp16")
    with pytest.raises(ValueError, match=r"saved under policy 'params=float32,compute=bfloat16.*same policy"):
        mp.load_state_dict(state)
    with pytest.raises(ValueError, match=r"expected keys"):
        mp.load_state_dict({"scalers": []})


@pytest.mark.parametrize("wrong", ["a master's shape", "an FP8 layer unknown here"])
def test_a_refused_state_leaves_everything_as_it_was(wrong):
    # the scalers were loaded before the masters were checked: a refused load left the other run's loss scale
    policy = "o2_fp16" if wrong == "a master's shape" else "base=fp8,compute=fp16,fp8=(scaling=delayed)"
    widths = (24, 32) if wrong == "a master's shape" else (24, 24)
    states = []
    for width, scale in zip(widths, (2.0**10, 2.0**5), strict=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.Linear(width, 5))
        mp = mixprec.MixedPrecision(
            model, torch.optim.SGD(model.parameters(), lr=0.1), policy, mixprec.DynamicLossScaler(init_scale=scale)
        )
        train_step(mp, model, 0)
        states.append(mp.state_dict())
    saved, before = states
    if wrong == "an FP8 layer unknown here":
        saved["fp8"]["9"] = saved["fp8"]["2"]  # a layer this model does not have, after the known ones
    with pytest.raises(ValueError):
        mp.load_state_dict(saved)
    after = mp.state_dict()
    assert after["scalers"] == before["scalers"] and after["counters"] == before["counters"]
    assert all(torch.equal(a, b) for a, b in zip(after["masters"], before["masters"], strict=True))
    for name, layer in before["fp8"].items():
        assert torch.equal(after["fp8"][name]["input"]["history"], layer["input"]["history"])


def test_state_resumes_under_another_fp8_cast_or_shapes_with_its_histories():
    model = make_model()
    saved = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=fp8,fp8=(scaling=delayed)")
    train_step(saved, model, 0)
    other = make_model()
    policy = "base=fp8,fp8=(scaling=delayed,cast=compiled,shapes=faster)"
    mp = mixprec.MixedPrecision(other, torch.optim.SGD(other.parameters(), lr=0.1), policy)
    mp.load_state_dict(saved.state_dict())
    assert mp.state_dict()["fp8"].keys() == saved.state_dict()["fp8"].keys()
    for name, layer in saved.state_dict()["fp8"].items():
        assert torch.equal(mp.state_dict()["fp8"][name]["input"]["history"], layer["input"]["history"])
    third = make_model()
    current = mixprec.MixedPrecision(third, torch.optim.SGD(third.parameters(), lr=0.1), "fp8")
    with pytest.raises(ValueError, match=r"saved under policy .*scaling=delayed.*may differ"):
        current.load_state_dict(saved.state_dict())


def test_scheduler_does_not_advance_on_skipped_steps():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0 / (1 + epoch))
    mp = mixprec.MixedPrecision(model, optimizer, "mixed_fp16")
    stepped = []
    for seed in range(4):
        train_step(mp, model, seed, poison=float("nan") if seed == 1 else None)
        stepped.append(mp.step_scheduler(scheduler))
    assert stepped == [True, False, True, True]
    assert scheduler.last_epoch == 3


def test_several_losses_have_their_own_scalers():
    model = make_model()
    scalers = [mixprec.DynamicLossScaler(init_scale=2.0**10), mixprec.DynamicLossScaler(init_scale=2.0**4)]
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", scalers, num_losses=2)
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = batch(0)
    with mp.autocast():
        out = model(x)
        mp.backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
        mp.backward(out.pow(2).mean(), loss_id=1)
    assert mp.step()
    with torch.autocast("cpu", dtype=torch.float16):
        out = reference(x)
        (F.cross_entropy(out.float(), y) + out.float().pow(2).mean()).backward()
    ref_opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    with mp.autocast():
        out = model(x)
        mp.backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
        mp.backward(out.pow(2).mean() * float("inf"), loss_id=1)  # only the second loss overflows
    assert not mp.step()
    assert mp.stats().scales == (2.0**10, 2.0**3)


@pytest.mark.parametrize("num_losses", [1, 2])
def test_step_reads_the_overflow_flags_once_however_many_losses(monkeypatch, num_losses):
    model = make_model()
    scalers = [mixprec.DynamicLossScaler() for _ in range(num_losses)]
    mp = mixprec.MixedPrecision(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", scalers, num_losses=num_losses
    )
    reads = []  # host reads of any tensor but the scales (the CPU snapshot of those is a free memory load)
    for method in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, method)

        def counting(tensor, *args, _original=original, _method=method):
            if all(tensor.data_ptr() != s.scale_tensor.data_ptr() for s in scalers if s.scale_tensor is not None):
                reads.append(_method)
            return _original(tensor, *args)

        monkeypatch.setattr(torch.Tensor, method, counting)
    for overflow in (1.0, float("inf")):
        x, y = batch(0)
        with mp.autocast():
            out = model(x)
            if num_losses == 1:  # step() itself unscales this loss's gradients
                mp.backward(F.cross_entropy(out, y) + out.pow(2).mean() * overflow)
            else:  # the first loss's gradients were unscaled when the second's backward began
                mp.backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
                mp.backward(out.pow(2).mean() * overflow, loss_id=1)
        reads.clear()
        applied = mp.step()
        # one read decides the skip and tells which loss overflowed; an overflowing step's inf-or-NaN
        # statistics are read on the CPU only (elsewhere they wait on the device until stats())
        assert reads == ["tolist"] if overflow == 1.0 else reads.count("tolist") == 1, reads
        assert bool(applied) == (overflow == 1.0)
    stats = mp.stats()  # told apart after that read: NaN (an unclassified overflow would count as inf)
    assert (stats.skipped_steps, stats.inf_steps, stats.nan_steps) == (1, 0, 1)


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_fp16", "pure_bf16"])
def test_one_loss_is_the_num_losses_1_case_of_several(policy):
    """A run of several losses that uses only loss 0 is bit-identical to a one-loss run."""
    runs = []
    for num_losses in (1, 2):
        model = make_model()
        scalers = [mixprec.DynamicLossScaler(init_scale=2.0**10, growth_interval=2) for _ in range(num_losses)]
        mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy, scalers, num_losses=num_losses)
        for seed in range(4):
            train_step(mp, model, seed, poison=float("inf") if seed == 2 else None, clip=1.0 if seed == 1 else None)
        runs.append((snapshot(mp, model), mp.stats()))
    assert_bit_identical(runs[0][0], runs[1][0])
    assert runs[0][1].skipped_steps == runs[1][1].skipped_steps == 1
    assert runs[0][1].scale == runs[1][1].scale


def _scaled_bf16_grads(losses, scale):
    """The bf16 gradients of ``losses(model(x))`` scaled by ``scale``, before any unscaling."""
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, "pure_bf16"), "pure_bf16", mixprec.StaticLossScaler(scale))
    with mp.autocast():
        mp.backward(losses(model(batch(0)[0])))
    return mp, model, [p.grad for p in model.parameters()]


def test_one_loss_is_unscaled_in_place_several_into_fp32_sums():
    y = batch(0)[1]
    mp, model, grads = _scaled_bf16_grads(lambda out: F.cross_entropy(out, y), 8.0)
    scaled = [(g.data_ptr(), g.clone()) for g in grads]
    mp.unscale_()
    for param, (pointer, value) in zip(model.parameters(), scaled, strict=True):  # the same bf16 buffers: no copy
        assert param.grad.dtype == torch.bfloat16 and param.grad.data_ptr() == pointer
        assert torch.equal(param.grad, value / 8)

    _, _, first = _scaled_bf16_grads(lambda out: F.cross_entropy(out, y), 8.0)
    _, _, second = _scaled_bf16_grads(lambda out: out.pow(2).mean(), 2.0**-3)
    model = make_model()
    scalers = [mixprec.StaticLossScaler(8.0), mixprec.StaticLossScaler(2.0**-3)]
    mp = mixprec.MixedPrecision(model, make_optimizer(model, "pure_bf16"), "pure_bf16", scalers, num_losses=2)
    with mp.autocast():
        out = model(batch(0)[0])
        mp.backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
        mp.backward(out.pow(2).mean(), loss_id=1)
    mp.unscale_()
    for param, a, b in zip(model.parameters(), first, second, strict=True):  # each unscaled, summed in FP32
        assert torch.equal(param.grad, (a.float() / 8 + b.float() * 8).bfloat16())


def test_a_fused_optimizer_skips_an_overflow_seen_in_several_micro_batches(monkeypatch):
    """The fused path (an accelerator's, forced here on the CPU, whose fused AdamW also takes found_inf):
    the flag it gets is 0-d and 1.0 however often a loss overflowed, as torch's fused steps require."""
    monkeypatch.setattr(mixprec.MixedPrecision, "_skips_on_device", property(lambda self: True))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scalers = [mixprec.DynamicLossScaler(), mixprec.DynamicLossScaler()]
    mp = mixprec.MixedPrecision(model, optimizer, "mixed_fp16", scalers, num_losses=2, accumulation_steps=2)
    for overflow in (1.0, float("inf")):
        before = snapshot(mp, model)
        for micro in range(2):
            x, y = batch(micro)
            with mp.autocast():
                out = model(x)
                mp.backward(F.cross_entropy(out, y), loss_id=0, retain_graph=True)
                mp.backward(out.pow(2).mean() * overflow, loss_id=1)  # loss 1 overflows in both micro-batches
            result = mp.step()
        assert bool(result) == (overflow == 1.0)
    assert_bit_identical(before, snapshot(mp, model))  # the skipped step: weights and AdamW state, step count too
    stats = mp.stats()
    assert (stats.steps, stats.skipped_steps, stats.inf_steps, stats.nan_steps) == (2, 1, 0, 1)
    assert stats.scales == (2.0**16, 2.0**15)


def test_scaler_list_must_match_num_losses():
    model = make_model()
    scaler = mixprec.DynamicLossScaler()
    with pytest.raises(ValueError, match="one LossScaler per loss"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", scaler, num_losses=2)
    with pytest.raises(ValueError, match="repeats one"):
        mixprec.MixedPrecision(
            model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", [scaler, scaler], num_losses=2
        )


class NaNForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 5)

    def forward(self, x):
        return self.lin(x) * torch.tensor(float("nan"))


def test_overflow_at_the_floor_is_diagnosed_once_and_weights_stay_safe(caplog):
    torch.manual_seed(0)
    model = NaNForward()
    weights = [p.detach().clone() for p in model.parameters()]
    mp = mixprec.MixedPrecision(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", mixprec.DynamicLossScaler(min_scale=2.0**10)
    )
    with caplog.at_level(logging.INFO, logger="mixprec"):
        for seed in range(30):
            train_step(mp, model, seed)
    stats = mp.stats()
    assert stats.skipped_steps == 30 and stats.nan_steps == 30 and stats.scale == 2.0**10
    assert "does not come from loss scaling" in stats.diagnosis and "mixprec doctor" in stats.diagnosis
    assert "bf16" in stats.diagnosis
    assert sum("does not come from loss scaling" in r.message for r in caplog.records) == 1
    overflow_lines = [r.message for r in caplog.records if r.message.startswith("Gradient overflow")]
    assert (
        overflow_lines[0]
        == "Gradient overflow (NaN) at step 0. Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    )
    assert len(overflow_lines) == 10  # rate-limited after the first ten
    for before, after in zip(weights, model.parameters(), strict=True):
        assert torch.equal(before, after)


def test_overflow_in_bf16_is_diagnosed_at_once():
    model = NaNForward()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    train_step(mp, model, 0)
    diagnosis = mp.stats().diagnosis
    assert "fixed loss scale 1.0" in diagnosis and "does not come from loss scaling" in diagnosis
    assert "fp16" not in diagnosis  # nothing was scaled, and the policy is already bf16: no fp16 advice
    assert "(1 of 1 skipped steps so far had NaN, 0 had inf)" in diagnosis
    train_step(mp, model, 1)
    assert "(2 of 2 skipped steps so far had NaN, 0 had inf)" in mp.stats().diagnosis  # the counts of now
    resumed = NaNForward()
    again = mixprec.MixedPrecision(resumed, torch.optim.SGD(resumed.parameters(), lr=0.1), "mixed_bf16")
    again.load_state_dict(mp.state_dict())
    assert again.stats().diagnosis == mp.stats().diagnosis
    train_step(again, resumed, 2)
    assert "(3 of 3 skipped steps so far had NaN" in again.stats().diagnosis


@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_a_model_cast_after_setup_is_refused_before_the_update(policy):
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    train_step(mp, model, 0)
    model.half()  # e.g. another framework's precision setting, after mixprec prepared the model
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is now torch\.float16, but the policy set it to"):
        train_step(mp, model, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("policy", ["fp32", "mixed_bf16", "o2_bf16", "pure_bf16"])
def test_parameters_replaced_after_setup_are_refused_before_anything_trains(policy):
    # load_state_dict(assign=True) puts new tensors in the model: the optimizer (and o2's FP32 masters) would
    # go on updating the old ones, and the model the forward runs would never change
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    train_step(mp, model, 0)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"parameter '0\.weight' is no longer the tensor it was: .* assign=True"):
        train_step(mp, model, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_a_model_moved_to_another_device_after_setup_is_refused(policy):
    # what Accelerate's prepare and Fabric's setup do to a model left on the CPU: the region would autocast
    # for the CPU around CUDA ops (FP32 compute), and o2's FP32 masters would stay on the CPU
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    model.cuda()
    with pytest.raises(ValueError, match=r"'0\.weight' is now on cuda:0, not cpu: .*model\.to\(accelerator\.device\)"):
        train_step(mp, model, 0)


@pytest.mark.parametrize(
    ("policy", "total"), [("fp32", 16), ("mixed_bf16", 16), ("o2_bf16", 16), ("o2_fp16", 16), ("pure_bf16", 12)]
)
def test_bytes_per_parameter_with_adamw(policy, total):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))  # no norms: every parameter lowered
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    train_step_model = nn.Sequential(model, nn.Linear(64, 5).to(model[0].weight.dtype))
    del train_step_model
    x = torch.randn(4, 64)
    with mp.autocast():
        mp.backward(model(x).float().pow(2).mean())
    mp.step()
    assert mp.stats().bytes_per_param.total == pytest.approx(total, abs=0.01)


def test_bad_constructor_arguments():
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"needs an nn\.Module; received dict"):
        mixprec.MixedPrecision({}, sgd)
    with pytest.raises(TypeError, match=r"needs a torch\.optim\.Optimizer; received list"):
        mixprec.MixedPrecision(model, [])
    with pytest.raises(ValueError, match=r"accumulation_steps=...\) must be an integer >= 1; received 0"):
        mixprec.MixedPrecision(model, sgd, "fp32", accumulation_steps=0)
    with pytest.raises(ValueError, match="unknown policy"):
        mixprec.MixedPrecision(model, sgd, "mixed_fp12")
    mp = mixprec.MixedPrecision(model, sgd, "fp32")
    with pytest.raises(ValueError, match=r"one-element loss tensor; received \(16, 5\)"):
        mp.backward(model(batch(0)[0]))
    with pytest.raises(ValueError, match=r"loss_id=...\) must be in 0..0; received 1"):
        mp.backward(model(batch(0)[0]).sum(), loss_id=1)


FIX = r"Build the model in FP32 \(model\.float\(\).*let the policy cast it; .*use mixprec\.autocast / cast_module"


@pytest.mark.parametrize("policy", ["o2_bf16", "o2_fp16", "mixed_bf16", "mixed_fp16", "fp32", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_is_refused_with_the_fix(policy, dtype):
    model = make_model().to(dtype)
    optimizer = torch.optim.AdamW(model.parameters())
    groups = [list(g["params"]) for g in optimizer.param_groups]
    with pytest.raises(ValueError, match=r"MixedPrecision\(model=\.\.\.\) needs a model with FP32 parameters") as e:
        mixprec.MixedPrecision(model, optimizer, policy)
    assert f"received one where 6 parameters are {dtype}, e.g. '0.weight'." in str(e.value)
    assert "master weights must start from the exact values" in str(e.value)
    assert e.match(FIX)
    assert all(p.dtype == dtype for p in model.parameters())  # refused before anything was changed
    assert [list(g["params"]) for g in optimizer.param_groups] == groups


def test_the_refusal_lists_every_wrong_dtype():
    model = make_model()
    model[0].half()
    model[3].bias.data = model[3].bias.data.double()
    wrong = r"2 parameters are torch\.float16, e\.g\. '0\.weight'; 1 parameter is torch\.float64, e\.g\. '3\.bias'"
    with pytest.raises(ValueError, match=wrong):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16")


def test_a_model_already_cast_for_its_policy_is_refused_where_masters_would_be_rounded():
    model = mixprec.cast_module(make_model(), mixprec.get_policy("o2_bf16"))  # the norm stays FP32
    with pytest.raises(ValueError, match=r"4 parameters are torch.bfloat16, e.g. '0.weight'\. Build the model"):
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "o2_bf16")
    # cast_module leaves mixed policies' FP32 weights alone: nothing to refuse
    model = mixprec.cast_module(make_model(), mixprec.get_policy("mixed_bf16"))
    mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "mixed_bf16")


def test_a_16_bit_weight_without_an_fp32_master_is_accepted_as_it_is_the_cast():
    """pure_bf16 keeps no master, and o2 makes none of an untrained weight: such a weight already in the
    policy's dtype holds the bits the cast would give, so the run equals one built in FP32 from those values
    (an FP32 model's rounding residuals go to the compensation: tests/unit/test_compensated_adamw.py)."""
    built_fp32, built_bf16 = make_model().to(torch.bfloat16).float(), make_model().to(torch.bfloat16)
    runs = []
    for model in (built_fp32, built_bf16):
        mp = mixprec.MixedPrecision(model, make_optimizer(model, "pure_bf16"), "pure_bf16")
        for seed in range(3):
            assert train_step(mp, model, seed)
        runs.append(snapshot(mp, model))
    assert_bit_identical(*runs)
    with pytest.raises(ValueError, match=r"6 parameters are torch\.float16"):  # fp16 is not pure_bf16's dtype
        model = make_model().half()
        mixprec.MixedPrecision(model, make_optimizer(model, "pure_bf16"), "pure_bf16")

    model = make_model()
    model[0].to(torch.bfloat16).requires_grad_(False)  # a frozen, 16-bit first layer under o2
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model[3].parameters(), lr=1e-2), "o2_bf16")
    assert len(mp.masters) == 2 and train_step(mp, model, 0)


@pytest.mark.parametrize("policy", [*PRESETS, "tf32", "fp8", "fp8_hybrid"])
def test_fp32_models_are_accepted_under_every_policy(policy):
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    assert train_step(mp, model, 0)


class _RecordPrecision(torch.autograd.Function):
    """Identity that records torch's float32 matmul precision in its forward and in its backward."""

    seen: typing.ClassVar[list[str]] = []

    @staticmethod
    def forward(ctx, x):
        _RecordPrecision.seen.append(torch.get_float32_matmul_precision())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _RecordPrecision.seen.append(torch.get_float32_matmul_precision())
        return grad


def test_tf32_covers_the_backward_matmuls_too(device):
    if not mixprec.device_caps(device).tf32:
        pytest.skip(f"{device} has no TF32 units: the tf32 policy leaves FP32 matmuls alone there")
    model = torch.nn.Linear(4, 4).to(device)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "tf32")
    before = torch.get_float32_matmul_precision()
    _RecordPrecision.seen.clear()
    with mp.autocast():
        loss = _RecordPrecision.apply(model(torch.randn(2, 4, device=device))).sum()
    mp.backward(loss)
    assert _RecordPrecision.seen == ["high", "high"]  # TF32 allowed in the backward, as in the forward
    assert torch.get_float32_matmul_precision() == before  # and restored after
    mp.step()


def test_a_loss_without_gradients_gets_a_mixprec_message():
    model = make_model()
    for p in model.parameters():
        p.requires_grad_(False)  # nothing trainable reaches the loss
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    x, y = batch(0)
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match=r"backward\(loss=...\): the loss does not require gradients.*no trainable"):
        mp.backward(loss)


@pytest.mark.parametrize("policy", ["o2_bf16", "mixed_bf16", "fp32"])
def test_an_optimizer_of_another_models_parameters_is_refused(policy):
    # it would step the other model's tensors: every update "applied", the model never changed
    model, other = make_model(), make_model()
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"MixedPrecision\(optimizer=\.\.\.\): the SGD holds none of the model's"):
        mixprec.MixedPrecision(model, optimizer, policy)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything was changed
    # an optimizer holding the model's parameters and one more of its own (a learnable loss temperature) is fine
    temperature = nn.Parameter(torch.ones(()))
    mixprec.MixedPrecision(model, torch.optim.SGD([*model.parameters(), temperature], lr=0.1), policy)


@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_a_gradient_norm_past_fp32s_range_skips_the_update(policy):
    # finite gradients (no loss scale) whose squares overflow FP32: clipping would zero them, and AdamW would
    # still move the weights by its momentum; the update is skipped instead
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    for seed in range(2):
        assert train_step(mp, model, seed, clip=1.0)[0]  # momentum to move with
    before = snapshot(mp, model)
    x, y = batch(5)
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y) * 1e30)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.isfinite(mp.clip_grad_norm_(1.0))
    assert not mp.step()
    assert_bit_identical(before, snapshot(mp, model))
    # measuring the norm alone (max_norm=inf, as the HF Trainer logs grad_norm) changes nothing: applied
    with mp.autocast():
        mp.backward(F.cross_entropy(model(x), y) * 1e30)
    assert not torch.isfinite(mp.clip_grad_norm_(math.inf))
    assert mp.step()


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", "mixed_fp16", "o2_bf16"])
def test_with_nothing_to_divide_clipping_reads_the_gradients_once(policy):
    # no loss scale, one loss, no FP32 masters: the norm's own pass is the finite check (the AMP kernel does not
    # run); a scale to divide (fp16) or masters to fill (o2) still unscale and check first
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.checks = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.checks += func.overloadpacket.__name__ == "_amp_foreach_non_finite_check_and_unscale_"
            return func(*args, **(kwargs or {}))

    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, policy), policy)
    x, y = batch(0)
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)
    with Count() as count:  # the step after the clip unscales nothing (its AdamW runs eagerly under a mode)
        mp.clip_grad_norm_(1.0)
        assert mp.step()
    assert count.checks == (0 if policy in ("mixed_bf16", "pure_bf16") else 1)
    for poison in (float("inf"), float("nan")):  # and such a step is still skipped, its kind told
        before = snapshot(mp, model)
        assert not train_step(mp, model, 3, poison=poison, clip=1.0)[0]
        assert_bit_identical(before, snapshot(mp, model))
    assert (mp.stats().inf_steps, mp.stats().nan_steps) == (1, 1)


def test_a_state_saved_mid_window_says_its_gradients_are_missing_and_the_window_restarts():
    model = make_model()
    mp = mixprec.MixedPrecision(model, make_optimizer(model, "mixed_fp16"), "mixed_fp16", accumulation_steps=4)
    for seed in range(2):
        train_step(mp, model, seed)
    with pytest.warns(UserWarning, match=r"2 of 4 micro-batches done\): their gradients are not saved"):
        state = mp.state_dict()
    resumed_model = make_model()
    resumed = mixprec.MixedPrecision(
        resumed_model, make_optimizer(resumed_model, "mixed_fp16"), "mixed_fp16", accumulation_steps=4
    )
    with pytest.warns(UserWarning, match=r"after 2 of 4 micro-batches .* the window starts again here"):
        resumed.load_state_dict(state)
    updates = [train_step(resumed, resumed_model, seed)[0].update_step for seed in range(4)]
    assert updates == [False, False, False, True]  # a whole window, not the 2 micro-batches left of the saved one


def test_arguments_that_would_be_misread_are_refused():
    model = make_model()
    with pytest.raises(TypeError, match=r"accumulate_in_fp32=...\) needs True or False; received 'yes'"):
        mixprec.MixedPrecision(model, make_optimizer(model, "o2_bf16"), "o2_bf16", accumulate_in_fp32="yes")
    mp = mixprec.MixedPrecision(model, make_optimizer(model, "mixed_bf16"), "mixed_bf16")
    train_step(mp, model, 0)
    with pytest.raises(TypeError, match=r"step_scheduler\(scheduler=...\) needs an LR scheduler; received AdamW"):
        mp.step_scheduler(mp.optimizer)  # would step the optimizer a second time
