"""The training-step engine: MixedPrecision, what its step returns, and its statistics."""

from mixprec.engine.mixed_precision import MixedPrecision, StepResult, default_scaler, needs_compensated_optimizer
from mixprec.engine.stats import StateBytes, Stats

__all__ = ["MixedPrecision", "StateBytes", "Stats", "StepResult", "default_scaler", "needs_compensated_optimizer"]
