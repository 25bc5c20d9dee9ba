"""Differential tests: ``mixprec.quantize`` against PyTorch's and NumPy's own casts, bit for bit.

References:
    * fp32 and 16-bit inputs: ``x.to(dtype)`` for float16, bfloat16, float8_e4m3fn and float8_e5m2
      (float8_e4m3fn saturating, as torch 2.13 casts and mixprec documents; on a torch whose cast gives
      NaN there, the overflowing inputs are clamped to ±448 before its cast).
    * fp64 inputs: NumPy's correctly rounded ``astype(np.float16 / np.float32)``, and for the other
      dtypes a correctly rounded reference built from a round-to-odd step into fp32 followed by
      PyTorch's fp32 cast (round-to-odd into a format with at least two more bits than the target
      makes the second rounding correct).  PyTorch's own float64 -> float16 cast is NOT used: it
      rounds twice, through float32.

NaN positions are compared as masks; every other position is compared on the bit pattern, so the
sign of zero and the exact value of every result matter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mixprec

TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
DTYPE_IDS = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
N_RANDOM = 1_000_000
N_RANDOM_FP64 = 200_000
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------------------------- helpers


def _bits_hex(t: torch.Tensor) -> list[str]:
    width = t.element_size() * 2
    mask = (1 << (8 * t.element_size())) - 1
    return [f"0x{int(b) & mask:0{width}x}" for b in t.view(_INT_VIEW[t.element_size()]).tolist()]


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, label: str) -> None:
    """``got`` and ``want`` agree bit for bit, except that any NaN matches any NaN."""
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype} != reference dtype {want.dtype}"
    assert got.shape == want.shape, f"{label}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want, x = got.cpu(), want.cpu(), x.cpu()
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    nan_diff = nan_got != nan_want
    if nan_diff.any():
        idx = nan_diff.nonzero()[:8, 0]
        pytest.fail(
            f"{label}: NaN masks differ at {int(nan_diff.sum())} of {x.numel()} positions; "
            f"x={x[idx].tolist()} (bits {_bits_hex(x[idx])}) got={got[idx].tolist()} want={want[idx].tolist()}"
        )
    view = _INT_VIEW[got.element_size()]
    diff = (got.view(view) != want.view(view)) & ~nan_want
    if diff.any():
        idx = diff.nonzero()[:8, 0]
        pytest.fail(
            f"{label}: {int(diff.sum())} of {x.numel()} values differ; first ones:\n"
            f"  x    = {x[idx].tolist()} (bits {_bits_hex(x[idx])})\n"
            f"  got  = {got[idx].tolist()} (bits {_bits_hex(got[idx])})\n"
            f"  want = {want[idx].tolist()} (bits {_bits_hex(want[idx])})"
        )


def _saturates(dtype: torch.dtype) -> bool:
    """Whether this torch's cast into ``dtype`` maps overflow and inf to ±max. torch 2.13 does for
    float8_e4m3fn, which has no inf; torch 2.11 gives NaN there."""
    return dtype == torch.float8_e4m3fn and not torch.isnan(torch.tensor([float("inf")]).to(dtype).float()).any()


def _torch_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's cast into ``dtype``, with mixprec's documented saturation of float8_e4m3fn (docs/numerics.md)
    where this torch's cast gives NaN instead: the input is clamped to ±448 first, which every magnitude
    from 448 to 464 rounds to anyway, so below 464 the cast alone decides."""
    if dtype == torch.float8_e4m3fn and not _saturates(dtype):
        largest = torch.finfo(dtype).max
        x = x.clamp(-largest, largest)  # NaN stays NaN
    return x.to(dtype)


def _torch_reference(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's cast into ``dtype`` and back into ``x``'s dtype (exact on the way back)."""
    return _torch_cast(x, dtype).to(x.dtype)


def random_fp32_bits(n: int, seed: int) -> torch.Tensor:
    """``n`` finite fp32 values from uniformly random bit patterns: every exponent, both signs."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n + n // 50 + 1024,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    assert x.numel() >= n, f"only {x.numel()} finite values from {bits.numel()} random bit patterns"
    return x[:n].clone()


def random_fp32_in_range(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """Random fp32 bit patterns whose exponent lies in (or just outside) ``dtype``'s range."""
    fmt = mixprec.get_format(dtype)
    lo = max(fmt.min_exponent - fmt.mantissa_bits - 3 + 127, 0)
    hi = min(fmt.max_exponent + 2 + 127, 254)
    g = torch.Generator().manual_seed(seed)
    exponent_field = torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.int64)
    mantissa = torch.randint(0, 2**23, (n,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64)
    bits = (sign << 31) | (exponent_field << 23) | mantissa
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32).clone()


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of a 8- or 16-bit ``dtype``, as a tensor of that dtype (NaN/inf included)."""
    bits = torch.finfo(dtype).bits
    if bits == 8:
        return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype)
    assert bits == 16
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


def _next_f32(x: torch.Tensor, toward: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, toward))


def hard_cases_fp32(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Named groups of fp32 inputs at which a cast into ``dtype`` is easy to get wrong."""
    values = all_values(dtype).float()
    finite = values[torch.isfinite(values)]
    positive = torch.unique(finite.abs()).double()  # sorted, 0.0 included
    assert positive[0] == 0.0
    top, below_top = positive[-1], positive[-2]
    mids64 = (positive[:-1] + positive[1:]) / 2  # exact in float64
    mids = mids64.float()
    assert torch.equal(mids.double(), mids64), "a midpoint is not exactly representable in fp32"
    ties = torch.cat([mids, -mids])
    tiny = torch.finfo(dtype).tiny
    subnormals = finite[(finite > 0) & (finite < tiny)]
    sub_mids = ties[ties.abs() < tiny]
    threshold64 = top + (top - below_top) / 2  # max + half an ulp of the top binade
    threshold = threshold64.float()
    assert threshold.double() == threshold64
    edge = torch.stack(
        [
            top.float(),
            _next_f32(top.float(), 0.0),
            _next_f32(top.float(), float("inf")),
            threshold,
            _next_f32(threshold, 0.0),
            _next_f32(threshold, float("inf")),
            torch.tensor(torch.finfo(torch.float32).max),
            torch.tensor(2.0**127),
        ]
    )
    return {
        "representable": finite,
        "ties": ties,
        "ties_minus_ulp32": _next_f32(ties, 0.0),
        "ties_plus_ulp32": _next_f32(ties, float("inf")),
        "subnormals": torch.cat([subnormals, -subnormals]),
        "subnormal_ties": torch.cat([sub_mids, _next_f32(sub_mids, 0.0), _next_f32(sub_mids, float("inf"))]),
        "overflow_edge": torch.cat([edge, -edge]),
        "zeros": torch.tensor([0.0, -0.0]),
    }


# --------------------------------------------------------------------------------------------- fp32


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_format_constants_match_torch_finfo(dtype: torch.dtype) -> None:
    fmt = mixprec.get_format(dtype)
    info = torch.finfo(dtype)
    assert fmt.torch_dtype == dtype
    assert fmt.max == info.max, f"{fmt}.max={fmt.max} but torch.finfo says {info.max}"
    assert fmt.min_normal == info.tiny, f"{fmt}.min_normal={fmt.min_normal} but finfo.tiny={info.tiny}"
    assert fmt.eps == info.eps, f"{fmt}.eps={fmt.eps} but finfo.eps={info.eps}"
    assert fmt.min_subnormal == info.tiny * info.eps, f"{fmt}.min_subnormal={fmt.min_subnormal}"
    values = all_values(dtype).float()
    finite = values[torch.isfinite(values)]
    positive = torch.unique(finite.abs()).double()
    threshold = float(positive[-1] + (positive[-1] - positive[-2]) / 2)
    assert fmt.overflow_threshold == threshold, f"{fmt}.overflow_threshold={fmt.overflow_threshold}"
    assert fmt.min_subnormal == float(positive[1]), f"{fmt}.min_subnormal != smallest positive value"
    assert fmt.has_inf == bool(torch.isinf(values).any())


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_fp32_random_bit_patterns_match_torch_cast(dtype: torch.dtype) -> None:
    seed = 1000 + TORCH_DTYPES.index(dtype)
    x = torch.cat([random_fp32_bits(N_RANDOM, seed), random_fp32_in_range(dtype, N_RANDOM // 4, seed)])
    assert x.numel() >= N_RANDOM and bool(torch.isfinite(x).all())
    want = _torch_reference(x, dtype)
    assert not torch.isnan(want).any(), "torch produced NaN from finite input"
    got = mixprec.quantize(x, dtype)
    assert_same_bits(got, want, x, f"quantize(random fp32, {dtype})")
    # The same through the format's name and through the Format object.
    fmt = mixprec.get_format(dtype)
    assert_same_bits(mixprec.quantize(x, fmt.name), want, x, f"quantize(random fp32, {fmt.name!r})")
    # Saturating: PyTorch's result with its infinities replaced by ±max.
    want_sat = torch.where(torch.isinf(want), torch.copysign(torch.tensor(fmt.max), want), want)
    got_sat = mixprec.quantize(x, dtype, saturate=True)
    assert_same_bits(got_sat, want_sat, x, f"quantize(random fp32, {dtype}, saturate=True)")


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_fp32_hard_cases_match_torch_cast(dtype: torch.dtype) -> None:
    groups = hard_cases_fp32(dtype)
    fmt = mixprec.get_format(dtype)
    assert groups["subnormals"].numel() == 2 * (2**fmt.mantissa_bits - 1)
    for name, x in groups.items():
        assert x.numel() > 0, name
        assert torch.isfinite(x).all(), name
        want = _torch_reference(x, dtype)
        assert not torch.isnan(want).any(), f"{name}: torch produced NaN from finite input"
        assert_same_bits(mixprec.quantize(x, dtype), want, x, f"quantize({name}, {dtype})")
    # Representable values come back unchanged, and ties really are ties (the result is even).
    rep = groups["representable"]
    assert_same_bits(mixprec.quantize(rep, dtype), rep, rep, f"representable values of {dtype}")
    # The overflow edge, spelled out: [max, below max, above max, threshold, below it, above it, ...].
    edge = groups["overflow_edge"]
    q = mixprec.quantize(edge, dtype)
    overflowed = float("inf") if fmt.has_inf else fmt.max
    expected = [fmt.max, fmt.max, fmt.max, overflowed, fmt.max, overflowed, overflowed]
    assert q[:7].tolist() == expected, f"overflow edge {edge[:7].tolist()} -> {q[:7].tolist()}"


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_fp32_specials_match_torch_cast(dtype: torch.dtype) -> None:
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, -inf, nan, -nan, 0.0, -0.0, 1.0, -1.0])
    nan_bits = torch.tensor([0x7FC00001, 0x7F800001, -0x00400000, -1], dtype=torch.int32)  # quiet/signal
    x = torch.cat([x, nan_bits.view(torch.float32)])
    want = _torch_reference(x, dtype)
    got = mixprec.quantize(x, dtype)
    assert_same_bits(got, want, x, f"quantize(inf/nan, {dtype})")
    assert torch.isnan(got[2:4]).all() and torch.isnan(got[8:]).all(), f"NaN must stay NaN: {got}"
    fmt = mixprec.get_format(dtype)
    expected_inf = inf if fmt.has_inf else fmt.max
    assert got[0].item() == expected_inf and got[1].item() == -expected_inf, f"±inf -> {got[:2]}"
    got_sat = mixprec.quantize(x, dtype, saturate=True)
    assert got_sat[0].item() == fmt.max and got_sat[1].item() == -fmt.max, f"saturate: ±inf -> {got_sat[:2]}"
    assert torch.isnan(got_sat[2:4]).all(), f"saturate must keep NaN: {got_sat}"


# --------------------------------------------------------------------------------------------- 16-bit inputs


@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16], ids=["from_fp16", "from_bf16"])
@pytest.mark.parametrize("target", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["fp8_e4m3", "fp8_e5m2"])
def test_16bit_inputs_to_fp8_match_torch_cast(source: torch.dtype, target: torch.dtype) -> None:
    x16 = all_values(source)
    assert x16.numel() == 65536
    via_fp8 = _torch_cast(x16.float(), target)
    want = via_fp8.to(source)
    # The fp8 values are all representable in the 16-bit dtype, so the comparison is meaningful.
    assert_same_bits(want.float(), via_fp8.float(), x16, f"fp8 {target} values representable in {source}")
    got = mixprec.quantize(x16, target)
    assert got.dtype == source, f"quantize kept dtype {got.dtype}, expected {source}"
    assert_same_bits(got, want, x16, f"quantize(all {source} values, {target})")


@pytest.mark.parametrize(
    ("source", "target"),
    [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["fp16_to_bf16", "bf16_to_fp16"],
)
def test_16bit_cross_casts_round_twice(source: torch.dtype, target: torch.dtype) -> None:
    """A 16-bit input quantized to the other 16-bit format is rounded once more into its own dtype."""
    x16 = all_values(source)
    got = mixprec.quantize(x16, target)
    assert got.dtype == source
    want = x16.float().to(target).to(source)
    assert_same_bits(got, want, x16, f"quantize(all {source} values, {target})")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_16bit_inputs_to_own_format_are_unchanged(dtype: torch.dtype) -> None:
    x16 = all_values(dtype)
    got = mixprec.quantize(x16, dtype)
    assert_same_bits(got, x16, x16, f"quantize(all {dtype} values, {dtype})")
    assert_same_bits(mixprec.quantize(x16, "fp32"), x16, x16, f"quantize(all {dtype} values, fp32)")


# --------------------------------------------------------------------------------------------- fp64 inputs


def random_fp64(n: int, seed: int) -> np.ndarray:
    """Random doubles with exponents in [-160, 135]: fp16 and fp32 subnormals and fp32 overflow included."""
    rng = np.random.default_rng(seed)
    mantissa = rng.integers(0, 2**52, size=n, dtype=np.int64)
    exponent = rng.integers(-160, 136, size=n)
    sign = np.where(rng.integers(0, 2, size=n) == 1, -1.0, 1.0)
    return sign * np.ldexp(1.0 + mantissa.astype(np.float64) * 2.0**-52, exponent)


def _with_fp64_neighbours(x: np.ndarray) -> np.ndarray:
    x = np.concatenate([x, -x])
    return np.concatenate([x, np.nextafter(x, -np.inf), np.nextafter(x, np.inf)])


def fp16_ties_fp64() -> np.ndarray:
    """Every fp16 midpoint and overflow edge, exactly in float64, and one fp64 ulp either side.

    Just above a tie, fp64 -> fp32 -> fp16 rounds the wrong way; a correct cast must not.
    """
    values = all_values(torch.float16).double().numpy()
    positive = np.unique(np.abs(values[np.isfinite(values)]))
    mids = (positive[:-1] + positive[1:]) / 2
    return _with_fp64_neighbours(np.concatenate([mids, [65504.0, 65520.0, 65536.0]]))


def fp32_ties_fp64(n: int, seed: int) -> np.ndarray:
    """Midpoints between random consecutive fp32 values (subnormals included), with fp64 neighbours."""
    x = random_fp32_bits(n, seed).abs()
    x = torch.cat([x, torch.arange(0, 4096, dtype=torch.int32).view(torch.float32)])  # fp32 subnormals
    up = _next_f32(x, float("inf"))
    keep = torch.isfinite(up)
    mids = (x[keep].double() + up[keep].double()) / 2  # exact
    fp32_max = float(torch.finfo(torch.float32).max)
    edge = np.array([fp32_max, fp32_max + 2.0**103, 2.0**128])  # max, overflow threshold, 2**128
    return _with_fp64_neighbours(np.concatenate([mids.numpy(), edge]))


def _round_to_odd_fp32(x: np.ndarray) -> np.ndarray:
    """fp64 -> fp32 rounding to odd: truncate, then set the last bit if anything was lost."""
    with np.errstate(over="ignore"):
        r = x.astype(np.float32)
    too_big = np.abs(r.astype(np.float64)) > np.abs(x)
    r = np.where(too_big, np.nextafter(r, np.float32(0)), r)
    inexact = r.astype(np.float64) != x
    bits = r.view(np.int32) | inexact.astype(np.int32)
    return bits.view(np.float32)


def fp64_cases() -> np.ndarray:
    x = np.concatenate(
        [
            random_fp64(N_RANDOM_FP64, 2024),
            fp16_ties_fp64(),
            fp32_ties_fp64(20_000, 7),
            np.array([0.0, -0.0, np.inf, -np.inf, np.nan]),
        ]
    )
    return x


def test_fp64_inputs_match_numpy_fp16_and_fp32_casts() -> None:
    x = fp64_cases()
    assert x.size >= N_RANDOM_FP64
    xt = torch.from_numpy(x)
    with np.errstate(over="ignore"):
        want16 = torch.from_numpy(x.astype(np.float16).astype(np.float64))
        want32 = torch.from_numpy(x.astype(np.float32).astype(np.float64))
    got16 = mixprec.quantize(xt, "fp16")
    assert got16.dtype == torch.float64
    assert_same_bits(got16, want16, xt, "quantize(fp64, fp16) vs numpy astype(float16)")
    got32 = mixprec.quantize(xt, "fp32")
    assert got32.dtype == torch.float64
    assert_same_bits(got32, want32, xt, "quantize(fp64, fp32) vs numpy astype(float32)")


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_fp64_inputs_match_correctly_rounded_reference(dtype: torch.dtype) -> None:
    x = fp64_cases()
    odd = torch.from_numpy(_round_to_odd_fp32(x))
    want = _torch_cast(odd, dtype).double()
    xt = torch.from_numpy(x)
    assert_same_bits(mixprec.quantize(xt, dtype), want, xt, f"quantize(fp64, {dtype}) vs round-to-odd ref")


def test_round_to_odd_reference_agrees_with_numpy_fp16() -> None:
    """Sanity check of the reference used above, where NumPy offers a direct cast."""
    x = fp64_cases()
    with np.errstate(over="ignore"):
        numpy16 = torch.from_numpy(x.astype(np.float16).astype(np.float64))
    ref = torch.from_numpy(_round_to_odd_fp32(x)).to(torch.float16).double()
    xt = torch.from_numpy(x)
    assert_same_bits(ref, numpy16, xt, "round-to-odd reference vs numpy float16")


# --------------------------------------------------------------------------------------------- generic formats


@pytest.mark.parametrize(
    ("name", "exponent_bits", "mantissa_bits", "has_inf"),
    [
        ("fp16", 5, 10, True),
        ("bf16", 8, 7, True),
        ("tf32", 8, 10, True),
        ("fp8_e5m2", 5, 2, True),
        ("fp8_e4m3", 4, 3, False),
    ],
)
def test_generic_format_matches_named_format(name: str, exponent_bits: int, mantissa_bits: int, has_inf: bool) -> None:
    named = mixprec.get_format(name)
    alias = f"e{exponent_bits}m{mantissa_bits}"
    assert mixprec.get_format(alias) == named, f"{alias!r} should name {name}"
    generic = mixprec.Format(
        name=f"generic_{alias}", exponent_bits=exponent_bits, mantissa_bits=mantissa_bits, has_inf=has_inf
    )
    assert generic.torch_dtype is None
    for prop in ("bias", "min_exponent", "max_exponent", "max", "min_normal", "min_subnormal", "eps"):
        assert getattr(generic, prop) == getattr(named, prop), prop
    assert generic.overflow_threshold == named.overflow_threshold
    x32 = random_fp32_bits(200_000, 99)
    x64 = torch.from_numpy(fp64_cases())
    inputs = [x32, x64]
    if named.torch_dtype is not None:
        inputs += list(hard_cases_fp32(named.torch_dtype).values())
    for x in inputs:
        for kwargs in ({}, {"saturate": True}):
            assert_same_bits(
                mixprec.quantize(x, generic, **kwargs),
                mixprec.quantize(x, named, **kwargs),
                x,
                f"quantize(x[{x.dtype}], {generic.name}, {kwargs}) vs {name}",
            )


# --------------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=DTYPE_IDS)
def test_cuda_random_bit_patterns_match_torch_cast(dtype: torch.dtype) -> None:
    seed = 2000 + TORCH_DTYPES.index(dtype)
    x_cpu = torch.cat([random_fp32_bits(N_RANDOM, seed), random_fp32_in_range(dtype, N_RANDOM // 4, seed)])
    x = x_cpu.cuda()
    got = mixprec.quantize(x, dtype)
    assert got.device == x.device
    assert_same_bits(got, _torch_reference(x, dtype), x, f"quantize(random fp32 on cuda, {dtype})")
    assert_same_bits(got, _torch_reference(x_cpu, dtype), x_cpu, f"cuda quantize vs CPU cast, {dtype}")
    for name, hard in hard_cases_fp32(dtype).items():
        hard = hard.cuda()
        assert_same_bits(mixprec.quantize(hard, dtype), _torch_reference(hard, dtype), hard, f"cuda {name}, {dtype}")
