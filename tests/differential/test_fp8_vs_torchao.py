"""Differential tests: mixprec's FP8 training (emulated GEMMs) against torchao's float8 training
(``Float8LinearConfig(emulate=True)``), the field's reference, bit for bit where both compute the same thing.

The pairs: torchao's tensorwise scaling with its scales rounded to powers of two (mixprec's scales always are)
is mixprec's ``hybrid`` recipe (e4m3 forward, e5m2 gradients) and, with e4m3 gradients, its ``e4m3``; torchao's
``rowwise`` recipe (power-of-two scales, every operand e4m3, each GEMM's operands scaled per slice orthogonal to
its reduction) is ``e4m3(scaling=rowwise)``. The output, the input's gradient and every weight and bias
gradient are equal, also for inputs whose rows span six decades.

Where they differ, by design (docs/fp8.md): torchao's default tensorwise scale ``448 / amax`` is not a power
of two; under bf16 autocast torchao rounds each gradient GEMM's output to bf16 and adds a bias after rounding the
product, where mixprec rounds the FP32 sum once (checked here: torchao's gradients are mixprec's rounded to bf16).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao_reference import torchao_modules

import mixprec

(float8,) = torchao_modules("torchao.float8")

EMULATED = "keep=none,shapes=all,gemm=emulated"  # every layer FP8, on the emulation (torchao's emulate=True)


def _torchao_config(name: str):
    if name == "tensorwise":
        return float8.Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True)
    if name == "tensorwise e4m3":
        e4m3 = float8.CastConfig(target_dtype=torch.float8_e4m3fn)
        return float8.Float8LinearConfig(emulate=True, round_scales_to_power_of_2=True, cast_config_grad_output=e4m3)
    recipe = float8.Float8LinearConfig.from_recipe_name("rowwise")
    return float8.Float8LinearConfig(**{**recipe.__dict__, "emulate": True})


PAIRS = {
    "tensorwise": f"hybrid({EMULATED})",
    "tensorwise e4m3": f"e4m3({EMULATED})",
    "rowwise": f"e4m3(scaling=rowwise,{EMULATED})",
}


def _model(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48, bias=bias), nn.ReLU(), nn.Linear(48, 40, bias=bias))


def _data(spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g)
    if spread:  # rows over six decades: the small ones are where scaling choices show
        x = x * torch.logspace(-3, 3, 32).unsqueeze(1)
    return x, torch.randn(32, 40, generator=g)


def _results(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def _torchao(config, bias: bool, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    model = float8.convert_to_float8_training(_model(bias), config=config)
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(upstream)
    return _results(model, x, y)


def _mixprec(policy: str, bias: bool, x: torch.Tensor, upstream: torch.Tensor) -> list[torch.Tensor]:
    model = _model(bias)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), policy)
    x = x.clone().requires_grad_()
    with mp.autocast():
        y = model(x)
    mp.backward((y.float() * upstream).sum())  # no loss scale (no fp16): the gradients as torchao's backward
    return _results(model, x, y)


@pytest.mark.parametrize("spread", [False, True], ids=["normal", "rows over six decades"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_fp8_training_in_fp32_equals_torchaos_bit_for_bit(pair, bias, spread):
    x, upstream = _data(spread)
    reference = _torchao(_torchao_config(pair), bias, x, upstream)
    got = _mixprec(f"base=fp32,fp8={PAIRS[pair]}", bias, x, upstream)
    names = ["output", "input gradient", *(f"gradient {n}" for n, _ in _model(bias).named_parameters())]
    for name, a, b in zip(names, reference, got, strict=True):
        assert torch.equal(a, b), f"{pair}: {name} differs by up to {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8_under_bf16_autocast_rounds_once_where_torchao_rounds_its_gradients_to_bf16(x_dtype):
    g = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(32, 64, generator=g).to(x_dtype), torch.randn(32, 48, generator=g)
    torch.manual_seed(0)
    reference = float8.convert_to_float8_training(nn.Linear(64, 48, bias=False), config=_torchao_config("tensorwise"))
    xt = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yt = reference(xt)
    yt.backward(upstream.to(yt.dtype))
    torch.manual_seed(0)
    model = nn.Linear(64, 48, bias=False)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), f"base=fp8,fp8=({EMULATED})")
    xm = x.clone().requires_grad_()
    with mp.autocast():
        ym = model(xm)
    mp.backward((ym.float() * upstream).sum())
    assert torch.equal(yt.float(), ym.float())
    assert torch.equal(xt.grad, xm.grad.to(torch.bfloat16).to(x_dtype))
    assert torch.equal(reference.weight.grad, model.weight.grad.to(torch.bfloat16).float())
    assert not torch.equal(reference.weight.grad, model.weight.grad)  # mixprec's is the FP32 sum, not its rounding
