"""Scalers whose scale never changes: none at all, or a fixed factor.

Both still run the finite check in ``unscale_``, so a step whose gradients hold inf or NaN is
skipped under any scaler: bf16 and FP32 runs are protected too. With no scale, nothing is divided: off the CPU
the check is one read-only pass (each gradient's max magnitude, which also tells inf from NaN), where PyTorch's
AMP kernel would write every value back multiplied by one; on the CPU that kernel is the fastest read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mixprec.checks import loss_scale, positive_number
from mixprec.numerics.finite import Grouped, magnitudes_not_finite, max_magnitudes
from mixprec.scaling.base import LossScaler, check_state_type, device_of

__all__ = ["NoOpLossScaler", "StaticLossScaler"]

# where PyTorch's AMP kernel (unscale by one, and check) reads gradients faster than their max magnitudes do
_AMP_KERNEL_DEVICES = ("cpu",)


class NoOpLossScaler(LossScaler):
    """No loss scaling (scale 1): the default for bf16 and FP32 policies.

    Example:
        >>> NoOpLossScaler().get_scale()
        1.0
    """

    def __init__(self) -> None:
        super().__init__(1.0)

    @property
    def fixed_scale(self) -> float:
        return 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self._scale_on(self._checked(loss).device)  # placed where a scale would be; the loss itself unchanged
        return loss

    def unscale_(self, grads: Sequence[torch.Tensor] | Grouped) -> torch.Tensor:
        """Check ``grads`` (nothing to divide by one); the flag as :meth:`LossScaler.unscale_` returns it."""
        return self.unscale_checked_(grads)[0]

    def unscale_checked_(self, grads: Sequence[torch.Tensor] | Grouped) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = device_of(grads)
        if device.type in _AMP_KERNEL_DEVICES:  # the fastest read there; a multiply by one changes nothing
            return super().unscale_(grads), None
        scale = self._scale_on(device)  # the flag on the scale's device, as the AMP kernel's
        magnitudes = max_magnitudes(grads, scale.device)
        return magnitudes_not_finite(magnitudes), magnitudes

    def update(self, found_inf: torch.Tensor) -> None:
        self._checked(found_inf, "update(found_inf=...)")

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
        super().__init__(loss_scale(scale, "StaticLossScaler(scale=...)"))

    def update(self, found_inf: torch.Tensor) -> None:
        self._checked(found_inf, "update(found_inf=...)")

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
