"""Loss scalers: one protocol; no scaling, a fixed scale, or a dynamic one."""

from mixprec.scaling.base import LossScaler
from mixprec.scaling.dynamic import DynamicLossScaler
from mixprec.scaling.static import NoOpLossScaler, StaticLossScaler

__all__ = ["DynamicLossScaler", "LossScaler", "NoOpLossScaler", "StaticLossScaler"]
