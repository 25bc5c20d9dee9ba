"""Float formats, exact emulation of their rounding, and on-device finite checks."""

from mixprec.numerics.block_formats import BLOCK_FORMATS, SCALE_RULES, BlockFormat, quantize_blocks
from mixprec.numerics.finite import kinds_of, magnitudes_not_finite, max_magnitudes, nonfinite_kinds, unscale_and_check_
from mixprec.numerics.formats import FORMATS, Format, get_format
from mixprec.numerics.quantize import ROUNDING_MODES, quantize

__all__ = [
    "BLOCK_FORMATS",
    "FORMATS",
    "ROUNDING_MODES",
    "SCALE_RULES",
    "BlockFormat",
    "Format",
    "get_format",
    "kinds_of",
    "magnitudes_not_finite",
    "max_magnitudes",
    "nonfinite_kinds",
    "quantize",
    "quantize_blocks",
    "unscale_and_check_",
]
