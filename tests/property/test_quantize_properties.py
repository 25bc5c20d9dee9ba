"""Property tests for ``mixprec.quantize``: what any correct rounding into a float format must satisfy.

Every check on values is done in exact rational arithmetic (``fractions.Fraction``), so the test
itself never rounds.  The formats cover PyTorch's own (fp16, bf16, fp8), tf32, and generic IEEE
formats down to the smallest allowed (e2m1: max 3, e5m0: no mantissa bits at all).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mixprec

FORMAT_NAMES = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "tf32", "e3m2", "e6m9", "e2m1", "e5m0"]
FORMATS = {name: mixprec.get_format(name) for name in FORMAT_NAMES}

PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The statistical test draws its x values deterministically, so it cannot flake from one run to the next.
STATISTICAL = settings(max_examples=25, deadline=None, derandomize=True)

FP32_MAX = float(np.finfo(np.float32).max)
FP32_OVERFLOW = 2.0**128 - 2.0**103  # fp64 values from here on cast to inf in fp32
N_DRAWS = 20_000

# ------------------------------------------------------------------------------------------ exact helpers


def ulp(fmt: mixprec.Format, x: float) -> Fraction:
    """The format's spacing at |x|: 2**(max(floor(log2|x|), min_exponent) - mantissa_bits), exactly."""
    binade = fmt.min_exponent if x == 0 else max(math.frexp(abs(x))[1] - 1, fmt.min_exponent)
    return Fraction(2) ** (binade - fmt.mantissa_bits)


def neighbours(fmt: mixprec.Format, x: float) -> tuple[Fraction, Fraction]:
    """The representable magnitudes just below and just above |x| (equal when |x| is representable)."""
    step = ulp(fmt, x)
    k = Fraction(abs(x)) / step
    return math.floor(k) * step, math.ceil(k) * step


def assert_representable(fmt: mixprec.Format, q: float, context: str) -> None:
    """``q`` is a value of ``fmt``: on the grid of its binade, within range, or inf where the format has it."""
    assert not math.isnan(q), f"{context}: got NaN"
    if math.isinf(q):
        assert fmt.has_inf, f"{context}: got {q} but {fmt} has no infinities"
        return
    assert abs(q) <= fmt.max, f"{context}: |{q!r}| exceeds {fmt}.max={fmt.max!r}"
    steps = Fraction(q) / Fraction(fmt.min_subnormal)
    assert steps.denominator == 1, f"{context}: {q!r} is not a multiple of min_subnormal={fmt.min_subnormal!r}"
    significand = Fraction(q) / ulp(fmt, q)
    assert significand.denominator == 1 and abs(significand) < 2 ** (fmt.mantissa_bits + 1), (
        f"{context}: {q!r} needs more than {fmt.mantissa_bits} mantissa bits"
    )


def same_bits(a: float, b: float) -> bool:
    """Equality that tells -0.0 from 0.0."""
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int64
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def q32(values: list[float], fmt: mixprec.Format, **kwargs) -> torch.Tensor:
    return mixprec.quantize(torch.tensor(values, dtype=torch.float32), fmt, **kwargs)


# ------------------------------------------------------------------------------------------ strategies


def _to_width(value: float, width: int) -> float:
    if width == 64:
        return value
    if abs(value) >= FP32_OVERFLOW:
        return math.copysign(FP32_MAX, value)
    return float(np.float32(value))


@st.composite
def near_grid(draw: st.DrawFn, fmt: mixprec.Format, width: int = 32) -> float:
    """Values in or around ``fmt``'s range: anywhere in a binade, on the grid, on a tie, or one input-ulp off."""
    binade = draw(st.integers(fmt.min_exponent - fmt.mantissa_bits - 2, fmt.max_exponent + 1))
    step_exp = max(binade, fmt.min_exponent) - fmt.mantissa_bits
    kind = draw(st.sampled_from(["anywhere", "representable", "tie"]))
    if kind == "anywhere":
        bits = 24 if width == 32 else 53
        value = math.ldexp(draw(st.integers(2 ** (bits - 1), 2**bits - 1)), binade - bits + 1)
    else:
        first = 2**fmt.mantissa_bits if binade >= fmt.min_exponent else 0
        k = draw(st.integers(first, 2 ** (fmt.mantissa_bits + 1)))
        value = math.ldexp(2 * k + (kind == "tie"), step_exp - 1)
    value = _to_width(value * (-1 if draw(st.booleans()) else 1), width)
    nudge = draw(st.sampled_from([0, 0, -1, 1]))
    if nudge:
        dtype = np.float32 if width == 32 else np.float64
        with np.errstate(over="ignore"):  # stepping past fp32's max gives inf, clamped just below
            value = float(np.nextafter(dtype(value), dtype(math.copysign(math.inf, nudge))))
        value = _to_width(value, width)
    return value


def special_values(fmt: mixprec.Format) -> list[float]:
    half_top_ulp = math.ldexp(1.0, fmt.max_exponent - fmt.mantissa_bits - 1)
    values = [
        0.0,
        fmt.min_subnormal,
        fmt.min_subnormal / 2,
        fmt.min_subnormal * 1.5,
        fmt.min_normal,
        fmt.max,
        fmt.max - half_top_ulp,
        fmt.overflow_threshold,
        fmt.max + half_top_ulp / 2,
        FP32_MAX,
        float(np.finfo(np.float32).smallest_subnormal),
    ]
    return [v for v in values for v in (v, -v)]


def inputs(fmt: mixprec.Format, width: int = 32) -> st.SearchStrategy[float]:
    return st.one_of(
        st.floats(width=width, allow_nan=False, allow_infinity=False),
        near_grid(fmt, width),
        st.sampled_from(special_values(fmt)),
    )


def input_lists(fmt: mixprec.Format, width: int = 32) -> st.SearchStrategy[list[float]]:
    return st.lists(inputs(fmt, width), min_size=1, max_size=8)


def test_special_values_are_exact_fp32_numbers() -> None:
    for fmt in FORMATS.values():
        for v in special_values(fmt):
            assert float(np.float32(v)) == v, f"{fmt}: special value {v!r} is not an fp32 number"


fmt_param = pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=FORMAT_NAMES)


# ------------------------------------------------------------------------------------------ nearest


@fmt_param
@PROFILE
@given(data=st.data())
def test_quantize_is_idempotent_and_sign_symmetric(fmt: mixprec.Format, data: st.DataObject) -> None:
    values = data.draw(input_lists(fmt), label="x")
    x = torch.tensor(values, dtype=torch.float32)
    n = len(values)
    for saturate in (False, True):
        q = mixprec.quantize(torch.cat([x, -x]), fmt, saturate=saturate)
        pos, neg = q[:n], q[n:]
        assert bits_equal(neg, -pos), (
            f"quantize(-x) != -quantize(x) in {fmt} (saturate={saturate}): x={values}, "
            f"quantize(x)={pos.tolist()}, quantize(-x)={neg.tolist()}"
        )
        twice = mixprec.quantize(q, fmt, saturate=saturate)
        assert bits_equal(twice, q), (
            f"quantize is not idempotent in {fmt} (saturate={saturate}): x={values} -> {pos.tolist()} "
            f"-> {twice[:n].tolist()}"
        )
    # Stochastic rounding leaves representable values alone too (q is from the last, saturated pass).
    again = mixprec.quantize(q, fmt, rounding="stochastic", generator=torch.Generator().manual_seed(n))
    assert bits_equal(again, q), (
        f"stochastic rounding moved representable values of {fmt}: {q[:n].tolist()} -> {again[:n].tolist()}"
    )


def assert_monotonic(values: list[float], q: list[float], context: str) -> None:
    """``values`` is sorted; rounding must keep the order (ties allowed)."""
    for i in range(len(values) - 1):
        assert q[i] <= q[i + 1], (
            f"{context} is not monotonic: x={values[i]!r} <= y={values[i + 1]!r} but "
            f"quantize(x)={q[i]!r} > quantize(y)={q[i + 1]!r}"
        )


def _check_nearest(fmt: mixprec.Format, x: float, q: float) -> None:
    context = f"quantize({x!r}, {fmt})={q!r}"
    assert_representable(fmt, q, context)
    assert math.copysign(1.0, q) == math.copysign(1.0, x), f"{context}: sign lost"
    if abs(x) >= fmt.overflow_threshold:
        expected = math.inf if fmt.has_inf else fmt.max
        assert abs(q) == expected, f"{context}: |x| >= overflow_threshold={fmt.overflow_threshold!r}"
        return
    assert math.isfinite(q), f"{context}: |x| < overflow_threshold={fmt.overflow_threshold!r} but overflowed"
    step = ulp(fmt, x)
    error = abs(Fraction(q) - Fraction(x))
    assert error <= step / 2, f"{context}: error {float(error)!r} exceeds half an ulp {float(step / 2)!r}"
    if error == step / 2:  # a tie goes to the even neighbour
        k = Fraction(q) / step
        assert k.denominator == 1 and k.numerator % 2 == 0, f"{context}: tie not rounded to even"


@fmt_param
@PROFILE
@given(data=st.data())
def test_nearest_is_representable_monotonic_and_within_half_an_ulp(fmt: mixprec.Format, data: st.DataObject) -> None:
    """fp32 and fp64 inputs: the result is on the format's grid, at most ulp(x)/2 away, ties to even,
    and x <= y implies quantize(x) <= quantize(y)."""
    width = data.draw(st.sampled_from([32, 64]), label="width")
    values = sorted(data.draw(input_lists(fmt, width), label="x"))
    dtype = torch.float32 if width == 32 else torch.float64
    q = mixprec.quantize(torch.tensor(values, dtype=dtype), fmt)
    assert q.dtype == dtype, f"quantize returned {q.dtype} for {dtype} input"
    q_list = q.tolist()
    for x, qi in zip(values, q_list, strict=True):
        _check_nearest(fmt, x, qi)
    assert_monotonic(values, q_list, f"quantize(x[{dtype}], {fmt})")


@fmt_param
@PROFILE
@given(data=st.data())
def test_saturate_clamps_exactly_past_the_overflow_threshold(fmt: mixprec.Format, data: st.DataObject) -> None:
    values = sorted([*data.draw(input_lists(fmt), label="x"), math.inf, -math.inf])
    saturated = q32(values, fmt, saturate=True).tolist()
    nearest = q32(values, fmt).tolist()
    assert_monotonic(values, saturated, f"quantize(x, {fmt}, saturate=True)")
    for x, s, n in zip(values, saturated, nearest, strict=True):
        context = f"quantize({x!r}, {fmt}, saturate=True)={s!r}"
        assert math.isfinite(s), f"{context}: saturate produced a non-finite value"
        assert_representable(fmt, s, context)
        if abs(x) >= fmt.overflow_threshold:
            assert s == math.copysign(fmt.max, x), f"{context}: expected ±max={fmt.max!r}"
        else:
            assert same_bits(s, n), f"{context}: differs from the unsaturated result {n!r} below the threshold"


# ------------------------------------------------------------------------------------------ stochastic


@fmt_param
@PROFILE
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_stochastic_returns_a_neighbour(fmt: mixprec.Format, data: st.DataObject, seed: int) -> None:
    width = data.draw(st.sampled_from([32, 64]), label="width")
    values = data.draw(input_lists(fmt, width), label="x")
    dtype = torch.float32 if width == 32 else torch.float64
    x = torch.tensor(values, dtype=dtype)
    for saturate in (False, True):
        g = torch.Generator().manual_seed(seed)
        q = mixprec.quantize(x, fmt, rounding="stochastic", saturate=saturate, generator=g)
        assert q.dtype == dtype
        for xi, qi in zip(values, q.tolist(), strict=True):
            context = f"quantize({xi!r}, {fmt}, stochastic, saturate={saturate}, seed={seed})={qi!r}"
            assert_representable(fmt, qi, context)
            assert math.copysign(1.0, qi) == math.copysign(1.0, xi), f"{context}: sign lost"
            if abs(xi) <= fmt.max:
                lo, hi = neighbours(fmt, xi)
                assert Fraction(abs(qi)) in (lo, hi), f"{context}: not one of the neighbours {lo}, {hi}"
            elif saturate or not fmt.has_inf:
                assert abs(qi) == fmt.max, f"{context}: past max, expected ±max"
            else:
                assert abs(qi) in (fmt.max, math.inf), f"{context}: past max, expected ±max or ±inf"


def in_range(fmt: mixprec.Format) -> st.SearchStrategy[float]:
    """fp32 values with |x| <= fmt.max, where stochastic rounding promises an unbiased result."""
    return st.one_of(
        near_grid(fmt).filter(lambda v: abs(v) <= fmt.max),
        st.floats(min_value=-fmt.max, max_value=fmt.max, width=32),
    )


@fmt_param
@STATISTICAL
@given(data=st.data())
def test_stochastic_rounding_is_unbiased(fmt: mixprec.Format, data: st.DataObject) -> None:
    x = data.draw(in_range(fmt), label="x")
    g = torch.Generator().manual_seed(20240611)
    draws = mixprec.quantize(
        torch.tensor([x], dtype=torch.float32).expand(N_DRAWS), fmt, rounding="stochastic", generator=g
    )
    values = draws.double()
    lo, hi = neighbours(fmt, x)
    sign = math.copysign(1.0, x)
    allowed = torch.tensor([sign * float(lo), sign * float(hi)], dtype=torch.float64)
    assert torch.isin(values, allowed).all(), f"stochastic draws for x={x!r} in {fmt} leave {{lo, hi}}"
    if lo == hi:
        assert bool((values == x).all()), f"representable x={x!r} in {fmt} must not move"
        return
    # Exact arithmetic: the mean of the draws is sign * (lo + (ups / N) * (hi - lo)).
    ups = int((values.abs() == float(hi)).sum())
    mean = sign * (lo + Fraction(ups, N_DRAWS) * (hi - lo))
    p = (Fraction(abs(x)) - lo) / (hi - lo)  # the probability of rounding away from zero
    standard_error = math.sqrt(p * (1 - p) / N_DRAWS) * float(hi - lo)
    error = abs(mean - Fraction(x))
    assert error <= 5 * standard_error, (
        f"stochastic rounding of x={x!r} into {fmt} is biased: mean of {N_DRAWS} draws = {float(mean)!r}, "
        f"|mean - x| = {float(error)!r} > 5 standard errors ({5 * standard_error!r}); "
        f"neighbours {float(lo)!r}, {float(hi)!r}, {ups} rounded up, expected {float(p) * N_DRAWS:.1f}"
    )


def test_stochastic_rounding_is_deterministic_with_a_seeded_generator() -> None:
    x = torch.linspace(-3.0, 3.0, 1001)
    a = mixprec.quantize(x, "e3m2", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    b = mixprec.quantize(x, "e3m2", rounding="stochastic", generator=torch.Generator().manual_seed(7))
    c = mixprec.quantize(x, "e3m2", rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert bits_equal(a, b), "same seed, different stochastic results"
    assert not bits_equal(a, c), "different seeds gave identical stochastic results for 1001 values"
