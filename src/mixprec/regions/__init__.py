"""What runs a policy on a model: the casts of parameters, the low-precision region, the FP32 op list,
the FP8 layers, and activation checkpoints that recompute in the region.
"""

from mixprec.regions.autocast import Region, autocast, check_device_supports
from mixprec.regions.casting import cast_module, fp32_modules
from mixprec.regions.op_overrides import FP32Ops
from mixprec.regions.recompute import checkpoint, recompute_context

__all__ = [
    "FP32Ops",
    "Region",
    "autocast",
    "cast_module",
    "check_device_supports",
    "checkpoint",
    "fp32_modules",
    "recompute_context",
]
