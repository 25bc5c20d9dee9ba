"""Precision policies as values: what dtype each part of training uses, the string grammar, the presets.

What runs a policy lives in :mod:`mixprec.regions`; how 16-bit arithmetic is computed on a machine, in
:mod:`mixprec.compute`.
"""

from mixprec.policy.export import EXPORT_DTYPES, export_policy
from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.policy.parse import RUN_OPTIONS, get_policy, parse_policy_list, resumes_under
from mixprec.policy.policy import DTYPE_NAMES, NORM, Policy
from mixprec.policy.presets import PRESET_ALIASES, PRESETS

__all__ = [
    "DTYPE_NAMES",
    "EXPORT_DTYPES",
    "NORM",
    "PRESETS",
    "PRESET_ALIASES",
    "RUN_OPTIONS",
    "Fp8Recipe",
    "Policy",
    "export_policy",
    "get_policy",
    "parse_policy_list",
    "resumes_under",
]
