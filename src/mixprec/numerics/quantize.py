"""Exact emulation of any float format: the value a tensor would hold after a cast.

Algorithm (vectorised, no per-element Python):
    1. |x| = m * 2**e with m in [0.5, 1)                    (torch.frexp, subnormals included)
    2. the format's ulp at x is 2**q, q = max(e - 1, min_exponent) - mantissa_bits
       (below min_exponent the ulp stops shrinking: that is what subnormals are)
    3. scale |x| by 2**-q (exact: a power of two), round to an integer, scale back (exact again)
    4. magnitudes at or past max + ulp/2 overflow: to inf, or to max when saturating or when the
       format has no inf (fp8_e4m3, as PyTorch's own cast does); NaN stays NaN; the sign is kept,
       -0.0 included.

Round-to-nearest uses ``torch.round`` (half to even), so the result equals PyTorch's casts to
float16, bfloat16, float8_e4m3fn and float8_e5m2 bit for bit on every fp32 input. Stochastic
rounding picks the upper neighbour with probability (|x| - lower) / ulp, which makes it unbiased.

Example:
    >>> import torch
    >>> quantize(torch.tensor([1e-8, 0.1, 70000.0]), "fp16")
    tensor([0.0000e+00, 9.9976e-02,        inf])
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from mixprec.checks import flag, shown
from mixprec.numerics.block_formats import BLOCK_FORMATS, quantize_blocks
from mixprec.numerics.formats import Format, get_format

__all__ = ["ROUNDING_MODES", "quantize"]

ROUNDING_MODES = ("nearest", "stochastic")

# Working dtype per input dtype. 16-bit inputs are widened to fp32, which holds them exactly.
_WORKING = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}
# (mantissa bits, min exponent, max exponent, integer view, exponent-field shift) of each working dtype.
_LAYOUT = {
    torch.float32: (23, -126, 127, torch.int32, 23),
    torch.float64: (52, -1022, 1023, torch.int64, 52),
}


def quantize(
    x: torch.Tensor,
    fmt: str | torch.dtype | Format,
    rounding: str = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
    scale_rule: str = "ocp",
) -> torch.Tensor:
    """Return a tensor of ``x``'s dtype and device holding the values ``x`` would have in ``fmt``.

    Args:
        x: a floating-point tensor (float16, bfloat16, float32 or float64) on any device.
        fmt: the target format: a name (``"fp16"``, ``"e4m3"``, ``"e3m2"``), a torch dtype or a Format; or a
            block-scaled format by name (``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"``, ``"nvfp4"``: blocks
            along the last dimension, :mod:`mixprec.numerics.block_formats`), which saturates; ``rounding``
            applies to its elements (the block scales round to nearest).
        rounding: ``"nearest"`` (round half to even, as hardware casts do) or ``"stochastic"``
            (unbiased: the expected result equals ``x`` inside the representable range).
        saturate: clamp overflowing values (and infinities) to ``±max`` instead of ``±inf`` (``max`` rounded into
            ``x``'s dtype, as every result is: inf where it is past the dtype's range, e9m3's in FP32).
            Formats without inf (fp8_e4m3) always saturate, as ``torch`` does.
        generator: random source for stochastic rounding (ignored for nearest).
        scale_rule: the MX formats' block scale: ``"ocp"`` (the OCP MX v1.0 rule) or ``"ceil"`` (NVIDIA's
            round-up, which never saturates).

    Returns:
        The emulated values. When ``fmt`` is wider than ``x``'s dtype the values are returned
        unchanged; when a 16-bit input is quantized to a format its dtype cannot hold (e.g. a
        bfloat16 tensor to ``e5m12``) the result is rounded once more into that dtype.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: unknown ``fmt`` or ``rounding``.
    """
    _check_arguments(x, rounding, saturate, generator)
    if isinstance(fmt, str) and fmt.strip().lower() in BLOCK_FORMATS:
        return quantize_blocks(x, fmt, scale_rule, rounding, generator)
    if scale_rule != "ocp":
        raise ValueError(f"quantize(scale_rule=...) applies to the MX block formats; fmt={fmt!r} has no block scale.")
    try:
        fmt = get_format(fmt, argument="fmt")
    except ValueError as error:
        raise ValueError(f"{error} quantize also takes the block-scaled formats {', '.join(BLOCK_FORMATS)}.") from None
    working = _WORKING[x.dtype]
    mantissa_bits, min_exponent, max_exponent, _, _ = _LAYOUT[working]
    if fmt.mantissa_bits >= mantissa_bits and fmt.min_exponent <= min_exponent and fmt.max_exponent >= max_exponent:
        # every value of the working dtype is representable in fmt; infinities saturate where asked (or where fmt
        # has none) to its max, rounded into the dtype (inf where that is past the dtype's range)
        limit = round_to(fmt.max, x.dtype)
        return x.clamp(-limit, limit) if (saturate or not fmt.has_inf) else x.clone()
    y = _quantize(x.to(working), fmt, rounding, saturate, generator)
    return y.to(x.dtype)


def _quantize(
    x: torch.Tensor, fmt: Format, rounding: str, saturate: bool, generator: torch.Generator | None
) -> torch.Tensor:
    working_mantissa, working_min_exponent, _, _, _ = _LAYOUT[x.dtype]
    magnitude = x.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    ulp_exponent = (exponent - 1).clamp_(min=fmt.min_exponent) - fmt.mantissa_bits
    # Rounding finer than the working dtype's own smallest step changes nothing; the clamp also
    # keeps 2**-ulp_exponent within range.
    ulp_exponent.clamp_(min=working_min_exponent - working_mantissa)

    scaled = _times_pow2(magnitude, -ulp_exponent)  # exact: a power-of-two scale
    if rounding == "nearest":
        rounded = torch.round(scaled)  # half to even
    else:
        lower = torch.floor(scaled)
        # Round up when u < frac: probability frac, up to the generator's resolution (torch.rand draws
        # multiples of 2**-24 in fp32, 2**-53 in fp64), so the bias is at most that resolution times an ulp.
        # Drawn where the generator lives (a CPU generator for CUDA tensors: one host-to-device copy).
        where = generator.device if generator is not None else scaled.device
        u = torch.rand(scaled.shape, generator=generator, device=where, dtype=scaled.dtype).to(scaled.device)
        rounded = lower + (u < scaled - lower).to(scaled.dtype)
    result = _times_pow2(rounded, ulp_exponent)

    if rounding == "nearest":
        # Decided on the input, so that a tie at max + ulp/2 overflows as in PyTorch's casts.
        overflow = magnitude >= _ceil_to(fmt.overflow_threshold, x.dtype)
    else:
        overflow = (result > _ceil_to(fmt.max, x.dtype)) | torch.isinf(magnitude)
    # a format's max past the working dtype's range (e9m3 in FP32) rounds to inf there, as the dtype holds results
    limit = round_to(fmt.max, x.dtype) if (saturate or not fmt.has_inf) else float("inf")
    result = torch.where(overflow, limit, result)  # no host sync: quantize runs inside training steps
    return torch.copysign(result, x)  # restores the sign, -0.0 included; NaN propagates


def _check_arguments(x: Any, rounding: Any, saturate: Any, generator: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize(x=...) needs a torch.Tensor; received an object of type {type(x).__name__}.")
    if x.dtype not in _WORKING:
        raise TypeError(
            f"quantize(x=...) needs a floating-point tensor (float16, bfloat16, float32 or float64); "
            f"received dtype {x.dtype}. Convert first, e.g. x.float()."
        )
    if rounding not in ROUNDING_MODES:
        raise ValueError(
            f"quantize(rounding=...): received {rounding!r}; use one of {', '.join(map(repr, ROUNDING_MODES))}."
        )
    flag(saturate, "quantize(saturate=...)")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"quantize(generator=...) needs a torch.Generator or None; received {shown(generator)}.")


def _times_pow2(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x * 2**exponent, exactly, in two steps so that neither factor over- or underflows."""
    half = torch.div(exponent, 2, rounding_mode="floor")
    return x * _pow2(half, x.dtype) * _pow2(exponent - half, x.dtype)


def _pow2(exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**exponent for integer exponents in the normal range, built from its bit pattern.

    Exact by construction; ``torch.exp2`` and ``torch.pow`` are not guaranteed to be.
    """
    _, _, max_exponent, int_dtype, shift = _LAYOUT[dtype]
    biased = exponent.to(int_dtype) + max_exponent
    return torch.bitwise_left_shift(biased, shift).view(dtype)


# A format's limits in the working dtype, on the host with no tensor and no numpy state: quantize runs inside
# training steps, which torch.compile traces, and these fold to constants there (a tensor's .item() broke the
# graph of a compiled MXFP8 step; numpy's errstate is refused inside an FP8 layer's autograd function).
_FP32_MAX = (2 - 2**-23) * 2**127
_FP32_ROUNDS_TO_INF = _FP32_MAX + 2**103  # max + half its unit: from here (a tie rounds to even) to inf


def round_to(value: float, dtype: torch.dtype) -> float:
    """``value`` (positive) rounded to nearest even into ``dtype`` (inf past its range), on the host: the one
    rounding of a Python float to a dtype (a loss scale held in FP32, the doctor's FP32 bucket bounds)."""
    if dtype == torch.float64:
        return value
    if dtype == torch.float32:
        return math.inf if value >= _FP32_ROUNDS_TO_INF else _fp32(value)
    return torch.tensor(value, dtype=torch.float64).to(dtype).item()  # a 16-bit input given a format wider than it


def _ceil_to(value: float, dtype: torch.dtype) -> float:
    """The smallest ``dtype`` number >= ``value`` (positive), so that tensor comparisons against it are exact."""
    if dtype == torch.float64:
        return value
    if value > _FP32_MAX:
        return math.inf
    rounded = _fp32(value)
    if rounded < value:  # the next FP32 number up: the bit pattern's successor (positive, finite)
        rounded = struct.unpack("<f", struct.pack("<I", struct.unpack("<I", struct.pack("<f", rounded))[0] + 1))[0]
    return rounded


def _fp32(value: float) -> float:
    """``value`` (within FP32's range) rounded to nearest even into FP32: C's conversion, through ``struct``."""
    return struct.unpack("<f", struct.pack("<f", value))[0]
