import math

import pytest
import torch

import mixprec

NAMED_WITH_DTYPE = [name for name, fmt in mixprec.FORMATS.items() if fmt.torch_dtype is not None]


@pytest.mark.parametrize("name", NAMED_WITH_DTYPE)
def test_named_formats_match_torch_finfo(name):
    fmt = mixprec.get_format(name)
    info = torch.finfo(fmt.torch_dtype)
    assert fmt.total_bits == info.bits
    assert fmt.max == info.max
    assert fmt.min_normal == info.smallest_normal
    assert fmt.eps == info.eps
    assert fmt.min_subnormal == info.smallest_normal * info.eps  # 2**(emin - mantissa_bits)


@pytest.mark.parametrize(
    ("name", "e", "m", "bias", "max_", "min_normal", "min_subnormal", "has_inf"),
    [
        ("fp32", 8, 23, 127, (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149, True),
        ("tf32", 8, 10, 127, (2 - 2**-10) * 2.0**127, 2.0**-126, 2.0**-136, True),
        ("fp16", 5, 10, 15, 65504.0, 2.0**-14, 2.0**-24, True),
        ("bf16", 8, 7, 127, (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133, True),
        ("fp8_e4m3", 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, False),
        ("fp8_e5m2", 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, True),
        ("e3m2", 3, 2, 3, 14.0, 0.25, 2.0**-4, True),
        ("e2m1", 2, 1, 1, 3.0, 1.0, 0.5, True),
        ("e6m9", 6, 9, 31, (2 - 2**-9) * 2.0**31, 2.0**-30, 2.0**-39, True),
    ],
)
def test_format_fields(name, e, m, bias, max_, min_normal, min_subnormal, has_inf):
    fmt = mixprec.get_format(name)
    assert (fmt.exponent_bits, fmt.mantissa_bits, fmt.bias, fmt.has_inf) == (e, m, bias, has_inf)
    assert fmt.total_bits == 1 + e + m
    assert (fmt.max, fmt.min_normal, fmt.min_subnormal) == (max_, min_normal, min_subnormal)
    assert fmt.eps == 2.0**-m
    assert fmt.decimal_digits == pytest.approx((m + 1) * math.log10(2))


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("float16", "fp16"),
        ("half", "fp16"),
        ("f16", "fp16"),
        ("torch.float16", "fp16"),
        ("FP16", "fp16"),
        ("bfloat16", "bf16"),
        ("torch.bfloat16", "bf16"),
        ("float", "fp32"),
        ("float32", "fp32"),
        ("double", "fp64"),
        ("e4m3", "fp8_e4m3"),
        ("float8_e4m3fn", "fp8_e4m3"),
        ("e5m2", "fp8_e5m2"),
        ("e5m10", "fp16"),
        ("tensorfloat32", "tf32"),
        (torch.float16, "fp16"),
        (torch.float8_e5m2, "fp8_e5m2"),
    ],
)
def test_spellings(spelling, canonical):
    assert mixprec.get_format(spelling) is mixprec.FORMATS[canonical]


def test_generic_formats_are_equal_values():
    assert mixprec.get_format("e3m2") == mixprec.get_format(" E3M2 ")
    assert mixprec.get_format("e3m2").torch_dtype is None
    assert str(mixprec.get_format("e6m9")) == "e6m9"


def test_format_is_frozen():
    with pytest.raises(AttributeError):
        mixprec.FORMATS["fp16"].mantissa_bits = 3  # type: ignore[misc]


def test_loss_scaling_advice():
    needs = {name for name, fmt in mixprec.FORMATS.items() if fmt.needs_loss_scaling}
    assert needs == {"fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"}


@pytest.mark.parametrize("bad", ["fp17", "e1m3", "e12m3", "e4m53", "", "float8", "bf32"])
def test_unknown_names_list_valid_ones(bad):
    with pytest.raises(ValueError, match="Valid names: fp64, fp32, tf32, fp16, bf16") as err:
        mixprec.get_format(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("bad", [16, None, 1.5, ["fp16"]])
def test_wrong_types(bad):
    with pytest.raises(TypeError, match="of type"):
        mixprec.get_format(bad)


def test_non_float_dtype():
    with pytest.raises(ValueError, match=r"torch\.int32"):
        mixprec.get_format(torch.int32)


@pytest.mark.parametrize("bits", [(3.5, 2), (4, 2.0), (True, 3)])
def test_a_format_takes_whole_numbers_of_bits(bits):
    # Format("x", 3.5, 2) was made, and computed with a fractional bias
    with pytest.raises(ValueError, match=r"use a whole number of bits"):
        mixprec.Format("x", *bits)
