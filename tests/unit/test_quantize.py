import math

import pytest
import torch

import mixprec

INF, NAN = float("inf"), float("nan")


def q(values, fmt, **kwargs):
    return mixprec.quantize(torch.tensor(values, dtype=torch.float32), fmt, **kwargs).tolist()


def test_fp16_ties_round_to_even():
    ulp = 2.0**-10
    assert q([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2)], "fp16") == [1.0, 1 + 2 * ulp, -1.0]


def test_fp16_subnormals_and_underflow():
    tiny = 2.0**-24
    assert q([tiny, tiny / 2, tiny * 0.5000001, 3 * tiny / 2, 1e-8], "fp16") == [tiny, 0.0, tiny, 2 * tiny, 0.0]


def test_negative_zero_is_kept():
    out = mixprec.quantize(torch.tensor([-0.0, -1e-30]), "fp16")
    assert torch.equal(torch.signbit(out), torch.tensor([True, True]))
    assert out.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("fmt", "below", "at", "limit"),
    [("fp16", 65519.99, 65520.0, INF), ("fp8_e5m2", 61439.0, 61440.0, INF), ("fp8_e4m3", 463.9, 464.0, 448.0)],
)
def test_overflow_boundary(fmt, below, at, limit):
    maximum = mixprec.get_format(fmt).max
    assert q([below, at, -at, 1e30], fmt) == [maximum, limit, -limit, limit]


def test_saturate_clamps_overflow_and_inf():
    assert q([70000.0, -INF, INF], "fp16", saturate=True) == [65504.0, -65504.0, 65504.0]
    assert q([INF, -INF], "fp16") == [INF, -INF]


def test_saturate_on_formats_wider_than_the_input():
    # a format as wide as the input ignored saturate; one whose max is past FP32's raised in torch.where
    assert q([INF, -INF], "fp32", saturate=True) == [3.4028234663852886e38, -3.4028234663852886e38]
    wide = mixprec.quantize(torch.tensor([INF, -INF], dtype=torch.float64), "fp64", saturate=True)
    assert wide.tolist() == [1.7976931348623157e308, -1.7976931348623157e308]
    # e9m3's max is past FP32's range: rounded into FP32 it is inf, as every result held in FP32 is rounded
    assert q([1.0, INF], "e9m3", saturate=True) == [1.0, INF]
    assert mixprec.quantize(torch.tensor([INF], dtype=torch.float64), "e9m3", saturate=True).item() == (
        mixprec.get_format("e9m3").max
    )
    no_inf = mixprec.Format("e9m3fn", 9, 3, has_inf=False)
    assert q([1.0, -INF], no_inf) == [1.0, -INF]


def test_fp8_e4m3_has_no_inf():
    assert q([INF, -INF, 1e6], "fp8_e4m3") == [448.0, -448.0, 448.0]


def test_nan_stays_nan():
    assert all(math.isnan(v) for v in q([NAN], "fp16") + q([NAN], "fp8_e4m3") + q([NAN], "e3m2", saturate=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "e3m2"])
def test_keeps_dtype_device_and_shape(dtype, fmt, device):
    x = torch.randn(3, 5, dtype=dtype, device=device)
    out = mixprec.quantize(x, fmt)
    assert (out.dtype, out.device, out.shape) == (x.dtype, x.device, x.shape)
    reference = mixprec.quantize(x.double(), fmt).to(dtype)
    if fmt != "fp16" or dtype != torch.bfloat16:  # bf16 cannot hold every fp16 value: rounded again
        assert torch.equal(out, reference)


def test_wider_format_is_identity():
    x = torch.randn(1000)
    assert torch.equal(mixprec.quantize(x, "fp32"), x)
    assert torch.equal(mixprec.quantize(x, "fp64"), x)
    assert mixprec.quantize(x, "fp64") is not x


def test_tf32_keeps_ten_mantissa_bits():
    assert q([1 + 2**-11, 1 + 3 * 2**-11, 1e-40], "tf32") == [1.0, 1 + 2**-9, 2**-136 * round(1e-40 / 2**-136)]


def test_stochastic_picks_a_neighbour_and_is_reproducible():
    x = torch.full((10000,), 1 + 2**-12)  # a quarter of an fp16 ulp above 1
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = mixprec.quantize(x, "fp16", rounding="stochastic", generator=g1)
    b = mixprec.quantize(x, "fp16", rounding="stochastic", generator=g2)
    assert torch.equal(a, b)
    assert set(a.unique().tolist()) == {1.0, 1 + 2**-10}
    assert (a > 1).float().mean().item() == pytest.approx(0.25, abs=0.02)


def test_stochastic_rounding_takes_a_cpu_generator_on_every_device(device):
    # the same seed gives the same draws whatever device the tensor is on
    x = torch.full((1000,), 1 + 2**-12)
    on_cpu = mixprec.quantize(x, "fp16", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    there = mixprec.quantize(x.to(device), "fp16", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    assert there.device.type == device and torch.equal(there.cpu(), on_cpu)


def test_stochastic_leaves_representable_values_alone():
    x = torch.tensor([1.0, 0.5, -65504.0, 2.0**-24])
    assert torch.equal(mixprec.quantize(x, "fp16", rounding="stochastic"), x)


@pytest.mark.parametrize(
    "bad", [torch.arange(3), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64)]
)
def test_rejects_non_floating_tensors(bad):
    with pytest.raises(TypeError, match=r"floating-point tensor .* received dtype"):
        mixprec.quantize(bad, "fp16")


def test_rejects_non_tensors_bad_formats_and_modes():
    with pytest.raises(TypeError, match=r"needs a torch\.Tensor; received an object of type list"):
        mixprec.quantize([1.0], "fp16")
    with pytest.raises(ValueError, match="fmt='fp12' is not a known float format"):
        mixprec.quantize(torch.ones(1), "fp12")
    with pytest.raises(ValueError, match=r"rounding=.*'up'.*'nearest', 'stochastic'"):
        mixprec.quantize(torch.ones(1), "fp16", rounding="up")
