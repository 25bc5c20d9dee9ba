"""The doctor: see where the numbers go wrong.

RangeWatch        per module and phase: amax, underflow / subnormal / overflow fractions per
                  format, log2-magnitude histograms (opt-in, removable hooks)
NonFiniteTracer   the first module, phase and kind (inf or NaN) of each step's first non-finite value
diagnose          FP32 steps with the hooks on; the loss scale and policy it recommends, with reasons
fp8_recipe_report each GEMM layer's output error under each FP8 recipe, and the layers to keep out of FP8

The histograms as a PNG are drawn by the application: :func:`mixprec.app.histograms.plot_histograms`.
"""

from mixprec.doctor.advice import Diagnosis, FormatAdvice, diagnose, recommend_scale
from mixprec.doctor.fp8_recipes import FP8_RECIPES, Fp8RecipeReport, RecipeFit, fp8_recipe_report
from mixprec.doctor.policy_file import (
    PolicyAdvice,
    check_policy_target,
    policy_and_scale,
    read_policy_file,
    write_policy_file,
)
from mixprec.doctor.report import PHASES, DoctorReport, FormatRange, Histogram, ModuleStats
from mixprec.doctor.trace import NonFiniteEvent, NonFiniteTracer
from mixprec.doctor.watch import DEFAULT_FORMATS, RangeWatch

__all__ = [
    "DEFAULT_FORMATS",
    "FP8_RECIPES",
    "PHASES",
    "Diagnosis",
    "DoctorReport",
    "FormatAdvice",
    "FormatRange",
    "Fp8RecipeReport",
    "Histogram",
    "ModuleStats",
    "NonFiniteEvent",
    "NonFiniteTracer",
    "PolicyAdvice",
    "RangeWatch",
    "RecipeFit",
    "check_policy_target",
    "diagnose",
    "fp8_recipe_report",
    "policy_and_scale",
    "read_policy_file",
    "recommend_scale",
    "write_policy_file",
]
