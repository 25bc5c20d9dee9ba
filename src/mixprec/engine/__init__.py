"""The training-step engine: MixedPrecision, what its step returns, its statistics, and the guards of its step.

Names load on first use, so that a framework's guard can register itself (:mod:`mixprec.engine.guards`)
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.lazy import lazy_names

if TYPE_CHECKING:
    from mixprec.engine.guards import register_guard
    from mixprec.engine.memory import saved_activation_bytes
    from mixprec.engine.mixed_precision import MixedPrecision
    from mixprec.engine.setup import default_scaler, needs_compensated_optimizer
    from mixprec.engine.stats import StateBytes, Stats
    from mixprec.engine.step_result import StepResult

_SOURCES = {
    "MixedPrecision": "mixprec.engine.mixed_precision",
    "default_scaler": "mixprec.engine.setup",
    "needs_compensated_optimizer": "mixprec.engine.setup",
    "StateBytes": "mixprec.engine.stats",
    "Stats": "mixprec.engine.stats",
    "StepResult": "mixprec.engine.step_result",
    "register_guard": "mixprec.engine.guards",
    "saved_activation_bytes": "mixprec.engine.memory",
}

__getattr__, __dir__ = lazy_names(__name__, globals(), _SOURCES)

__all__ = [
    "MixedPrecision",
    "StateBytes",
    "Stats",
    "StepResult",
    "default_scaler",
    "needs_compensated_optimizer",
    "register_guard",
    "saved_activation_bytes",
]
