"""Precision policies: what dtype each part of training uses, and applying that to a model."""

from mixprec.policy.autocast import autocast, check_device_supports
from mixprec.policy.casting import cast_module, fp32_modules
from mixprec.policy.hardware import DeviceCaps, device_caps
from mixprec.policy.op_overrides import FP32Ops
from mixprec.policy.parse import get_policy
from mixprec.policy.policy import Policy
from mixprec.policy.presets import PRESETS

__all__ = [
    "PRESETS",
    "DeviceCaps",
    "FP32Ops",
    "Policy",
    "autocast",
    "cast_module",
    "check_device_supports",
    "device_caps",
    "fp32_modules",
    "get_policy",
]
