"""Differential tests: the block-scaled formats against torchao's MX and NVFP4 code (torchao 0.18, emulated),
bit for bit where both compute the same thing.

- MXFP8 (e4m3, e5m2) and MXFP4: ``scale_rule="ocp"`` is torchao's FLOOR, ``"ceil"`` its RCEIL, on random data,
  rows spanning 40 decades, zeros, elements in their subnormals, block amaxes at the saturation edge, FP32's
  largest values, round-half ties and NaN.
- NVFP4: torchao's two-level quantization (an FP32 tensor scale, e4m3 block scales), where no block scale falls
  below e4m3's smallest normal (torchao floors it there) and no tie meets its reciprocal order.
- MXFP8 training: the recipe ``e4m3(scaling=mxfp8)`` is torchao's ``MXFP8Linear`` with FLOOR scales, and with
  ``scale_rule=ceil`` its default, RCEIL; the ``hybrid`` recipe is its ``mx_mm`` with e5m2 gradients: output,
  input, weight and bias gradients; MXFP4's forward.

Where torchao departs (tests here keep clear of it; docs/numerics.md): its FLOOR and RCEIL at the lowest E8M0
scale, 2^-127 (a value comes back halved, or 0), its RCEIL's log2 in FP32 (one ulp above max * 2^k keeps k),
a block holding inf (kept, the rest 0; mixprec's block is NaN).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchao_reference import torchao_modules

import mixprec

mx_tensor, nvfp4_tensor, mxfp8_linear, mx_config, kernel_preference = torchao_modules(
    "torchao.prototype.mx_formats.mx_tensor",
    "torchao.prototype.mx_formats.nvfp4_tensor",
    "torchao.prototype.moe_training.mxfp8_linear",
    "torchao.prototype.mx_formats.config",
    "torchao.quantization.quantize_.common.kernel_preference",
)
Mode, KernelPreference = mx_config.ScaleCalculationMode, kernel_preference.KernelPreference

ELEMENTS = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp4": torch.float4_e2m1fn_x2}
RULES = {"ocp": "FLOOR", "ceil": "RCEIL"}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns everywhere (the sign of zero included), NaN where the other has NaN."""
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)) | nan).all())


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def draw() -> torch.Tensor:
        return torch.randn(64, 128, generator=g)

    zeros = draw()
    zeros[:, :32], zeros[3], zeros[5, 40:48] = 0.0, 0.0, -0.0
    outliers = draw()
    outliers[:, ::32] *= 1e4  # the rest of each block in the elements' subnormals
    edge = draw().abs() + 0.1  # block amaxes 1.70 .. 1.999 x 2^k: the OCP rule saturates them in e4m3 and e2m1
    edge[:, ::16] = torch.linspace(1.70, 1.999, 64)[:, None] * 2.0 ** torch.randint(-10, 10, (64, 1), generator=g)
    nan = draw()
    nan[1, 3] = float("nan")
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 16).repeat(64, 1)
    return {
        "random": draw(),
        "rows over 40 decades": draw() * torch.logspace(-20, 20, 64)[:, None],
        "zeros": zeros,
        "subnormal elements": outliers,
        "saturation edge": edge,
        "largest": (draw() * 3e38).clamp(-3.4e38, 3.4e38),
        "nan": nan,
        "ties": ties * 2.0 ** torch.randint(-5, 5, (64, 1), generator=g),
    }


INPUTS = _inputs()


@pytest.mark.parametrize("case", list(INPUTS))
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("name", list(ELEMENTS))
def test_mx_formats_equal_torchaos_scale_modes(name, rule, case):
    x = INPUTS[case]
    theirs = mx_tensor.MXTensor.to_mx(x.contiguous(), ELEMENTS[name], 32, getattr(Mode, RULES[rule]))
    assert _same_bits(mixprec.quantize(x, name, scale_rule=rule), theirs.dequantize(torch.float32))


@pytest.mark.parametrize("case", ["random", "zeros", "subnormal elements", "saturation edge", "largest", "nan"])
def test_nvfp4_equals_torchaos_two_level_quantization(case):
    x = INPUTS[case]
    scale = nvfp4_tensor.per_tensor_amax_to_scale(x.abs()[torch.isfinite(x)].max())
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=scale)
    assert _same_bits(mixprec.quantize(x, "nvfp4"), theirs.dequantize(torch.float32))


def _layer_and_data(case: str) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 64)
    g = torch.Generator().manual_seed(0)
    x, upstream = torch.randn(64, 128, generator=g), torch.randn(64, 64, generator=g)
    if case == "spread":  # rows of the input over 12 decades, of the gradient over 8
        x, upstream = x * torch.logspace(-6, 6, 64)[:, None], upstream * torch.logspace(-4, 4, 64)[:, None]
    return layer, x, upstream


def _mixprec(layer, x, upstream, recipe: str) -> tuple[torch.Tensor, ...]:
    layer, x = copy.deepcopy(layer), x.clone().requires_grad_()
    mp = mixprec.MixedPrecision(layer, torch.optim.SGD(layer.parameters(), lr=0.0), f"base=fp32,fp8={recipe}")
    with mp.autocast():
        y = layer(x)
    mp.backward((y * upstream).sum())
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _torchao_mx_mm(layer, x, upstream, forward: torch.dtype, backward: torch.dtype) -> tuple[torch.Tensor, ...]:
    layer, x = copy.deepcopy(layer), x.clone().requires_grad_()
    product = mxfp8_linear.mx_mm.apply(
        x, layer.weight, forward, forward, backward, 32, KernelPreference.EMULATED,
        mx_config.MXFP8Dim0CastKernelChoice.TORCH, mx_config.MXFP8Dim1CastKernelChoice.TORCH, Mode.FLOOR, False,
    )  # fmt: skip
    y = product + layer.bias
    (y * upstream).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


NAMES = ("output", "input gradient", "weight gradient", "bias gradient")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("case", ["random", "spread"])
def test_mxfp8_training_equals_torchaos_mxfp8_linear(case, rule):
    layer, x, upstream = _layer_and_data(case)
    ours = _mixprec(layer, x, upstream, f"e4m3(scaling=mxfp8,scale_rule={rule},keep=none,gemm=emulated)")
    reference = mxfp8_linear.MXFP8Linear(  # RCEIL: torchao's default
        128, 64, kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=getattr(Mode, RULES[rule])
    )
    reference.load_state_dict(layer.state_dict())
    xt = x.clone().requires_grad_()
    y = reference(xt)
    (y * upstream).sum().backward()
    for name, a, b in zip(NAMES, ours, (y.detach(), xt.grad, reference.weight.grad, reference.bias.grad), strict=True):
        assert _same_bits(a, b), name


@pytest.mark.parametrize("case", ["random", "spread"])
def test_mxfp8_hybrid_training_equals_torchaos_mx_mm_with_e5m2_gradients(case):
    layer, x, upstream = _layer_and_data(case)
    ours = _mixprec(layer, x, upstream, "hybrid(scaling=mxfp8,keep=none,gemm=emulated)")
    reference = _torchao_mx_mm(layer, x, upstream, torch.float8_e4m3fn, torch.float8_e5m2)
    for name, a, b in zip(NAMES, ours, reference, strict=True):
        assert _same_bits(a, b), name


@pytest.mark.parametrize("case", ["random", "spread"])
def test_mxfp4_forward_equals_torchaos_mx_mm(case):
    # the forward only: mixprec's MXFP4 backward rounds gradients stochastically, under the 'ceil' rule, and rotates
    # the tokens of the weight gradient's operands (docs/fp8.md), which torchao's mx_mm does not
    layer, x, upstream = _layer_and_data(case)
    ours = _mixprec(layer, x, upstream, "hybrid(scaling=mxfp4,keep=none,gemm=emulated)")
    fp4 = torch.float4_e2m1fn_x2
    assert _same_bits(ours[0], _torchao_mx_mm(layer, x, upstream, fp4, fp4)[0])
