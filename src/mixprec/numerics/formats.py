"""Floating-point formats as values: bits, range, precision, and how to name them.

A format is fully described by its exponent bits ``E``, mantissa bits ``M`` and whether the top
exponent is reserved for inf/NaN (IEEE) or used for finite values (the OCP ``fn`` variant of
fp8_e4m3, which keeps only the all-ones pattern for NaN and has no infinities).
Everything else follows:

    bias        = 2**(E-1) - 1
    min_normal  = 2**(1 - bias)
    min_subnormal = 2**(1 - bias - M)
    eps         = 2**-M                          (gap between 1 and the next value)
    max (IEEE)  = (2 - 2**-M) * 2**(2**E - 2 - bias)
    max (fn)    = (2 - 2**(1-M)) * 2**(2**E - 1 - bias)

Example:
    >>> get_format("half").max
    65504.0
    >>> get_format("e4m3").has_inf
    False
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = ["FORMATS", "Format", "get_format"]

# Generic "eXmY" formats are emulated in float64 at most, so they may not be wider than it.
_MIN_EXPONENT_BITS, _MAX_EXPONENT_BITS = 2, 11
_MAX_MANTISSA_BITS = 52


@dataclass(frozen=True)
class Format:
    """A binary floating-point format with a sign bit, ``exponent_bits`` and ``mantissa_bits``.

    Args:
        name: canonical name, e.g. ``"fp16"`` or ``"e3m2"``.
        exponent_bits: width of the exponent field (2..11).
        mantissa_bits: stored fraction bits, without the implicit leading one (0..52).
        has_inf: IEEE semantics when True; when False (fp8_e4m3, OCP "fn") the top exponent holds
            finite values, only the all-ones pattern is NaN, and overflow saturates to ``max``.
        torch_dtype: the matching ``torch.dtype`` where PyTorch has one (tf32 and generic formats: None).
        finite: every bit pattern is a finite number, no inf and no NaN (OCP's FP4 e2m1, the elements of
            MXFP4 and NVFP4): ``max`` uses the whole top binade; needs ``has_inf=False``.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool = True
    torch_dtype: torch.dtype | None = None
    finite: bool = False

    def __post_init__(self) -> None:
        for name in ("exponent_bits", "mantissa_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Format({name}=...): received {value!r}; use a whole number of bits.")
        if not _MIN_EXPONENT_BITS <= self.exponent_bits <= _MAX_EXPONENT_BITS:
            raise ValueError(
                f"Format(exponent_bits=...): received {self.exponent_bits!r}; "
                f"use {_MIN_EXPONENT_BITS}..{_MAX_EXPONENT_BITS} exponent bits."
            )
        if not 0 <= self.mantissa_bits <= _MAX_MANTISSA_BITS:
            raise ValueError(
                f"Format(mantissa_bits=...): received {self.mantissa_bits!r}; "
                f"use 0..{_MAX_MANTISSA_BITS} mantissa bits."
            )
        if self.finite and self.has_inf:
            raise ValueError("Format(finite=True) has no inf: pass has_inf=False.")
        if not self.has_inf and not self.finite and self.mantissa_bits < 1:
            raise ValueError("Format(has_inf=False) needs at least one mantissa bit to encode NaN.")

    def __str__(self) -> str:
        return self.name

    @property
    def total_bits(self) -> int:
        """Sign + exponent + mantissa bits (tf32 counts its 19 significant bits)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def min_exponent(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def max_exponent(self) -> int:
        """Exponent of the largest finite number."""
        reserved = 2 if self.has_inf else 1  # IEEE keeps the all-ones exponent for inf/NaN
        return 2**self.exponent_bits - reserved - self.bias

    @property
    def max(self) -> float:
        # The "fn" layout loses only the all-ones mantissa of the top binade (NaN), so max ends in ...10.
        # A finite-only format (e2m1) uses every pattern of it.
        top_mantissa_gap = 2.0**-self.mantissa_bits if self.has_inf or self.finite else 2.0 ** (1 - self.mantissa_bits)
        return math.ldexp(2.0 - top_mantissa_gap, self.max_exponent)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.min_exponent)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.min_exponent - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Distance from 1.0 to the next larger representable number."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: log10(2**(mantissa_bits + 1))."""
        return (self.mantissa_bits + 1) * math.log10(2.0)

    @property
    def overflow_threshold(self) -> float:
        """max + half an ulp of the top binade: magnitudes at or above it overflow (to inf, or to ``max``
        when saturating), as in PyTorch's casts; below it they round to a finite value."""
        return self.max + math.ldexp(1.0, self.max_exponent - self.mantissa_bits - 1)

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether training in this format usually needs loss scaling.

        Formats with fewer exponent bits than FP32 cannot hold the tiny gradients of deep networks
        (fp16's smallest subnormal is 6e-8); bf16 and tf32 keep FP32's 8 exponent bits and do not.
        """
        return self.exponent_bits < 8


def _named(name: str, e: int, m: int, dtype: torch.dtype | None, has_inf: bool = True) -> Format:
    return Format(name=name, exponent_bits=e, mantissa_bits=m, has_inf=has_inf, torch_dtype=dtype)


FORMATS: MappingProxyType[str, Format] = MappingProxyType(
    {
        "fp64": _named("fp64", 11, 52, torch.float64),
        "fp32": _named("fp32", 8, 23, torch.float32),
        "tf32": _named("tf32", 8, 10, None),
        "fp16": _named("fp16", 5, 10, torch.float16),
        "bf16": _named("bf16", 8, 7, torch.bfloat16),
        "fp8_e4m3": _named("fp8_e4m3", 4, 3, torch.float8_e4m3fn, has_inf=False),
        "fp8_e5m2": _named("fp8_e5m2", 5, 2, torch.float8_e5m2),
        # OCP FP4: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; the elements of MXFP4 and NVFP4
        "fp4_e2m1": Format("fp4_e2m1", 2, 1, has_inf=False, finite=True),
    }
)

# Common spellings; lookups are case-insensitive and accept a "torch." prefix.
_ALIASES: dict[str, str] = {
    **{alias: "fp64" for alias in ("float64", "double", "f64", "e11m52")},
    **{alias: "fp32" for alias in ("float32", "float", "single", "f32", "e8m23")},
    **{alias: "tf32" for alias in ("tensorfloat32", "e8m10")},
    **{alias: "fp16" for alias in ("float16", "half", "f16", "e5m10")},
    **{alias: "bf16" for alias in ("bfloat16", "e8m7")},
    **{alias: "fp8_e4m3" for alias in ("e4m3", "e4m3fn", "float8_e4m3fn", "fp8e4m3", "f8e4m3")},
    **{alias: "fp8_e5m2" for alias in ("e5m2", "float8_e5m2", "fp8e5m2", "f8e5m2")},
    **{alias: "fp4_e2m1" for alias in ("fp4", "float4_e2m1", "float4_e2m1fn")},  # bare "e2m1" stays IEEE, as every eXmY
}
_BY_DTYPE = {fmt.torch_dtype: fmt for fmt in FORMATS.values() if fmt.torch_dtype is not None}
_GENERIC = re.compile(r"e(\d+)m(\d+)")


def valid_format_names() -> str:
    """The accepted names, for error messages."""
    return (
        f"{', '.join(FORMATS)} (also {', '.join(sorted(_ALIASES))}), or any 'eXmY' such as 'e3m2' "
        f"with {_MIN_EXPONENT_BITS} <= X <= {_MAX_EXPONENT_BITS} and 0 <= Y <= {_MAX_MANTISSA_BITS}"
    )


def get_format(name: str | torch.dtype | Format, *, argument: str = "name") -> Format:
    """Return the :class:`Format` for a name, a floating ``torch.dtype`` or a Format.

    Example:
        >>> get_format("torch.bfloat16") == get_format(torch.bfloat16) == FORMATS["bf16"]
        True
        >>> get_format("e3m2").max
        14.0

    Args:
        name: a canonical name (``fp16``), an alias (``half``, ``float16``, ``torch.float16``, ``e4m3``),
            any ``eXmY`` string with IEEE semantics, a floating torch dtype, or a Format.
        argument: the caller's argument name, used in error messages.

    Raises:
        TypeError: ``name`` is not a str, torch.dtype or Format.
        ValueError: unknown name, or a dtype that is not a floating-point format.
    """
    if isinstance(name, Format):
        return name
    if isinstance(name, torch.dtype):
        if name in _BY_DTYPE:
            return _BY_DTYPE[name]
        raise ValueError(
            f"{argument}={name} is not a supported floating-point dtype; "
            f"use one of {', '.join(str(d) for d in _BY_DTYPE)}."
        )
    if not isinstance(name, str):
        raise TypeError(
            f"{argument} must be a format name, torch.dtype or mixprec.Format; "
            f"received {name!r} (of type {type(name).__name__})."
        )
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    match = _GENERIC.fullmatch(key)
    if match:
        exponent_bits, mantissa_bits = int(match.group(1)), int(match.group(2))
        if _MIN_EXPONENT_BITS <= exponent_bits <= _MAX_EXPONENT_BITS and 0 <= mantissa_bits <= _MAX_MANTISSA_BITS:
            return Format(name=key, exponent_bits=exponent_bits, mantissa_bits=mantissa_bits)
    raise ValueError(f"{argument}={name!r} is not a known float format. Valid names: {valid_format_names()}.")
