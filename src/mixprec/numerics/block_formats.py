"""Block-scaled formats, emulated exactly: OCP microscaling (MXFP8, MXFP4) and NVIDIA's NVFP4.

Each block of consecutive values along the last dimension shares one scale; the elements are stored in a
narrow float format. :func:`quantize_blocks` returns the values a tensor would hold after the round trip
(quantize, then dequantize), in the input's dtype and shape:

    format       elements            block   scale
    mxfp8_e4m3   fp8_e4m3 (max 448)    32    E8M0: a power of two, 2**-127 .. 2**127
    mxfp8_e5m2   fp8_e5m2 (max 57344)  32    E8M0
    mxfp4        fp4_e2m1 (max 6)      32    E8M0
    nvfp4        fp4_e2m1              16    an fp8_e4m3 scale per block, times an FP32 scale per tensor

MX scale (OCP Microscaling Formats v1.0, section 6.3), ``scale_rule="ocp"`` (default):
    X = 2**(floor(log2(amax)) - emax), emax the exponent of the element format's largest normal (e4m3 8,
    e5m2 15, e2m1 2); elements = round_to_nearest_even(v / X), saturated at the element format's max;
    a block of zeros stays zero; a block holding inf or NaN becomes NaN (its scale is NaN).
``scale_rule="ceil"`` (NVIDIA's choice for MXFP8 in cuBLAS and Transformer Engine): X = 2**ceil(log2(amax /
max)), the smallest power of two under which nothing saturates. The exponent is clamped to E8M0's range.
All of it is exact: scales are powers of two, applied in float64.

``rounding="stochastic"`` rounds the elements stochastically (unbiased, :func:`mixprec.quantize`'s rule) under the
same block scales, which are always computed from the amax as above: what FP4 training recipes do to
gradients.

NVFP4, in FP32 arithmetic in this order (NVIDIA's two-level recipe; torchao 0.18's per-tensor-scaled NVFP4 gives
the same bits on normal-range data, but floors each block's scale at e4m3's smallest normal, 2**-6, and divides by
the product of the scales as two reciprocals, which moves exact ties such as 0.75: tests/differential):
    s_t = amax(|x|) / (448 * 6)                     the tensor's scale, from its finite values (1 if all 0;
                                                    FP32's smallest, 2**-149, where it underflows)
    s_b = e4m3(amax_block / 6 / s_t)                each block's scale, rounded to nearest even, saturating
    q   = e2m1(x / (s_b * s_t))                     the elements (0 where s_b is 0)
    out = q * (s_b * s_t)
A block holding inf or NaN becomes NaN. A last dimension that is not a multiple of the block is padded
with zeros, which change no block's amax.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import torch
import torch.nn.functional as F

from mixprec.numerics.formats import Format, get_format

__all__ = ["BLOCK_FORMATS", "SCALE_RULES", "BlockFormat", "quantize_blocks"]

SCALE_RULES = ("ocp", "ceil")
_E8M0_EXPONENTS = (-127, 127)
_SCALES = ("e8m0", "e4m3")  # a power of two per block (MX); an fp8_e4m3 one times the tensor's FP32 one (NVFP4)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: ``element`` values in blocks of ``block`` along the last dimension, each block
    with a power-of-two scale (``scale="e8m0"``) or an fp8_e4m3 scale times a per-tensor FP32 one
    (``scale="e4m3"``)."""

    name: str
    element: Format
    block: int
    scale: str

    def __post_init__(self) -> None:
        if not isinstance(self.element, Format):
            raise TypeError(
                f"BlockFormat(element=...): needs a mixprec.Format; received {type(self.element).__name__}."
            )
        if isinstance(self.block, bool) or not isinstance(self.block, numbers.Integral) or self.block < 1:
            raise ValueError(f"BlockFormat(block=...): received {self.block!r}; use a positive number of values.")
        if self.scale not in _SCALES:
            raise ValueError(f"BlockFormat(scale=...): received {self.scale!r}; use one of {', '.join(_SCALES)}.")

    @property
    def bits_per_value(self) -> float:
        """Storage per value: the element's bits plus its share of the block's 8-bit scale."""
        return self.element.total_bits + 8 / self.block


BLOCK_FORMATS: MappingProxyType[str, BlockFormat] = MappingProxyType(
    {
        "mxfp8_e4m3": BlockFormat("mxfp8_e4m3", get_format("fp8_e4m3"), 32, "e8m0"),
        "mxfp8_e5m2": BlockFormat("mxfp8_e5m2", get_format("fp8_e5m2"), 32, "e8m0"),
        "mxfp4": BlockFormat("mxfp4", get_format("fp4_e2m1"), 32, "e8m0"),
        "nvfp4": BlockFormat("nvfp4", get_format("fp4_e2m1"), 16, "e4m3"),
    }
)


def quantize_blocks(
    x: torch.Tensor,
    fmt: str | BlockFormat,
    scale_rule: str = "ocp",
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The values ``x`` holds after a round trip through the block format ``fmt`` (see the module docstring),
    in ``x``'s dtype and shape; blocks run along the last dimension. ``rounding`` ("nearest" or "stochastic",
    with ``generator``) applies to the elements."""
    from mixprec.numerics.quantize import quantize as quantize_elements  # the element rounding (imports this module)

    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        received = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else f"an object of type {type(x).__name__}"
        raise TypeError(
            f"quantize_blocks(x=...) needs a floating-point tensor (float16, bfloat16, float32 or float64); received "
            f"{received}. Convert first, e.g. x.float()."
        )
    if isinstance(fmt, str):
        if fmt.strip().lower() not in BLOCK_FORMATS:
            raise ValueError(f"fmt={fmt!r} is not a block format; use one of {', '.join(BLOCK_FORMATS)}.")
        fmt = BLOCK_FORMATS[fmt.strip().lower()]
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule: received {scale_rule!r}; use one of {', '.join(map(repr, SCALE_RULES))}.")
    if scale_rule != "ocp" and fmt.scale != "e8m0":
        raise ValueError(f"scale_rule={scale_rule!r} applies to the MX formats' power-of-two scales, not {fmt.name}.")
    quantize = partial(quantize_elements, rounding=rounding, generator=generator)  # scales round to nearest below
    if x.dim() == 0:
        return quantize_blocks(x.reshape(1), fmt, scale_rule, rounding, generator).reshape(())
    if x.numel() == 0:  # no block (an amax of nothing is undefined, a reshape into blocks ambiguous)
        return x.clone()
    size = x.shape[-1]
    padded = F.pad(x, (0, -size % fmt.block)) if size % fmt.block else x
    blocks = padded.reshape(*padded.shape[:-1], -1, fmt.block)
    if fmt.scale == "e8m0":
        values = _mx(blocks.double(), fmt.element, scale_rule, quantize)
    else:
        values = _nvfp4(blocks.float(), fmt.element, quantize)
    return values.reshape(padded.shape)[..., :size].to(x.dtype)


def _mx(blocks: torch.Tensor, element: Format, scale_rule: str, quantize) -> torch.Tensor:
    """MX round trip in float64: every scale is a power of two, so dividing and multiplying by it is exact."""
    amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN where a block holds one
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    shared = exponent - 1 - element.max_exponent
    if scale_rule == "ceil":  # one more where the OCP scale would saturate the block's amax
        shared = shared + (amax > torch.ldexp(torch.full_like(amax, element.max), shared)).to(shared.dtype)
    shared = shared.clamp(*_E8M0_EXPONENTS)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    scale = torch.where(torch.isfinite(amax), scale, math.nan)  # inf or NaN in a block: the whole block NaN
    return quantize(blocks / scale, element, saturate=True) * scale


def _nvfp4(blocks: torch.Tensor, element: Format, quantize) -> torch.Tensor:
    """NVFP4 round trip in FP32, in the module docstring's order."""
    e4m3 = get_format("fp8_e4m3")
    magnitudes = blocks.abs()
    tensor_amax = torch.where(torch.isfinite(magnitudes), magnitudes, 0.0).amax()  # of the finite values
    # an amax below 2688 * 2**-149 underflows to a scale of 0, which made every block NaN (0 / 0): the smallest
    tensor_scale = torch.where(tensor_amax > 0, (tensor_amax / (e4m3.max * element.max)).clamp(min=2**-149), 1.0)
    block_amax = magnitudes.amax(dim=-1, keepdim=True)
    block_scale = quantize(block_amax / element.max / tensor_scale, e4m3, saturate=True, rounding="nearest")
    block_scale = torch.where(torch.isfinite(block_amax), block_scale, math.nan)  # inf or NaN: the block NaN
    denominator = block_scale * tensor_scale
    safe = torch.where(denominator > 0, denominator, 1.0)
    # a block of scale 0 (all zero, or its scale below e4m3's): zeros of the values' signs (-0.0 stays -0.0)
    elements = quantize(torch.where(denominator > 0, blocks / safe, blocks * 0.0), element, saturate=True)
    return elements * denominator
