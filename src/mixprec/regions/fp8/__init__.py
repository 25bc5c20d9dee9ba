"""FP8 training, emulated exactly on any device: per-tensor scaling, the FP8 GEMM and Linear, the FP8 region.

The recipe (formats, scaling, layers kept out of FP8) is a policy value: :class:`mixprec.policy.Fp8Recipe`.
"""

from mixprec.regions.fp8.fused_cast import compiled_cast_failures, scaled_cast
from mixprec.regions.fp8.gemm import fp8_matmul, scaled_mm_available, scaled_mm_unavailable_reason
from mixprec.regions.fp8.gemm_layers import GemmSelection, KeptLayer, register_gemm_layer, select_gemm_layers
from mixprec.regions.fp8.linear import Fp8LinearState, fp8_linear
from mixprec.regions.fp8.region import Fp8State, fp8_layers, fp8_region, fp8_state, gemm_selection
from mixprec.regions.fp8.scaling import ScaleState, cast_to_fp8, power_of_two_scale
from mixprec.regions.fp8.shape_speed import CACHE_FILE as SHAPE_CACHE_FILE
from mixprec.regions.fp8.shape_speed import CACHE_VERSION as SHAPE_CACHE_VERSION
from mixprec.regions.fp8.shape_speed import ShapeSpeed, shape_key

__all__ = [
    "SHAPE_CACHE_FILE",
    "SHAPE_CACHE_VERSION",
    "Fp8LinearState",
    "Fp8State",
    "GemmSelection",
    "KeptLayer",
    "ScaleState",
    "ShapeSpeed",
    "cast_to_fp8",
    "compiled_cast_failures",
    "fp8_layers",
    "fp8_linear",
    "fp8_matmul",
    "fp8_region",
    "fp8_state",
    "gemm_selection",
    "power_of_two_scale",
    "register_gemm_layer",
    "scaled_cast",
    "scaled_mm_available",
    "scaled_mm_unavailable_reason",
    "select_gemm_layers",
    "shape_key",
]
