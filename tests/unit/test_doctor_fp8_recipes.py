"""The doctor per FP8 recipe: each GEMM layer's output error under each recipe, the underflow and saturation it
causes, and the layers to keep out of FP8."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.doctor import FP8_RECIPES, fp8_recipe_report


class _OutlierNet(nn.Module):
    """Four layers; one token (row) of c's input is 10^5 times the others, as outlier tokens are."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        h = torch.cat([h[:1] * 1e5, h[1:]])
        return self.d(torch.relu(self.c(h)))


def _report(**kwargs):
    torch.manual_seed(0)
    batches = [torch.randn(32, 64) for _ in range(3)]
    return fp8_recipe_report(_OutlierNet(), batches, lambda model, x: model(x), steps=3, **kwargs)


def test_an_outlier_token_hurts_tensorwise_scaling_and_the_doctor_keeps_its_layers_out():
    report = _report()
    assert report.layers == ["a", "b", "c", "d"] and report.recipes == list(FP8_RECIPES)
    tensorwise, rowwise = report.fit("c", "tensorwise"), report.fit("c", "rowwise")
    # one scale for the tensor: the outlier token sets it and the other tokens' small values flush to zero
    assert tensorwise.underflow > 0.05 and rowwise.underflow == 0
    assert tensorwise.error > 5 * rowwise.error
    assert report.keep["tensorwise"] == ["c", "d"] and report.keep["rowwise"] == [] == report.keep["blockwise"]
    assert report.best() in ("rowwise", "blockwise")
    # the well-scaled layers: e4m3's rounding alone, about 2-6% of a row's norm
    assert all(0.01 < report.fit("a", r).error < 0.06 for r in ("tensorwise", "rowwise", "blockwise"))
    # 4-bit elements lose more than 8-bit ones, on every layer
    assert all(report.fit(layer, "mxfp4").error > report.fit(layer, "mxfp8_e4m3").error for layer in "abcd")


def test_the_ocp_mx_scale_saturates_blocks_whose_amax_has_a_large_mantissa():
    layer = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        layer.weight.uniform_(-1, 1)
        layer.weight[:, 0] = 1.96875  # each row's block amax just under 2: over the OCP scale, 504 > 448
    report = fp8_recipe_report(nn.Sequential(layer), [torch.randn(4, 32)], lambda m, x: m(x), steps=1)
    assert report.fit("0", "mxfp8_e4m3").saturated > 0  # 16 weights of 16 x 32 + 4 x 32 input values
    assert report.fit("0", "tensorwise").saturated == 0 == report.fit("0", "rowwise").saturated


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match=r"recipes: received \['fp6'\]; use names from tensorwise"):
        _report(recipes=("fp6",))
    with pytest.raises(ValueError, match=r"outlier: received 1; use a factor above 1"):
        _report(outlier=1)
