"""Block-scaled formats (MXFP8, MXFP4, NVFP4) held bit for bit to an independent reference: plain Python per
block, PyTorch's own float8 casts for the FP8 elements and scales, a table of the 8 FP4 magnitudes for e2m1,
over many binades, zero blocks, values below the elements' smallest normal, saturating blocks, inf and NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import mixprec
from mixprec.numerics import BlockFormat, quantize_blocks

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # code i has mantissa bit i % 2: ties go to the even code
ELEMENTS = {"mxfp8_e4m3": ("e4m3", 448.0, 8), "mxfp8_e5m2": ("e5m2", 57344.0, 15), "mxfp4": ("e2m1", 6.0, 2)}


def _fp4(value: float) -> float:
    magnitude = min(abs(value), 6.0)
    below = max(i for i, v in enumerate(FP4) if v <= magnitude)
    if below == len(FP4) - 1 or magnitude == FP4[below]:
        chosen = below
    else:
        low, high = magnitude - FP4[below], FP4[below + 1] - magnitude
        chosen = below if low < high or (low == high and below % 2 == 0) else below + 1
    return math.copysign(FP4[chosen], value)


def _fp8(value: float, kind: str) -> float:
    dtype, top = (torch.float8_e4m3fn, 448.0) if kind == "e4m3" else (torch.float8_e5m2, 57344.0)
    return torch.tensor(value, dtype=torch.float64).clamp(-top, top).to(dtype).item()  # saturating, RNE


def _element(value: float, kind: str, fp4) -> float:
    return fp4(value) if kind == "e2m1" else _fp8(value, kind)


def _mx_reference(block: list[float], name: str, rule: str, fp4=_fp4) -> list[float]:
    kind, top, emax = ELEMENTS[name]
    if not all(math.isfinite(v) for v in block):  # (Python's max does not propagate NaN)
        return [math.nan] * len(block)
    amax = max(abs(v) for v in block)
    if amax == 0:
        return [0.0] * len(block)
    shared = math.frexp(amax)[1] - 1 - emax  # floor(log2(amax)) - emax
    if rule == "ceil" and amax > top * 2.0**shared:
        shared += 1
    scale = 2.0 ** min(max(shared, -127), 127)
    return [_element(v / scale, kind, fp4) * scale for v in block]


def _nvfp4_reference(values: np.ndarray, fp4=_fp4) -> np.ndarray:
    f32 = np.float32
    finite = np.abs(values[np.isfinite(values)])
    amax = f32(finite.max()) if finite.size else f32(0)
    tensor_scale = amax / f32(448 * 6) if amax > 0 else f32(1)
    out = np.empty_like(values)
    for start in range(0, values.size, 16):
        block = values[start : start + 16]
        block_amax = f32(np.abs(block).max())
        if not np.isfinite(block_amax):
            out[start : start + 16] = np.nan
            continue
        block_scale = f32(_fp8(float(block_amax / f32(6) / tensor_scale), "e4m3"))
        denominator = f32(block_scale * tensor_scale)
        for i, v in enumerate(block):
            q = f32(fp4(float(v / denominator))) if denominator > 0 else f32(0)
            out[start + i] = f32(q * denominator)
    return out


def _values(seed: int, blocks: int, block: int) -> torch.Tensor:
    """Blocks spanning binades 2**-40 .. 2**40, with zero blocks, blocks of values far below their amax (the
    elements' subnormals and zeros), blocks whose amax saturates under the OCP rule, and one inf and one NaN."""
    gen = torch.Generator().manual_seed(seed)
    mantissas = torch.rand(blocks, block, generator=gen) * 2 - 1
    binades = torch.randint(-40, 41, (blocks, 1), generator=gen).float()
    x = mantissas * torch.exp2(binades)
    x[3] = 0.0
    x[5, 1:] *= 2.0**-12  # one large value, the rest near or below the elements' smallest normal
    x[7] = mantissas[7]  # in [-1, 1] beside an amax of 62 = 1.9375 * 2**5, just under the next power of two:
    x[7, 0] = 62.0  # e4m3's OCP scale 2**(5 - 8) saturates it
    x[9, 2] = math.inf
    x[11, 4] = math.nan
    return x.flatten()


@pytest.mark.parametrize("rule", ["ocp", "ceil"])
@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"])
def test_mx_formats_equal_the_reference_bit_for_bit(name, rule):
    x = _values(0, 64, 32)
    ours = mixprec.quantize(x, name, scale_rule=rule)
    blocks = x.double().reshape(-1, 32).tolist()
    reference = torch.tensor([v for block in blocks for v in _mx_reference(block, name, rule)], dtype=torch.float32)
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours.nan_to_num(), reference.nan_to_num())
    assert ours[3 * 32 : 4 * 32].eq(0).all()  # a zero block stays zero
    if name == "mxfp8_e4m3":  # 62 over the OCP scale 2**-3 is 496: saturated to 448 * 2**-3 = 56; over the
        # ceil rule's 2**-2 it is 248, halfway between e4m3's 240 and 256: to the even 256, times 2**-2
        assert ours[7 * 32].item() == (56.0 if rule == "ocp" else 64.0)


def test_nvfp4_equals_the_reference_bit_for_bit():
    x = _values(1, 64, 16)
    ours = mixprec.quantize(x, "nvfp4")
    reference = torch.from_numpy(_nvfp4_reference(x.numpy().astype(np.float32)))
    assert torch.equal(ours.isnan(), reference.isnan())
    assert torch.equal(ours.nan_to_num(), reference.nan_to_num())


def test_block_formats_keep_shape_and_dtype_and_pad_a_ragged_last_dimension():
    x = torch.randn(3, 5, 40, dtype=torch.bfloat16)
    for name in ("mxfp8_e4m3", "mxfp4", "nvfp4"):
        y = mixprec.quantize(x, name)
        assert y.shape == x.shape and y.dtype == x.dtype
        # the ragged tail is a block of its own: padding with zeros changed nothing
        tail = mixprec.quantize(x[..., 32:].contiguous(), name) if name != "nvfp4" else None
        if tail is not None:
            assert torch.equal(y[..., 32:], tail)


@pytest.mark.parametrize("name", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4"])
def test_negative_zeros_keep_their_sign_and_empty_tensors_pass(name):
    # nvfp4 gave +0.0 for -0.0 in a block of scale 0, and raised on an empty tensor (amax of nothing)
    x = torch.tensor([[-0.0] * 32, [-0.0, 1.0] + [0.0] * 30])
    y = mixprec.quantize(x, name)
    assert torch.equal(torch.signbit(y), torch.signbit(x)) and not y.abs().sum() - 1.0
    for shape in ((2, 0), (0,), (0, 16)):
        assert mixprec.quantize(torch.empty(shape), name).shape == shape


def test_nvfp4_of_values_near_fp32s_smallest_is_finite():
    # the tensor scale amax / 2688 underflowed to 0: every block became NaN (0 / 0) from finite values
    tiny = mixprec.quantize(torch.tensor([[2.0**-149] * 3 + [0.0] * 29]), "nvfp4")
    assert torch.isfinite(tiny).all()
    small = mixprec.quantize(torch.tensor([[1e-42] + [0.0] * 31]), "nvfp4")
    assert torch.isfinite(small).all() and torch.equal(small[0, 16:], torch.zeros(16))
    assert small[0, 0].item() == pytest.approx(1e-42, rel=0.01)


def test_a_block_format_is_checked_when_made():
    e4m3 = mixprec.get_format("fp8_e4m3")
    with pytest.raises(ValueError, match=r"BlockFormat\(scale=...\): received 'E8M0'; use one of e8m0, e4m3"):
        BlockFormat("mx", e4m3, 32, "E8M0")  # was taken as NVFP4's two-level scale
    for block in (0, -32, 2.5):
        with pytest.raises(ValueError, match=r"BlockFormat\(block=...\): received"):
            BlockFormat("mx", e4m3, block, "e8m0")
    assert BlockFormat("mx", e4m3, np.int64(32), "e8m0").block == 32  # any integer type
    with pytest.raises(TypeError, match=r"quantize_blocks\(x=...\) needs a floating-point tensor.*int64"):
        quantize_blocks(torch.tensor([7, 100]), "mxfp4")  # returned integers


def test_bad_block_format_arguments_say_what_to_do():
    x = torch.randn(32)
    with pytest.raises(ValueError, match=r"scale_rule: received 'floor'; use one of 'ocp', 'ceil'"):
        mixprec.quantize(x, "mxfp4", scale_rule="floor")
    with pytest.raises(ValueError, match=r"scale_rule='ceil' applies to the MX formats' power-of-two scales"):
        mixprec.quantize(x, "nvfp4", scale_rule="ceil")
    with pytest.raises(ValueError, match=r"rounding=\.\.\.\): received 'up'; use one of 'nearest', 'stochastic'"):
        mixprec.quantize(x, "mxfp4", rounding="up")
    with pytest.raises(ValueError, match=r"scale_rule=\.\.\.\) applies to the MX block formats"):
        mixprec.quantize(x, "fp16", scale_rule="ceil")


def _directed_fp4(pick):
    """e2m1 rounding of the magnitude down (``pick=max``) or up (``min``), saturating at 6."""

    def rounded(value: float) -> float:
        magnitude = min(abs(value), 6.0)
        grid = [v for v in FP4 if (v <= magnitude if pick is max else v >= magnitude)]
        return math.copysign(pick(grid), value)

    return rounded


def _neighbours(x: torch.Tensor, name: str) -> list[torch.Tensor]:
    """The two values of ``name``'s grid around each value of ``x``, at the block scales that rounding to nearest
    picks (stochastic rounding keeps the scales): the reference, its elements rounded down and up instead."""
    bounds = []
    for pick in (max, min):
        fp4 = _directed_fp4(pick)
        if name == "nvfp4":
            bounds.append(torch.from_numpy(_nvfp4_reference(x.numpy().astype(np.float32), fp4)))
        else:
            blocks = x.double().reshape(-1, 32).tolist()
            bounds.append(torch.tensor([v for b in blocks for v in _mx_reference(b, name, "ocp", fp4)]))
    return bounds


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_stochastic_block_rounding_picks_a_grid_neighbour_and_is_unbiased(name):
    block = 32 if name == "mxfp4" else 16
    x = torch.randn(8 * block, generator=torch.Generator().manual_seed(3)) * 5
    low, high = _neighbours(x, name)
    gen = torch.Generator().manual_seed(4)
    draws = torch.stack([mixprec.quantize(x, name, rounding="stochastic", generator=gen) for _ in range(4000)])
    assert ((draws == low) | (draws == high)).all()  # each draw one of the two neighbours at the same scale
    inside = (high != low) & (x.abs() <= high.abs())  # values the grid brackets (not saturated)
    mean, width = draws.mean(0), (high - low).abs()
    # E[draw] = x; 4000 draws of a two-point variable of range `width`: sd of the mean <= width / 2 / sqrt(4000)
    assert ((mean - x).abs()[inside] <= 5 * width[inside] / 2 / math.sqrt(4000)).all()
    assert torch.equal(mixprec.quantize(x, name, rounding="nearest"), mixprec.quantize(x, name))
