"""FP8 training, emulated exactly on any device: recipes, per-tensor scaling, the FP8 Linear."""

from mixprec.fp8.gemm import fp8_matmul, scaled_mm_available
from mixprec.fp8.linear import Fp8LinearState, fp8_linear
from mixprec.fp8.recipe import AMAX_REDUCTIONS, FP8_FORMATS, GEMM_CHOICES, SCALINGS, Fp8Recipe
from mixprec.fp8.region import Fp8State, fp8_layers, fp8_region, fp8_state
from mixprec.fp8.scaling import ScaleState, cast_to_fp8, power_of_two_scale

__all__ = [
    "AMAX_REDUCTIONS",
    "FP8_FORMATS",
    "GEMM_CHOICES",
    "SCALINGS",
    "Fp8LinearState",
    "Fp8Recipe",
    "Fp8State",
    "ScaleState",
    "cast_to_fp8",
    "fp8_layers",
    "fp8_linear",
    "fp8_matmul",
    "fp8_region",
    "fp8_state",
    "power_of_two_scale",
    "scaled_mm_available",
]
