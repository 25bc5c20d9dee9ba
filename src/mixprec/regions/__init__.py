"""What runs a policy on a model: the casts of parameters, the low-precision region, the FP32 op list,
and the FP8 layers.
"""

from mixprec.regions.autocast import Region, autocast, check_device_supports
from mixprec.regions.casting import cast_module, fp32_modules
from mixprec.regions.op_overrides import FP32Ops

__all__ = ["FP32Ops", "Region", "autocast", "cast_module", "check_device_supports", "fp32_modules"]
