"""Float formats, exact emulation of their rounding, and on-device finite checks."""

from mixprec.numerics.formats import FORMATS, Format, get_format
from mixprec.numerics.quantize import ROUNDING_MODES, quantize

__all__ = ["FORMATS", "ROUNDING_MODES", "Format", "get_format", "quantize"]
