"""mixprec: mixed-precision training for PyTorch.

Public API; everything not re-exported here is private and may change. Names load on first use
(PEP 562), so that ``import mixprec`` and the ``mixprec`` command's ``--help`` and usage errors do not
pay for importing torch; the imports below, for type checkers and import-layer tools, are the same
arrows.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

# Each public name and the module it comes from (a subpackage's own name: the subpackage itself).
_SOURCES = {
    "distributed": "mixprec.distributed",
    "doctor": "mixprec.doctor",
    "fp8": "mixprec.fp8",
    "fully_shard": "mixprec.distributed",
    "NonFiniteTracer": "mixprec.doctor",
    "RangeWatch": "mixprec.doctor",
    "diagnose": "mixprec.doctor",
    "MixedPrecision": "mixprec.engine",
    "StateBytes": "mixprec.engine",
    "Stats": "mixprec.engine",
    "StepResult": "mixprec.engine",
    "Fp8Recipe": "mixprec.fp8",
    "AdamW": "mixprec.master",
    "FORMATS": "mixprec.numerics",
    "ROUNDING_MODES": "mixprec.numerics",
    "Format": "mixprec.numerics",
    "get_format": "mixprec.numerics",
    "quantize": "mixprec.numerics",
    "PRESETS": "mixprec.policy",
    "DeviceCaps": "mixprec.policy",
    "FP32Ops": "mixprec.policy",
    "Policy": "mixprec.policy",
    "autocast": "mixprec.policy",
    "cast_module": "mixprec.policy",
    "device_caps": "mixprec.policy",
    "fp32_modules": "mixprec.policy",
    "get_policy": "mixprec.policy",
    "DynamicLossScaler": "mixprec.scaling",
    "LossScaler": "mixprec.scaling",
    "NoOpLossScaler": "mixprec.scaling",
    "StaticLossScaler": "mixprec.scaling",
    "TaskConfig": "mixprec.train",
    "TaskParts": "mixprec.train",
    "TrainConfig": "mixprec.train",
    "Trainer": "mixprec.train",
}


def __getattr__(name: str) -> object:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'mixprec' has no attribute {name!r}")
    module = importlib.import_module(source)
    value = module if source == f"mixprec.{name}" else getattr(module, name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


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
