"""The doctor names where values overflow or turn non-finite, and advises a scale and a policy."""

import json

import pytest
import torch
from torch import nn

import mixprec
from mixprec.app.histograms import plot_histograms
from mixprec.doctor import Histogram, NonFiniteTracer, RangeWatch, diagnose, recommend_scale


def _overflowing_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32),
        nn.ReLU(),
        nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Sequential(nn.Linear(32, 32), nn.ReLU())),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )
    with torch.no_grad():
        model[2][2][0].weight.fill_(3e4)  # tanh outputs up to 1, summed over 32 inputs: up to ~1e6
        model[2][2][0].bias.zero_()
    return model


def _batches(n=3, features=16, classes=4):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, features, generator=generator), torch.randint(0, classes, (32,), generator=generator))
        for _ in range(n)
    ]


def test_the_doctor_names_the_module_where_fp16_overflow_starts():
    diagnosis = diagnose(_overflowing_model(), _batches(), nn.functional.cross_entropy, steps=3)
    fp16 = diagnosis.formats["fp16"]
    # per call: in the third batch 2.2.0's output fits fp16 (57738) and 3's overflows from it (101620); in the
    # first, 3's input (62003, 2.2.0's overflow cut by the ReLU) fits and its output overflows again
    assert fp16.overflow_starts_in == ("2.2.0", "3")
    assert "2.2.0" in fp16.activations_overflow and "2.1" not in fp16.activations_overflow
    stats = diagnosis.report.get("2.2.0", "forward")
    assert stats.formats["fp16"].overflow > 0 and stats.input_amax < 65504
    assert stats.formats["bf16"].overflow == 0
    assert diagnosis.policy == "mixed_bf16"
    assert any("2.2.0" in reason for reason in diagnosis.reasons)
    # the fp16 alternative keeps in FP32 every module the overflow reaches, down to the first one whose input
    # overflows (5): with the origin alone in FP32, its output went on into fp16 as before
    assert fp16.overflow_reaches == ("2", "3", "4", "5")
    assert diagnosis.reasons[-2].endswith("in FP32: base=mixed_fp16,names=2+3+4+5")
    # or those modules in bf16, fp16 elsewhere: the advice runs without an inf
    advised = diagnosis.reasons[-1].rpartition(": ")[2]
    assert advised == "base=mixed_fp16,bf16_names=2+3+4+5"
    model = _overflowing_model()
    for policy, finite in (("mixed_fp16", False), (advised, True)):
        with mixprec.autocast(policy, model):
            outputs = [model(x) for x, _ in _batches()]
        assert all(torch.isfinite(out).all() for out in outputs) == finite, policy


def test_a_healthy_model_gets_mixed_fp16_and_a_power_of_two_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    diagnosis = diagnose(model, _batches(), nn.functional.cross_entropy, steps=3, keep=0.99999)
    assert diagnosis.policy == "mixed_fp16"
    fp16 = diagnosis.formats["fp16"]
    scale = diagnosis.loss_scale
    assert scale == fp16.recommended_scale and scale >= 1 and (scale.bit_length() if isinstance(scale, int) else True)
    assert fp16.gradient_amax * scale < 65520
    assert fp16.kept_with_scale >= 0.99999 or not fp16.reaches_keep
    json.loads(diagnosis.to_json())  # plain data


def test_a_model_that_makes_nan_in_fp32_gets_no_16_bit_advice():
    # a LayerNorm over ~1e37 activations: NaN in FP32 already; bf16 "needs no loss scale" would skip every step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e37)
    diagnosis = diagnose(model, _batches(), nn.functional.cross_entropy, steps=2)
    assert diagnosis.fp32_nonfinite[0] == "2" and diagnosis.fp32_nonfinite[-1] == "loss"
    assert (diagnosis.policy, diagnosis.loss_scale) == ("fp32", None)
    (reason,) = diagnosis.reasons
    assert "inf or NaN already in FP32, in every one of 2 recorded step(s), starting in 2" in reason
    assert json.loads(diagnosis.to_json())["fp32_nonfinite"] == list(diagnosis.fp32_nonfinite)


class _SqrtAtZero(nn.Module):
    def forward(self, x):
        return torch.sqrt(x * 0)  # finite forward, an infinite derivative: inf * 0 = NaN gradients


def test_a_model_whose_fp32_gradients_are_nan_at_every_step_gets_no_16_bit_advice():
    # a finite loss, NaN weight gradients at every step: the doctor recommended mixed_fp16 ("keeps 100% of them")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), _SqrtAtZero(), nn.Linear(8, 4))
    diagnosis = diagnose(model, _batches(), nn.functional.cross_entropy, steps=2)
    assert (diagnosis.policy, diagnosis.loss_scale) == ("fp32", None)
    assert diagnosis.fp32_nonfinite == ("0", "gradients")  # the first gradient non-finite on arrival: 0's output
    (reason,) = diagnosis.reasons
    assert "gradients are inf or NaN already in FP32 (2 of 2 recorded step(s) with a finite loss" in reason
    assert "the gradient of 0's output (made where that output is used)" in reason


def test_one_batch_with_nan_gradients_is_said_beside_the_advice():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    batches = _batches(n=3)
    model.register_full_backward_pre_hook(  # the second batch's gradient of the output: NaN
        lambda module, grad: (grad[0] * float("nan"),) if len(calls) == 2 else None
    )
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    diagnosis = diagnose(model, batches, nn.functional.cross_entropy, steps=3)
    assert diagnosis.policy != "fp32"
    assert any("1 of 3 recorded steps had a finite loss but inf or NaN gradients" in r for r in diagnosis.reasons)


def test_diagnose_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.5), nn.Linear(8, 4)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g
    diagnose(model, _batches(), nn.functional.cross_entropy, steps=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert not model.training
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_recommend_scale_on_a_known_histogram():
    # 1000 values at 2**-30 and 1000 at 2**-20: fp16's smallest subnormal is 2**-24
    counts = [0] * 40
    counts[0], counts[10] = 1000, 1000
    histogram = Histogram(-30, tuple(counts))
    k, kept, reached = recommend_scale(histogram, amax=2.0**-19, fmt="fp16", keep=0.999)
    assert (k, kept, reached) == (6, 1.0, True)  # 2**-30 * 2**6 = 2**-24
    k, kept, reached = recommend_scale(histogram, amax=2.0**10, fmt="fp16", keep=0.999)
    assert reached is False and k == 5 and kept == 0.5  # 2**10 * 2**5 = 32768 fits, 2**6 would overflow


def test_first_nan_in_forward_is_named_with_its_module(device):
    class InjectNaN(nn.Module):
        def forward(self, x):
            return x.masked_fill(torch.arange(x.shape[-1], device=x.device) == 1, float("nan"))

    model = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), InjectNaN(), nn.Linear(4, 4)), nn.Linear(4, 1)
    ).to(device)
    with NonFiniteTracer(model) as tracer:
        model(torch.randn(3, 4, device=device)).sum().backward()
        assert tracer.check() is not None
        model(torch.randn(3, 4, device=device)).sum().backward()
        second = tracer.check()
    assert tracer.first.module == "1.1" and tracer.first.phase == "forward" and tracer.first.kind == "nan"
    assert tracer.first.step == 0 and second.step == 1
    assert not model[1][1]._forward_hooks  # removed on exit


def test_first_inf_in_backward_is_named_with_the_module_that_produced_it(device):
    class OverflowingBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * 1e38 * 1e38  # overflows FP32 to inf

    class Amplify(nn.Module):
        def forward(self, x):
            return OverflowingBackward.apply(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), Amplify()), nn.Linear(4, 1)).to(device)
    tracer = NonFiniteTracer(model).attach()
    model(torch.randn(3, 4, device=device)).sum().backward()
    event = tracer.check()
    tracer.detach()
    assert (event.module, event.phase, event.tensor, event.kind) == ("1.1", "backward", "input gradient", "inf")


def test_a_nan_made_by_a_modules_own_code_in_backward_names_that_module_not_its_child():
    # block's own sqrt at 0, between its two children: the NaN arrived at block.a's output gradient and was charged
    # to block.a, which only passed it on
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torch.sqrt(torch.relu(self.a(x)) * 0))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block())
    with NonFiniteTracer(model) as tracer:
        model(torch.randn(3, 4)).sum().backward()
        event = tracer.check()
    assert (event.module, event.phase, event.tensor) == ("1", "backward", "gradient of its own code")
    # the same sqrt as a module of its own is named as the module (its input gradient), as before
    model = nn.Sequential(nn.Linear(4, 4), _SqrtAtZero(), nn.Linear(4, 1))
    with NonFiniteTracer(model) as tracer:
        model(torch.randn(3, 4)).sum().backward()
        event = tracer.check()
    assert (event.module, event.tensor) == ("1", "input gradient")


def test_the_tracer_holds_no_output_of_a_submodule_called_on_its_own():
    # outputs were kept for the model's forward end, which a submodule called alone never reaches: held for ever
    import weakref

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with NonFiniteTracer(model) as tracer:
        out = model[0](torch.randn(3, 4))
        kept = weakref.ref(out)
        del out
        assert kept() is None
        model(torch.randn(3, 4)).sum().backward()  # the whole model as before
        assert tracer.check() is None


def test_a_module_called_twice_starts_an_overflow_where_one_of_its_calls_does():
    # overflow_origins compared the largest input over all calls: a third call's overflowing input hid the second
    class Amplify(nn.Module):
        def forward(self, x):
            return x * 300

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.amp, self.out = nn.Linear(4, 4), Amplify(), nn.Linear(4, 1)

        def forward(self, x):
            return self.out(self.amp(self.amp(self.amp(self.inp(x)))))  # ~1 -> 300 -> 9e4 (fp16 inf) -> 2.7e7

    torch.manual_seed(0)
    model = Net()
    with RangeWatch(model, formats=("fp16", "bf16")) as watch:
        model(torch.randn(8, 4) * 3).sum().backward()
    report = watch.report()
    assert report.overflow_origins("fp16") == ["amp"] and report.get("amp", "forward").origin_calls["fp16"] == 1
    assert report.overflow_origins("bf16") == []


def test_a_clean_step_reports_nothing_and_inputs_are_checked():
    model = nn.Linear(4, 2)
    with NonFiniteTracer(model) as tracer:
        model(torch.randn(2, 4)).sum().backward()
        assert tracer.check() is None
        model(torch.tensor([[float("inf"), 0.0, 0.0, 0.0]]))
        event = tracer.check()
    assert (event.module, event.kind) == ("input", "inf")


def test_range_watch_phases_and_json(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with RangeWatch(model, formats=("fp16", "fp8_e4m3")) as watch:
        for x, y in _batches(2, features=8, classes=2):
            nn.functional.cross_entropy(model(x), y).backward()
            watch.step()
    report = watch.report()
    assert report.steps == 2
    assert {s.phase for s in report.stats} == {"forward", "backward", "weight_grad"}
    assert report.get("2", "forward").values == 2 * 32 * 2
    assert report.get("0", "weight_grad").values == 2 * (8 * 8 + 8)
    assert report.get("0", "forward").order < report.get("2", "forward").order
    assert report.get("2", "backward").order < report.get("0", "backward").order  # backward runs in reverse
    assert json.loads(report.to_json())["steps"] == 2
    png = plot_histograms(report, tmp_path / "hist.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps=...\\): received 0"),
        ({"keep": 1.5}, "keep=...\\): received 1.5"),
        ({"formats": ("fp12",)}, "fp12"),
    ],
)
def test_diagnose_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        diagnose(nn.Linear(2, 2), [(torch.randn(1, 2), torch.tensor([0]))], nn.functional.cross_entropy, **kwargs)


def test_diagnose_names_a_wrong_model_or_loss():
    batches = [(torch.randn(4, 2), torch.tensor([0, 1, 0, 1]))]
    loss = nn.functional.cross_entropy
    with pytest.raises(TypeError, match=r"diagnose\(model=...\) needs an nn.Module; received SGD"):
        diagnose(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), batches, loss)
    with pytest.raises(ValueError, match=r"records an FP32 model.* parameter 'weight' is torch.bfloat16"):
        diagnose(nn.Linear(2, 2).bfloat16(), batches, loss)
    with pytest.raises(TypeError, match=r"diagnose\(loss_fn=...\) needs a callable .* received NoneType"):
        diagnose(nn.Linear(2, 2), batches, None)
    per_sample = lambda output, targets: nn.functional.cross_entropy(output, targets, reduction="none")  # noqa: E731
    with pytest.raises(ValueError, match=r"must return a one-element loss tensor; it returned \(4,\)"):
        diagnose(nn.Linear(2, 2), batches, per_sample)


def test_watch_rejects_unknown_modules_and_phases():
    with pytest.raises(ValueError, match="not modules of the model"):
        RangeWatch(nn.Linear(2, 2), modules=["encoder"])
    with pytest.raises(ValueError, match="phases"):
        RangeWatch(nn.Linear(2, 2), phases=["sideways"])
    assert mixprec.doctor.DEFAULT_FORMATS == ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


def test_gradients_that_overflow_fp16_unscaled_get_a_scale_below_one_and_the_reason():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    big_loss = lambda output, targets: nn.functional.cross_entropy(output, targets) * 1e7  # noqa: E731
    diagnosis = diagnose(model, _batches(), big_loss, steps=2)
    fp16 = diagnosis.formats["fp16"]
    assert fp16.gradient_amax > 65504 and diagnosis.loss_scale is not None and diagnosis.loss_scale < 1
    assert any("overflows fp16 (largest finite 65504) unscaled" in reason for reason in diagnosis.reasons)
    assert all("keeps 100%" not in reason for reason in diagnosis.reasons) or fp16.kept_with_scale == 1


def test_an_inf_the_loss_leaves_out_or_one_bad_batch_still_gets_advice():
    class Masked(nn.Module):  # log-probabilities with -inf at masked classes the targets never use
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x):
            return self.linear(x).masked_fill(torch.tensor([False, False, False, True]), float("-inf"))

    torch.manual_seed(0)
    batches = [(x, y % 3) for x, y in _batches()]
    diagnosis = diagnose(Masked(), batches, nn.functional.cross_entropy, steps=3)
    assert diagnosis.fp32_nonfinite == () and diagnosis.policy != "fp32"
    # one batch of three with a NaN input: advice for the rest, and a reason about that batch
    batches[1][0][0, 0] = float("nan")
    diagnosis = diagnose(nn.Sequential(nn.Linear(16, 4)), batches, nn.functional.cross_entropy, steps=3)
    assert diagnosis.fp32_nonfinite == () and diagnosis.policy != "fp32"
    assert any(reason.startswith("1 of 3 recorded steps had a non-finite loss") for reason in diagnosis.reasons)
