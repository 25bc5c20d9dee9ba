"""Gradients changed before the unscale, while they still carry the loss scale or are o2's 16-bit copies
(torch's or Accelerate's clip_grad_norm_ between mp.backward() and mp.step()), are refused before anything is
applied; unscaled gradients are the caller's."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def _setup(policy: str, device: str, layer_norm: bool = False, **options):
    torch.manual_seed(0)
    # a LayerNorm is kept in FP32 under o2: its own optimizer parameters, their gradients on the model throughout
    norm = [nn.LayerNorm(24)] if layer_norm else []
    model = nn.Sequential(nn.Linear(12, 24), *norm, nn.GELU(), nn.Linear(24, 5)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, mixprec.MixedPrecision(model, optimizer, policy, **options)


def _backward(mp, model, device: str, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 12, generator=g).to(device), torch.randint(0, 5, (16,), generator=g).to(device)
    with mp.autocast():
        loss = F.cross_entropy(model(x), y)
    mp.backward(loss)


def _skip_without_fp16(policy: str, device: str) -> None:
    if "fp16" in policy and not mixprec.device_caps(device).supports_fp16:
        pytest.skip(f"{device} computes no fp16")


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_fp16"])
def test_torchs_clip_of_scaled_gradients_is_refused_and_nothing_is_applied(policy, device):
    _skip_without_fp16(policy, device)
    model, mp = _setup(policy, device)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(mp, model, device)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the scaled gradients: 2^16 times too large
    with pytest.raises(RuntimeError, match=r"gradient of '0.weight' was changed after mp.backward\(\) while still "):
        mp.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_gradient_replaced_or_edited_between_micro_batches_is_refused(device):
    model, mp = _setup("mixed_fp16", device, accumulation_steps=2)
    _skip_without_fp16("mixed_fp16", device)
    _backward(mp, model, device)
    mp.step()  # the window's first micro-batch: counted only
    model[2].bias.grad = model[2].bias.grad * 0.5
    with pytest.raises(RuntimeError, match=r"gradient of '2.bias' was changed"):
        _backward(mp, model, device, seed=1)


def _clipped_weights(policy: str, device: str, clip: str) -> list[torch.Tensor]:
    model, mp = _setup(policy, device)
    for seed in range(3):
        _backward(mp, model, device, seed)
        if clip == "mixprec":
            mp.clip_grad_norm_(0.05)
        else:  # torch's own, on the gradients the optimizer uses
            if clip == "torch after unscale_":
                mp.unscale_()
            torch.nn.utils.clip_grad_norm_([p for g in mp.optimizer.param_groups for p in g["params"]], 0.05)
        assert mp.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("policy", "clip"),
    [
        ("mixed_fp16", "torch after unscale_"),
        ("o2_fp16", "torch after unscale_"),  # the masters' gradients
        ("mixed_bf16", "torch"),  # no loss scale: the gradients are unscaled from the start
        ("o2_bf16", "torch after unscale_"),  # unscale_() moves them to the masters
    ],
)
def test_unscaled_gradients_are_the_callers_to_clip(policy, clip, device):
    _skip_without_fp16(policy, device)
    expected = _clipped_weights(policy, device, "mixprec")
    for a, b in zip(expected, _clipped_weights(policy, device, clip), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=1e-6)


def test_a_refusal_drops_the_window_so_a_retry_applies_nothing(device):
    _skip_without_fp16("mixed_fp16", device)
    model, mp = _setup("mixed_fp16", device)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(mp, model, device)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"Nothing was applied, and this window's gradients were dropped"):
        mp.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\)"):
        mp.step()  # the clipped scaled gradients are gone: nothing to apply
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    _backward(mp, model, device, seed=1)  # the next window trains as usual
    assert mp.step()


def test_a_clip_of_o2s_16_bit_gradients_before_the_unscale_is_refused(device):
    # no loss scale, but the update takes the masters' FP32 gradients: torch's clip here measures in bf16
    model, mp = _setup("o2_bf16", device)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(mp, model, device)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert norm.dtype == torch.bfloat16  # what the clip would have used
    with pytest.raises(RuntimeError, match=r"before the unscale, on the 16-bit model: .* measures the norm in 16 bits"):
        mp.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def _o2_masters_clipped(device: str, clip: str, layer_norm: bool = False) -> list[torch.Tensor]:
    model, mp = _setup("o2_bf16", device, layer_norm)
    for seed in range(3):
        _backward(mp, model, device, seed)
        if clip == "engine":
            mp.clip_grad_norm_(0.05)
        else:  # the fix the refusal names: unscale_(), then edit the model's gradients (inside the block)
            mp.unscale_()
            with mp.gradients_on_model() if clip == "in block" else contextlib.nullcontext():
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        assert mp.step()
    return list(mp.fp32_state_dict().values())


@pytest.mark.parametrize("clip", ["in block", "after unscale_"])
@pytest.mark.parametrize("layer_norm", [False, True])
def test_o2s_gradients_are_the_callers_on_the_model_after_the_unscale(device, clip, layer_norm):
    # the clip on the model runs on bf16 roundings of the FP32 gradients: its updates are within bf16's rounding
    # of mixprec's FP32 clip (measured 1e-5 apart at most; unclipped they would be 1.8e-2 apart). Right after
    # unscale_(), as a GradScaler loop clips, the gradients were on the masters alone: the clip found none (no
    # update clipped) or only the FP32-kept LayerNorm's (its norm alone, and only it clipped)
    expected = _o2_masters_clipped(device, "engine", layer_norm)
    for a, b in zip(expected, _o2_masters_clipped(device, clip, layer_norm), strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


def test_o2s_gradients_shown_by_unscale_last_until_the_step_or_a_dropped_window(device):
    model, mp = _setup("o2_bf16", device)
    _backward(mp, model, device)
    mp.unscale_(on_model=False)  # the optimizer's FP32 masters alone: no 16-bit copy on the model
    assert all(p.grad is None for p in model.parameters())
    mp.step()
    _backward(mp, model, device, seed=1)
    mp.unscale_()
    masters = [p for group in mp.optimizer.param_groups for p in group["params"]]
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    with mp.gradients_on_model():  # already shown: an edit inside reaches the master at the block's end
        model[0].bias.grad.zero_()
    assert model[0].bias.grad is not None and not masters[1].grad.any()  # still shown after the block
    model[2].bias.grad.fill_(1.0)  # after the block too, until the step
    mp.zero_grad()  # the window dropped: nothing left on the model
    assert all(p.grad is None for p in model.parameters()) and all(m.grad is None for m in masters)
    with pytest.raises(TypeError, match=r"unscale_\(on_model=\.\.\.\) \(or None\) needs True or False"):
        mp.unscale_(on_model="no")


def _grads_the_optimizer_takes(mp) -> list[torch.Tensor]:
    taken = []
    mp.optimizer.register_step_pre_hook(
        lambda opt, *_: taken.extend(p.grad.clone() for p in opt.param_groups[0]["params"])
    )
    return taken


@pytest.mark.parametrize("policy", ["o2_bf16", "o2_fp16"])
def test_a_clip_that_does_not_clip_changes_no_master_gradient(policy, device):
    # torch's clip multiplies by 1.0 and moves every version counter: the values it left as shown keep the masters'
    # FP32 values (they were replaced by their 16-bit roundings: fp16 flushed 40% of small gradients to 0)
    _skip_without_fp16(policy, device)
    expected, got = [], []
    for clip, taken in (("engine", expected), ("torch", got)):
        model, mp = _setup(policy, device)
        taken_now = _grads_the_optimizer_takes(mp)
        _backward(mp, model, device)
        if clip == "torch":
            mp.unscale_(on_model=True)  # fp16 too: shown when asked
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        mp.step()
        taken.extend(taken_now)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_o2_fp16_shows_no_gradient_on_the_model_unless_asked(device):
    _skip_without_fp16("o2_fp16", device)
    model, mp = _setup("o2_fp16", device)
    _backward(mp, model, device)
    mp.unscale_()  # fp16 would flush unscaled gradients below 6e-8 and take a norm past 65504 for inf
    assert all(p.grad is None for p in model.parameters())


def test_an_edit_on_the_model_that_makes_a_gradient_nan_skips_the_update(device):
    model, mp = _setup("o2_bf16", device)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(mp, model, device)
    mp.unscale_()
    model[0].weight.grad[0, 0] = float("nan")
    result = mp.step()
    assert result.update_step and not result.applied and mp.stats().skipped_steps == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_the_engines_clip_after_unscale_shows_the_clipped_gradients(device):
    expected, got = [], []
    for order, taken in (("clip", expected), ("unscale_ then clip", got)):
        model, mp = _setup("o2_bf16", device)
        taken_now = _grads_the_optimizer_takes(mp)
        _backward(mp, model, device)
        if order != "clip":
            mp.unscale_()
        mp.clip_grad_norm_(0.01)
        with mp.gradients_on_model():  # a logger or a clamp of the user's: sees (and keeps) the clipped ones
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        mp.step()
        taken.extend(taken_now)
        assert norm.item() == pytest.approx(0.01, rel=1e-2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_an_edit_on_the_model_after_the_optimizers_gradients_were_zeroed_is_the_gradient(device):
    model, mp = _setup("o2_bf16", device)
    _backward(mp, model, device)
    mp.unscale_()
    mp.optimizer.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    taken = _grads_the_optimizer_takes(mp)
    assert mp.step()
    assert all(torch.equal(g, torch.full_like(g, 0.5)) for g in taken)


def test_o2_fp16_a_clip_that_reaches_only_the_fp32_kept_layers_is_refused(device):
    # fp16 shows no gradient on the model: torch's clip over model.parameters() finds the LayerNorm's alone
    _skip_without_fp16("o2_fp16", device)
    model, mp = _setup("o2_fp16", device, layer_norm=True)
    before = [p.detach().clone() for p in model.parameters()]
    _backward(mp, model, device)
    mp.unscale_()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match=r"finds only the former, measures their norm alone and clips them alone"):
        mp.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    _backward(mp, model, device, seed=1)  # the optimizer's gradients, masters included: the clip the docs name
    mp.unscale_()
    params = [p for group in mp.optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, 1e-3)
    assert mp.step()
