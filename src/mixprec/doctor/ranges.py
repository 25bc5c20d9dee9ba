"""Where a tensor's values fall against the range of each float format, counted on the device.

For each format: how many values would round to zero (underflow), to a subnormal, or overflow
(to inf, or to ``max`` for saturating formats) if the tensor were cast to it with round-to-nearest-even.
The thresholds are exact: a magnitude ``a`` (as FP32)

    underflows     when 0 < a <= min_subnormal / 2          (the tie rounds to the even zero)
    is subnormal   when min_subnormal / 2 < a < min_normal - min_subnormal / 2
    overflows      when a >= overflow_threshold (max + half an ulp), finite

A log2-magnitude histogram counts the finite non-zero values per binade: bin ``e`` holds
``2**e <= a < 2**(e + 1)``; the lowest bin (-127) also holds FP32's subnormals.

One ``bucketize`` against every threshold and two ``bincount`` passes (buckets, binades) give all
counts, so the cost is a handful of passes whatever the number of formats. Nothing here
synchronizes with the host.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mixprec.numerics.formats import Format, get_format
from mixprec.numerics.quantize import round_to

__all__ = ["COUNT_FIELDS", "HISTOGRAM_HIGH", "HISTOGRAM_LOW", "RangeCounts", "format_thresholds", "range_counts"]

HISTOGRAM_LOW = -127  # FP32's smallest normal binade is 2**-126; the bin below holds its subnormals
HISTOGRAM_HIGH = 128  # FP32's largest binade is 2**127
_BINS = HISTOGRAM_HIGH - HISTOGRAM_LOW
COUNT_FIELDS = ("values", "zeros", "nonfinite")  # then underflow, subnormal, overflow per format


@dataclass(frozen=True)
class RangeCounts:
    """Device tensors: ``counts`` (int64: values, zeros, non-finite, then underflow, subnormal and
    overflow per format), ``amax`` (largest finite magnitude, FP32) and ``histogram`` (int64 per binade)."""

    counts: torch.Tensor
    amax: torch.Tensor
    histogram: torch.Tensor


def format_thresholds(fmt: Format) -> tuple[float, float, float]:
    """(underflow at or below, subnormal below, overflow at or above) for magnitudes, exact in FP32."""
    half_sub = fmt.min_subnormal / 2
    return half_sub, fmt.min_normal - half_sub, fmt.overflow_threshold


@functools.lru_cache(maxsize=32)
def _boundaries(formats: tuple[str, ...]) -> tuple[list[float], list[tuple[int, int, int]]]:
    """Sorted FP32 bucket boundaries (every condition as ``a <= b``) and, per format, the bucket
    indices of its underflow, subnormal and overflow limits."""

    def below(value: float) -> float:  # the largest FP32 number < value: "a < value" as "a <= below"
        v = torch.tensor(value, dtype=torch.float32)
        return torch.nextafter(v, torch.zeros_like(v)).item()

    limits = []
    for name in formats:
        under, sub_below, over = format_thresholds(get_format(name))
        limits.append((round_to(under, torch.float32), below(sub_below), below(over)))
    values = sorted({0.0, *(v for triple in limits for v in triple)})
    return values, [tuple(values.index(v) for v in triple) for triple in limits]


def range_counts(tensor: torch.Tensor, formats: tuple[str | Format, ...]) -> RangeCounts:
    """Count ``tensor``'s values against each format's range (see the module docstring)."""
    names = tuple(get_format(f).name for f in formats)
    values, limits = _boundaries(names)
    buckets = len(values) + 1
    magnitudes = tensor.detach().float().abs().flatten()
    boundaries = torch.tensor(values, device=magnitudes.device)
    # bucket i: b[i-1] < a <= b[i]; inf and NaN land in the last bucket
    per_bucket = torch.bincount(torch.bucketize(magnitudes, boundaries, out_int32=True), minlength=buckets)
    binade = magnitudes.view(torch.int32) >> 23  # biased exponent: 0 for zero and subnormals, 255 for inf/NaN
    per_binade = torch.bincount(binade, minlength=256)
    zeros, nonfinite = per_bucket[0], per_binade[255]
    counts = [torch.tensor(magnitudes.numel(), device=magnitudes.device), zeros, nonfinite]
    cumulative = per_bucket.cumsum(0)
    for under, sub, over in limits:
        counts.append(cumulative[under] - cumulative[0])
        counts.append(cumulative[sub] - cumulative[under])
        counts.append(cumulative[-1] - cumulative[over] - nonfinite)
    histogram = per_binade[:_BINS].clone()
    histogram[0] -= zeros
    finite = torch.where(binade < 255, magnitudes, 0.0)
    amax = finite.amax() if magnitudes.numel() else torch.zeros((), device=magnitudes.device)
    return RangeCounts(torch.stack(counts).long(), amax, histogram)
