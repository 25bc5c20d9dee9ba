"""What runs a policy on a model: the policy prepared once (resolved and checked), the casts of parameters,
the low-precision region, the FP32 op list, the FP8 layers, and activation checkpoints that recompute in the region.
"""

from mixprec.regions.autocast import Region, autocast
from mixprec.regions.casting import cast_module, fp32_modules
from mixprec.regions.op_overrides import FP32Ops
from mixprec.regions.plan import ComputePlan, check_device_supports, compute_plan
from mixprec.regions.prepare import Prepared, prepare
from mixprec.regions.recompute import checkpoint, recompute_context

__all__ = [
    "ComputePlan",
    "FP32Ops",
    "Prepared",
    "Region",
    "autocast",
    "cast_module",
    "check_device_supports",
    "checkpoint",
    "compute_plan",
    "fp32_modules",
    "prepare",
    "recompute_context",
]
