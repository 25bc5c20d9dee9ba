"""The compiled FP8 cast (one pass per operand on CUDA) equals the eager operations it compiles.

On the CPU the test forces the compiled pass (``fused=True``), which CUDA takes by default; Inductor compiles
the same graph for either device, and the GPU check runs the CUDA twin.
"""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8 import ScaleState, fuses_cast, scaled_cast


def _operands(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Values over many binades, with zeros, subnormal-sized values, and the non-finite values an overflow brings."""
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(96, 80, generator=generator) * torch.exp2(torch.randint(-30, 30, (96, 80), generator=generator))
    wide[0, :8] = 0.0
    small = torch.randn(33, 48, generator=generator) * 2.0**-20
    overflow = torch.randn(40, 32, generator=generator)
    overflow[3, 4], overflow[5, 6], overflow[7, 8] = math.inf, -math.inf, math.nan
    limit = torch.finfo(dtype).max
    return [t.clamp(-limit, limit).to(device, dtype) for t in (wide, small, overflow)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (the compiled cast may set a NaN's sign bit otherwise)."""
    return (
        a.dtype == b.dtype
        and torch.equal(a.float().nan_to_num(nan=7.0), b.float().nan_to_num(nan=7.0))
        and bool((a.float().isnan() == b.float().isnan()).all())
    )


# a compile that failed would fall back to the eager path the test holds it to: fail instead
@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_compiled_cast_equals_eager(device: str, scaling: str, fmt: str) -> None:
    recipe = Fp8Recipe(forward=fmt, backward=fmt, scaling=scaling, history=4, margin=1 if fmt == "fp8_e5m2" else 0)
    device = torch.device(device)
    eager, fused = ScaleState(fmt, recipe, device), ScaleState(fmt, recipe, device)
    for dtype in (torch.bfloat16, torch.float32):
        for tensor in _operands(device, dtype):
            want_q, want_scale = scaled_cast(tensor, eager, fused=False)
            got_q, got_scale = scaled_cast(tensor, fused, fused=True)
            assert torch.equal(got_scale, want_scale), (dtype, tuple(tensor.shape))
            assert _same(got_q, want_q), (dtype, tuple(tensor.shape))
            # the delayed state's history and count are updated in place, equally
            assert torch.equal(fused.history, eager.history) and torch.equal(fused.recorded, eager.recorded)
    if scaling == "delayed":
        assert int(eager.recorded) == 4  # the non-finite amaxes left out: 6 casts, 2 of them overflowing


def test_scaled_cast_is_scale_for_then_cast() -> None:
    """The eager path is the ScaleState's scale and cast_to_fp8_storage, as the FP8 Linear used them before."""
    from mixprec.regions.fp8.scaling import cast_to_fp8_storage

    recipe = Fp8Recipe(scaling="delayed", history=3)
    a, b = ScaleState("fp8_e4m3", recipe), ScaleState("fp8_e4m3", recipe)
    for tensor in _operands(torch.device("cpu"), torch.float32):
        q, scale = scaled_cast(tensor, a, fused=False)
        want_scale = b.scale_for(tensor)
        assert torch.equal(scale, want_scale)
        assert _same(q, cast_to_fp8_storage(tensor, want_scale, "fp8_e4m3"))


def test_fuses_only_on_cuda() -> None:
    assert not fuses_cast(torch.device("cpu"))
