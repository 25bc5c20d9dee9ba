"""mixprec: mixed-precision training for PyTorch.

Public API; everything not re-exported here is private and may change.
"""

from importlib.metadata import PackageNotFoundError, version

from mixprec import distributed, doctor, fp8
from mixprec.distributed import fully_shard
from mixprec.doctor import NonFiniteTracer, RangeWatch, diagnose
from mixprec.engine import MixedPrecision, StateBytes, Stats, StepResult
from mixprec.fp8 import Fp8Recipe
from mixprec.master import AdamW
from mixprec.numerics import FORMATS, ROUNDING_MODES, Format, get_format, quantize
from mixprec.policy import (
    PRESETS,
    DeviceCaps,
    FP32Ops,
    Policy,
    autocast,
    cast_module,
    device_caps,
    fp32_modules,
    get_policy,
)
from mixprec.scaling import DynamicLossScaler, LossScaler, NoOpLossScaler, StaticLossScaler
from mixprec.train import TaskConfig, TaskParts, TrainConfig, Trainer

try:
    __version__ = version("mixprec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "FORMATS",
    "PRESETS",
    "ROUNDING_MODES",
    "AdamW",
    "DeviceCaps",
    "DynamicLossScaler",
    "FP32Ops",
    "Format",
    "Fp8Recipe",
    "LossScaler",
    "MixedPrecision",
    "NoOpLossScaler",
    "NonFiniteTracer",
    "Policy",
    "RangeWatch",
    "StateBytes",
    "StaticLossScaler",
    "Stats",
    "StepResult",
    "TaskConfig",
    "TaskParts",
    "TrainConfig",
    "Trainer",
    "__version__",
    "autocast",
    "cast_module",
    "device_caps",
    "diagnose",
    "distributed",
    "doctor",
    "fp8",
    "fp32_modules",
    "fully_shard",
    "get_format",
    "get_policy",
    "quantize",
]
