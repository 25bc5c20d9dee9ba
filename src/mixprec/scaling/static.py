"""Scalers whose scale never changes: none at all, or a fixed factor.

Both still run the fused finite check in ``unscale_``, so a step whose gradients hold inf or NaN is
skipped under any scaler: bf16 and FP32 runs are protected too.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.checks import positive_number
from mixprec.scaling.base import LossScaler, check_state_type

__all__ = ["NoOpLossScaler", "StaticLossScaler"]


class NoOpLossScaler(LossScaler):
    """No loss scaling (scale 1): the default for bf16 and FP32 policies.

    Example:
        >>> NoOpLossScaler().get_scale()
        1.0
    """

    def __init__(self) -> None:
        super().__init__(1.0)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        super().scale(loss)  # validates and places the scale; the loss itself is returned unchanged
        return loss

    def update(self, found_inf: torch.Tensor) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"type": "none"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_keys(state, {"type"})
        check_state_type(self, state, "none")

    def __repr__(self) -> str:
        return "NoOpLossScaler()"


class StaticLossScaler(LossScaler):
    """A fixed loss scale: overflowing steps are skipped, the scale stays.

    Args:
        scale: a positive, finite factor; powers of two keep scaling exact.
    """

    def __init__(self, scale: float) -> None:
        super().__init__(positive_number(scale, "StaticLossScaler(scale=...)"))

    def update(self, found_inf: torch.Tensor) -> None:
        pass

    def is_floor(self, scale: float) -> bool:
        return scale <= 1.0  # above 1, a smaller static scale might still cure the overflow

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "scale": self.get_scale()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_keys(state, {"type", "scale"})
        check_state_type(self, state, "static")
        self._load_scale(positive_number(state["scale"], "StaticLossScaler state 'scale'"))

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._init_scale})"  # a static scale never moves: no device read
