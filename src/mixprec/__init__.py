"""mixprec: mixed-precision training for PyTorch.

The library's public API (listed in docs/api.md); everything not re-exported here is private and may
change. The application (the Trainer, built-in tasks, runs, reports, benchmarks, the ``mixprec``
command) is :mod:`mixprec.app`, built on this API; ``import mixprec`` never loads it. Names load on first use
(PEP 562), so that ``import mixprec`` and the ``mixprec`` command's ``--help`` and usage errors do not
pay for importing torch; the imports below, for type checkers and import-layer tools, are the same
arrows.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from mixprec.lazy import lazy_names

if TYPE_CHECKING:
    from mixprec import distributed, doctor, parallel
    from mixprec.compute import DeviceCaps, device_caps
    from mixprec.doctor import NonFiniteTracer, RangeWatch, diagnose
    from mixprec.engine import MixedPrecision, StateBytes, Stats, StepResult
    from mixprec.master import AdamW
    from mixprec.numerics import FORMATS, ROUNDING_MODES, Format, get_format, quantize
    from mixprec.parallel import fully_shard
    from mixprec.policy import PRESETS, Fp8Recipe, Policy, get_policy
    from mixprec.regions import (
        ComputePlan,
        FP32Ops,
        Prepared,
        autocast,
        cast_module,
        checkpoint,
        fp8,
        fp32_modules,
        prepare,
        recompute_context,
    )
    from mixprec.scaling import DynamicLossScaler, LossScaler, NoOpLossScaler, StaticLossScaler

try:
    __version__ = version("mixprec")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

# Each public name and the module it comes from (a subpackage: the subpackage itself).
_SOURCES = {
    "distributed": "mixprec.distributed",
    "doctor": "mixprec.doctor",
    "fp8": "mixprec.regions.fp8",
    "parallel": "mixprec.parallel",
    "fully_shard": "mixprec.parallel",
    "NonFiniteTracer": "mixprec.doctor",
    "RangeWatch": "mixprec.doctor",
    "diagnose": "mixprec.doctor",
    "MixedPrecision": "mixprec.engine",
    "StateBytes": "mixprec.engine",
    "Stats": "mixprec.engine",
    "StepResult": "mixprec.engine",
    "Fp8Recipe": "mixprec.policy",
    "AdamW": "mixprec.master",
    "FORMATS": "mixprec.numerics",
    "ROUNDING_MODES": "mixprec.numerics",
    "Format": "mixprec.numerics",
    "get_format": "mixprec.numerics",
    "quantize": "mixprec.numerics",
    "PRESETS": "mixprec.policy",
    "DeviceCaps": "mixprec.compute",
    "ComputePlan": "mixprec.regions",
    "FP32Ops": "mixprec.regions",
    "Prepared": "mixprec.regions",
    "prepare": "mixprec.regions",
    "Policy": "mixprec.policy",
    "autocast": "mixprec.regions",
    "cast_module": "mixprec.regions",
    "checkpoint": "mixprec.regions",
    "recompute_context": "mixprec.regions",
    "device_caps": "mixprec.compute",
    "fp32_modules": "mixprec.regions",
    "get_policy": "mixprec.policy",
    "DynamicLossScaler": "mixprec.scaling",
    "LossScaler": "mixprec.scaling",
    "NoOpLossScaler": "mixprec.scaling",
    "StaticLossScaler": "mixprec.scaling",
    "tune": "mixprec.app.tune.run",  # the application's search (loads mixprec.app, and torch, on first use)
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _SOURCES)

# The framework probes register their guards with the engine (imports no framework, no torch).
import mixprec.integrations  # noqa: E402, F401

__all__ = [
    "FORMATS",
    "PRESETS",
    "ROUNDING_MODES",
    "AdamW",
    "ComputePlan",
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
    "Prepared",
    "RangeWatch",
    "StateBytes",
    "StaticLossScaler",
    "Stats",
    "StepResult",
    "__version__",
    "autocast",
    "cast_module",
    "checkpoint",
    "device_caps",
    "diagnose",
    "distributed",
    "doctor",
    "fp8",
    "fp32_modules",
    "fully_shard",
    "get_format",
    "get_policy",
    "parallel",
    "prepare",
    "quantize",
    "recompute_context",
]
